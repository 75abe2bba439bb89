"""A LoRA adapter is part of a request's block hashes, and adapters take scheduler slots."""

from __future__ import annotations

import pytest
from kv_config_builders import full
from scheduler_drive import make_scheduler

from scheduler.kv_cache.builder import build_kv_cache_config
from scheduler.lora import LoRAConfig, LoRARequest, prefix_salt, upcoming_adapters
from scheduler.request import Request, SamplingParams

PROMPT = list(range(12))


def _hashes(lora: LoRARequest | None, cache_salt: str | None = None) -> list[bytes]:
    request = Request(
        "r", PROMPT, SamplingParams(), hash_block_size=4, cache_salt=cache_salt, lora_request=lora
    )
    return request.block_hashes


def test_adapter_changes_every_block_hash_and_only_its_name_counts() -> None:
    base = _hashes(None)
    one = _hashes(LoRARequest("one", 1, "/a"))
    assert len(one) == 3
    assert all(a != b for a, b in zip(base, one, strict=True))
    assert _hashes(LoRARequest("two", 1, "/a")) != one
    assert _hashes(LoRARequest("one", 7, "/moved/one")) == one  # id and path are not identity
    assert _hashes(LoRARequest("one", 1, "/a"), cache_salt="s") not in (one, _hashes(None, "s"))


def test_prefix_salt_never_confuses_a_salt_with_an_adapter() -> None:
    keys = [
        prefix_salt(None, None),
        prefix_salt("s", None),
        prefix_salt(None, "s"),
        prefix_salt("s", "s"),
        prefix_salt(prefix_salt(None, "s"), None),  # a salt spelled like an adapter key
        prefix_salt("", "a"),
    ]
    assert len(set(keys)) == len(keys)
    assert prefix_salt("plain", None) == "plain"  # salted requests keep their hashes


def test_lora_request_and_config_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/a")
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("one", 1, "")
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)


def test_waiting_request_waits_for_an_adapter_slot() -> None:
    """With two slots, a third adapter waits (FCFS head) until an adapter's requests leave."""
    kv = build_kv_cache_config({"l0": full(bs=4)}, 64 * full(bs=4).page_size_bytes)
    scheduler = make_scheduler(kv, max_loras=2, max_num_batched_tokens=64)
    for req_id, name in (("1", "a"), ("2", "b"), ("3", "c"), ("4", "a"), ("5", None)):
        lora = None if name is None else LoRARequest(name, 1, f"/{name}")
        scheduler.add_request(
            Request(req_id, PROMPT[:5], SamplingParams(max_tokens=4), 4, lora_request=lora)
        )
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["1", "2"]
    assert [lora.lora_name for lora in out.upcoming_loras] == ["c", "a"]  # workers prefetch them
    stats = scheduler.make_stats()  # vLLM's lora_requests_info labels
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == (("a", "b"), ("a", "c"))
    assert stats.max_lora == 2
    scheduler.abort(["1"])  # adapter a leaves the running set: c gets its slot, then a waits
    scheduled = scheduler.schedule().num_scheduled_tokens
    assert "3" in scheduled
    assert "4" not in scheduled  # adapters b and c hold both slots
    assert {r.req_id for r in scheduler.running} == {"2", "3"}


def test_upcoming_adapters_are_the_first_distinct_ones_of_the_queue_head() -> None:
    """At most max_loras adapters, from the first num_requests waiting requests only."""
    names = ["a", None, "a", "b", "c"]
    waiting = [
        Request(str(i), PROMPT, SamplingParams(), 4, lora_request=LoRARequest(name, 1, "/x"))
        if name is not None
        else Request(str(i), PROMPT, SamplingParams(), 4)
        for i, name in enumerate(names)
    ]

    def upcoming(max_loras: int | None, num_requests: int) -> list[str]:
        return [lora.lora_name for lora in upcoming_adapters(waiting, max_loras, num_requests)]

    assert upcoming(2, 5) == ["a", "b"]
    assert upcoming(8, 5) == ["a", "b", "c"]
    assert upcoming(8, 3) == ["a"]  # only requests one step could admit
    assert upcoming(None, 5) == []  # LoRA off
