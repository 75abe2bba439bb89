"""A real tiny Mamba hybrid engine (Bamba: Mamba layers 0, 2, 3, attention layer 1) started with
more `max_num_seqs` than its pool has state slots runs with the slots, says so in one warning
line, and logs the maximum concurrency of each group alone; started within them, it keeps the
setting and warns of nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from cluster import LLM
from scheduler.kv_cache.spec import MambaSpec, manager_spec
from tests.helpers.tiny_hybrid import save_tiny_hybrid

MAX_MODEL_LEN = 200


@pytest.mark.parametrize("max_num_seqs", [4096, 8])
def test_max_num_seqs_is_clamped_to_the_state_slots_at_start_up(
    max_num_seqs: int, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_tiny_hybrid("bamba", tmp_path)
    with caplog.at_level(logging.INFO, logger="cluster.engine.core"):
        llm = LLM(
            str(tmp_path),
            dtype="float32",
            block_size=4,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=32,
            max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=1 << 21,
        )
    try:
        scheduler = llm.client.core.scheduler
        config = scheduler.kv_cache_config
    finally:
        llm.shutdown()
    kinds = [manager_spec(group.spec).kind for group in config.groups]
    assert kinds == ["mamba", "mamba", "mamba", "full_attention"]
    assert all(isinstance(group.spec, MambaSpec) for group in config.groups[:3])
    usable = config.num_blocks - 1
    slots = usable // 3  # one state block per running request in each of the 3 state groups
    assert slots < 4096
    warnings = [
        record.getMessage()
        for record in caplog.records
        if record.name == "cluster.engine.core" and record.levelno >= logging.WARNING
    ]
    if max_num_seqs > slots:
        assert scheduler.config.max_num_seqs == slots
        assert warnings == [
            f"max_num_seqs {max_num_seqs} > {slots} Mamba state slots ({usable} usable blocks, "
            "one per running request in each of groups 0, 1, 2 (mamba, layers 0, 2, 3)): "
            f"using {slots}"
        ]
    else:
        assert scheduler.config.max_num_seqs == max_num_seqs
        assert warnings == []
    per_group = [m for m in caplog.messages if " tokens per request in group " in m]
    assert [line.split(" alone: ")[0] for line in per_group] == [
        f"Maximum concurrency for {MAX_MODEL_LEN} tokens per request in group {group_id} "
        f"({kind}, layer {layer})"
        for group_id, kind, layer in ((0, "mamba", 0), (1, "mamba", 2), (2, "mamba", 3))
    ] + [
        f"Maximum concurrency for {MAX_MODEL_LEN} tokens per request in group 3 "
        "(full_attention, layer 1)"
    ]
    attention_need = -(-MAX_MODEL_LEN // config.groups[3].spec.block_size)  # every token kept
    assert per_group[3].endswith(f" alone: {usable / attention_need:.2f}x")
