"""Replay KV cache traces without a model: `python -m scheduler.replay FILE.json [FILE.json ...]`.

Each file holds a KV cache configuration and a list of prefill / decode / free operations; the
tool prints one JSON line per file with one record per operation (hit length, whether the blocks
could be allocated, free blocks, block tables), or `{"error": ...}` for a file it cannot run, and
exits with status 2 if any file failed; unknown configuration keys are reported on stderr and
under "warnings". For capacity planning and for comparing semantics.
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
from collections.abc import Sequence
from typing import Any

from scheduler.config import OffloadConfig
from scheduler.kv_cache.eviction import EvictionPolicy
from scheduler.kv_cache.manager import KVCacheBlocks, KVCacheManager
from scheduler.kv_cache.spec import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, MambaCacheMode
from scheduler.kv_cache.spec_factory import make_spec
from scheduler.multimodal import MultiModalFeature
from scheduler.prefill_split import block_aligned_num_tokens
from scheduler.replay_keys import unknown_key_warnings
from scheduler.request import Request, RequestStatus, SamplingParams

Record = dict[str, Any]

TRACE_GROUP_TYPES = {
    "full": "full_attention",
    "sliding_window": "sliding_window",
    "chunked_local": "chunked_local_attention",
    "mamba": "mamba",
    "gated_delta_net": "gated_delta_net",
    "short_conv": "short_conv",
}
"""A trace's group `type` -> the spec kind it names (traces keep their short spellings)."""


def _get_int(entry: dict[str, Any], key: str, default: int | None = None) -> int:
    value = entry.get(key, default)
    if value is None:
        raise ValueError(f"{key!r} is missing")
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key!r} must be an integer, got {value!r}")
    return value


def _get_objects(trace: dict[str, Any], key: str) -> list[dict[str, Any]]:
    entries = trace[key]
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise ValueError(f"{key!r} must be a list of objects")
    return entries


def _get_tokens(op: dict[str, Any]) -> list[int]:
    tokens = op.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(token, int) and not isinstance(token, bool) for token in tokens
    ):
        raise ValueError(f"'tokens' must be a list of integers, got {tokens!r}")
    return tokens


def _get_images(op: dict[str, Any]) -> tuple[MultiModalFeature, ...]:
    """A prefill's `images`: [{"id": content id, "offset": first position, "length": n}]."""
    if "images" not in op:
        return ()
    images = _get_objects(op, "images")
    features = []
    for image in images:
        identifier = image.get("id")
        if not isinstance(identifier, str) or not identifier:
            raise ValueError(f"an image's 'id' must be a non-empty string, got {identifier!r}")
        features.append(
            MultiModalFeature(
                "image", identifier, _get_int(image, "offset"), _get_int(image, "length")
            )
        )
    return tuple(features)


def build_spec(
    entry: dict[str, Any], enable_caching: bool, mamba_mode: MambaCacheMode = MambaCacheMode.ALIGN
) -> KVCacheSpec:
    """The spec of one entry of a trace's "groups" list (dummy page sizes: they do not matter
    to the replay)."""
    group_type = entry.get("type")
    if group_type not in TRACE_GROUP_TYPES:
        raise ValueError(f"unknown group type {group_type!r}")
    kind = TRACE_GROUP_TYPES[group_type]
    size = None
    if kind == "sliding_window":
        size = _get_int(entry, "sliding_window")
    elif kind == "chunked_local_attention":
        size = _get_int(entry, "attention_chunk_size")
    mode = mamba_mode if enable_caching else MambaCacheMode.NONE
    return make_spec(kind, _get_int(entry, "block_size"), size, mamba_cache_mode=mode)


def build_manager(trace: dict[str, Any]) -> KVCacheManager:
    """The KV cache manager a trace describes."""
    enable_caching = trace.get("enable_caching", True)
    if not isinstance(enable_caching, bool):
        raise ValueError(f"'enable_caching' must be a boolean, got {enable_caching!r}")
    mamba_mode = MambaCacheMode(_get_choice(trace, "mamba_cache_mode", "align", MambaCacheMode))
    groups = []
    entries = _get_objects(trace, "groups")
    if not entries:
        raise ValueError("'groups' must list at least one KV cache group")
    for index, entry in enumerate(entries):
        num_layers = _get_int(entry, "num_layers", 1)
        names = tuple(f"group{index}.layer{layer}" for layer in range(num_layers))
        groups.append(KVCacheGroupSpec(names, build_spec(entry, enable_caching, mamba_mode)))
    config = KVCacheConfig(
        num_blocks=_get_int(trace, "num_blocks"), groups=tuple(groups), tensors=()
    )
    register_all = trace.get("cache_unreachable_blocks", False)
    if not isinstance(register_all, bool):
        raise ValueError(f"'cache_unreachable_blocks' must be a boolean, got {register_all!r}")
    unit = trace.get("prefix_match_unit")
    if unit is not None and (not isinstance(unit, int) or isinstance(unit, bool) or unit < 1):
        raise ValueError(f"'prefix_match_unit' must be an integer >= 1, got {unit!r}")
    manager = KVCacheManager(
        config,
        max_model_len=_get_int(trace, "max_model_len"),
        prefix_match_unit=unit,
        enable_caching=enable_caching,
        cache_unreachable_blocks=register_all,
        eviction=EvictionPolicy(
            _get_choice(trace, "prefix_cache_eviction", "chain", EvictionPolicy)
        ),
    )
    offload_blocks = _get_int(trace, "kv_offloading_blocks", 0)
    if offload_blocks < 0:
        raise ValueError(f"'kv_offloading_blocks' must be >= 0, got {offload_blocks}")
    if offload_blocks:
        eviction = _get_choice(trace, "kv_offloading_eviction", "chain", EvictionPolicy)
        tier = OffloadConfig(offload_blocks, eviction=EvictionPolicy(eviction))
        manager.enable_offload(tier)  # no tensor plan: 1 per block
    if _get_int(trace, "num_speculative_tokens", 0):
        manager.enable_spec_slots(_get_int(trace, "num_speculative_tokens"))
    return manager


def _get_choice(trace: dict[str, Any], key: str, default: str, choices: type[enum.Enum]) -> str:
    value = trace.get(key, default)
    allowed = [member.value for member in choices]
    if value not in allowed:
        raise ValueError(f"{key!r} must be one of {allowed}, got {value!r}")
    return str(value)


class TraceReplayer:
    """Runs one trace's operations against one manager."""

    def __init__(self, manager: KVCacheManager, num_speculative_tokens: int = 0) -> None:
        self.manager = manager
        self.num_lookahead = num_speculative_tokens
        """Speculative decoding: each decode step also holds the blocks of k draft positions,
        and each decoding request k states per recurrent group."""
        self.requests: dict[str, Request] = {}
        self.miss_totals: list[dict[str, int]] = [{} for _ in range(manager.num_groups)]
        """Per group, tokens of every prefill's lookup it could not serve, by reason."""

    def run(self, ops: Sequence[dict[str, Any]]) -> list[Record]:
        """One record per op, in order; an invalid op raises ValueError naming its index."""
        records = []
        for index, op in enumerate(ops):
            try:
                records.append(self._run_op(index, op))
            except (KeyError, TypeError, ValueError) as error:
                detail = str(error) if isinstance(error, ValueError) else repr(error)
                raise ValueError(f"op {index}: {detail}") from error
        return records

    def _run_op(self, index: int, op: dict[str, Any]) -> Record:
        handlers = {"prefill": self._prefill, "decode": self._decode, "free": self._free}
        name = op.get("op")
        if name not in handlers:
            raise ValueError(f"unknown op {name!r}")
        if "id" not in op:
            raise ValueError("'id' is missing")
        req_id = str(op["id"])
        evictions = self.manager.pool.num_evictions
        record: Record = {"op_index": index, "op": name, "id": req_id}
        record.update(handlers[name](req_id, op))
        self.manager.take_offload_ops()  # the copies a worker would run: none here
        record["free_blocks"] = self.manager.num_free_blocks
        record["evicted"] = self.manager.pool.num_evictions - evictions
        return record

    def _check_length(self, req_id: str, num_tokens: int) -> None:
        if num_tokens > self.manager.max_model_len:
            raise ValueError(
                f"request {req_id!r} would hold {num_tokens} tokens, more than max_model_len "
                f"{self.manager.max_model_len}"
            )

    def _table(self, req_id: str) -> list[list[int]]:
        if req_id not in self.requests:
            return [[] for _ in range(self.manager.num_groups)]
        return [
            [-1 if block_id == 0 else block_id for block_id in group]
            for group in self.manager.get_block_ids(req_id)
        ]

    def _prefill(self, req_id: str, op: dict[str, Any]) -> Record:
        if req_id in self.requests:
            raise ValueError(f"prefill of {req_id!r}, which is still running")
        tokens = _get_tokens(op)
        self._check_length(req_id, len(tokens))
        self.manager.begin_step()
        request = Request(
            req_id,
            tokens,
            SamplingParams(),
            self.manager.hash_block_size,
            mm_features=_get_images(op),
        )
        hit = self.manager.explain_misses(request, self.manager.get_computed_blocks(request))
        misses = [dict(group) for group in hit.misses] or [{} for _ in self.miss_totals]
        for totals, group in zip(self.miss_totals, misses, strict=True):
            for reason, count in group.items():
                totals[reason] = totals.get(reason, 0) + count
        chunks = self._schedule_prompt(request, hit.num_tokens, hit.blocks, hit.junction_tokens)
        allocated = chunks is not None
        if allocated:
            self.requests[req_id] = request
        return {
            "hit_tokens": hit.num_tokens,
            "offloaded_blocks": hit.num_offloaded_blocks,
            "allocated": allocated,
            "block_ids": self._table(req_id),
            "chunks": chunks or [],
            "shared_prefix_boundary": hit.junction_tokens,
            "misses": misses,
        }

    def _schedule_prompt(
        self, request: Request, num_hit: int, hit_blocks: KVCacheBlocks, junction: int
    ) -> list[int] | None:
        """Allocate the prompt after the hit, in block-aligned chunks when required.

        Admission needs room for the whole prompt; a later chunk that cannot be allocated
        drops the request. Returns the chunk sizes, or None when the request was dropped.
        """
        manager = self.manager
        num_prompt = request.num_tokens
        needed = manager.get_num_blocks_to_allocate(
            request, num_prompt - num_hit, num_hit, hit_blocks
        )
        if needed > manager.num_free_blocks:
            return None
        chunks: list[int] = []
        computed = num_hit
        while computed < num_prompt:
            size = num_prompt - computed
            if manager.needs_block_aligned_prefill:
                size = block_aligned_num_tokens(
                    num_prompt, manager.alignment_tokens, computed, size, junction
                )
            first = not chunks
            new_blocks = manager.allocate_slots(
                request, size, num_hit if first else 0, hit_blocks if first else None
            )
            if new_blocks is None:
                manager.free(request)
                return None
            if first and num_hit:
                request.num_computed_tokens = num_hit  # the hit, as the scheduler has it
                manager.finish_load(request, succeeded=True)  # loads are instant here
            computed += size
            request.num_computed_tokens = computed
            chunks.append(size)
            manager.take_step_ops()  # a step ran: its checkpoints are written
            manager.begin_step()
        return chunks

    def _decode(self, req_id: str, op: dict[str, Any]) -> Record:
        tokens = _get_tokens(op)
        request = self.requests.get(req_id)
        if request is None:
            return {"allocated": False, "skipped": True, "block_ids": self._table(req_id)}
        allocated = True
        self._check_length(req_id, request.num_tokens + len(tokens))
        slots = self.manager.spec_slots
        for token in tokens:
            request.append_output_token_ids([token])
            num_new = request.num_tokens - request.num_computed_tokens
            blocks = self.manager.allocate_slots(
                request, num_new, num_lookahead_tokens=self.num_lookahead
            )
            if blocks is None or (slots is not None and not slots.reserve(req_id)):
                allocated = False
                break
            request.num_computed_tokens += num_new
            self.manager.take_step_ops()  # a step ran: its checkpoints are written
            self.manager.begin_step()
        return {"allocated": allocated, "block_ids": self._table(req_id)}

    def _free(self, req_id: str, op: dict[str, Any]) -> Record:
        request = self.requests.pop(req_id, None)
        if request is not None:
            request.status = RequestStatus.FINISHED_STOPPED
            self.manager.free(request)
        return {}


def replay_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """The output object of one trace: {"results": [...]}, plus "warnings" naming the keys the
    tool does not know (each with the closest known one), when there are any."""
    if not isinstance(trace, dict):
        raise ValueError("a trace must be a JSON object")
    warnings = unknown_key_warnings(trace)
    manager = build_manager(trace)
    replayer = TraceReplayer(manager, _get_int(trace, "num_speculative_tokens", 0))
    output: dict[str, Any] = {"results": replayer.run(_get_objects(trace, "ops"))}
    output["miss_tokens"] = replayer.miss_totals
    if warnings:
        output["warnings"] = warnings
    return output


def replay_file(path: str) -> tuple[dict[str, Any], bool]:
    """(output object, ok) for one file; errors become {"error": message}."""
    try:
        with open(path, encoding="utf-8") as handle:
            trace = json.load(handle)
        return replay_trace(trace), True
    except (OSError, ValueError, KeyError, TypeError) as error:
        kind = type(error).__name__
        return {"error": f"{path}: {kind}: {error}"}, False


def main(argv: Sequence[str] | None = None) -> int:
    """Replay every file; print one JSON line each; return 2 if any failed."""
    parser = argparse.ArgumentParser(
        prog="python -m scheduler.replay", description=__doc__.splitlines()[0]
    )
    parser.add_argument("files", nargs="+", metavar="FILE.json")
    args = parser.parse_args(argv)
    status = 0
    for path in args.files:
        output, ok = replay_file(path)
        for warning in output.get("warnings", ()):
            sys.stderr.write(f"{path}: warning: {warning}\n")
        sys.stdout.write(json.dumps(output) + "\n")
        sys.stdout.flush()
        if not ok:
            status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
