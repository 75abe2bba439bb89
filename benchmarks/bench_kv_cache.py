"""CPU cost of the KV cache core: prefix lookup, allocation and freeing of 32k-token prompts that
share a prefix, one decode step of 256 running requests, and candidate block-hash functions.

Models (block size 16, one group per line of the KV cache config):
  full:           one full-attention group;
  gemma3:         full + 5 sliding-window groups (window 1024, equal specs: one bucket);
  full+sw+mamba:  full + sliding window (1024) + Mamba state (align mode, block-aligned prefill).
Each prompt is a 24k-token shared prefix plus an 8k-token unique suffix, so every lookup after the
first hits 24k tokens. Lookup, allocation and free are timed per call (median over requests) and
also per hashed token (ns / (prompt tokens)). Hash candidates are timed on one 32k-token prompt and
reported as ratios to the one `scheduler.block_hash` uses, measured in the same run.

    .venv/bin/python benchmarks/bench_kv_cache.py [--requests 20] [--eviction chain|lru]
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import statistics
import time
from array import array
from collections.abc import Callable

import xxhash

from scheduler.block_hash import SEED, extend_block_hashes
from scheduler.kv_cache.eviction import EvictionPolicy
from scheduler.kv_cache.manager import KVCacheManager
from scheduler.kv_cache.spec import KVCacheSpec, MambaCacheMode
from scheduler.kv_cache.spec_factory import (
    AttentionShape,
    MambaShape,
    make_spec,
    one_layer_groups_config,
)
from scheduler.prefill_split import block_aligned_num_tokens
from scheduler.request import Request, SamplingParams

BLOCK = 16
PROMPT = 32_768
SHARED = 24_576
WINDOW = 1024
ATTENTION = AttentionShape(num_kv_heads=8, head_size=128, dtype_bytes=2)


def model_specs() -> dict[str, list[KVCacheSpec]]:
    full = make_spec("full_attention", BLOCK, shape=ATTENTION)
    sliding = make_spec("sliding_window", BLOCK, WINDOW, shape=ATTENTION)
    state = make_spec(
        "mamba",
        BLOCK,
        shape=MambaShape(shapes=((4, 4096), (64, 128, 16)), dtype_bytes=(2, 4)),
        mamba_cache_mode=MambaCacheMode.ALIGN,
    )
    return {
        "full": [full],
        "gemma3": [full] + [sliding] * 5,
        "full+sw+mamba": [full, sliding, state],
    }


def make_manager(
    specs: list[KVCacheSpec], num_blocks: int, eviction: EvictionPolicy = EvictionPolicy.CHAIN
) -> KVCacheManager:
    config = one_layer_groups_config(num_blocks, specs)
    return KVCacheManager(config, max_model_len=2 * PROMPT, eviction=eviction)


def make_prompt(index: int) -> list[int]:
    return list(range(SHARED)) + [100_000 + index * PROMPT + t for t in range(PROMPT - SHARED)]


def prefill(manager: KVCacheManager, request: Request) -> tuple[float, float]:
    """Lookup and allocation of a whole prompt (in block-aligned chunks when required)."""
    start = time.perf_counter()
    hit = manager.get_computed_blocks(request)
    looked_up = time.perf_counter()
    computed, first = hit.num_tokens, True
    while computed < request.num_tokens:
        size = request.num_tokens - computed
        if manager.needs_block_aligned_prefill:
            size = block_aligned_num_tokens(
                request.num_tokens, manager.alignment_tokens, computed, size, hit.junction_tokens
            )
        blocks = manager.allocate_slots(
            request, size, hit.num_tokens if first else 0, hit.blocks if first else None
        )
        assert blocks is not None, "pool too small"
        computed += size
        request.num_computed_tokens, first = computed, False
    return looked_up - start, time.perf_counter() - looked_up


def bench_prefill(
    specs: list[KVCacheSpec], num_requests: int, eviction: EvictionPolicy
) -> dict[str, float]:
    manager = make_manager(specs, len(specs) * 2 * PROMPT // BLOCK + 16, eviction)
    lookups, allocs, frees = [], [], []
    for index in range(num_requests + 1):
        request = Request(f"r{index}", make_prompt(index), SamplingParams(), BLOCK)
        lookup, alloc = prefill(manager, request)
        start = time.perf_counter()
        manager.free(request)
        free = time.perf_counter() - start
        if index:  # the first request only fills the cache
            lookups.append(lookup)
            allocs.append(alloc)
            frees.append(free)
    return {
        name: statistics.median(values)
        for name, values in (("lookup", lookups), ("allocate", allocs), ("free", frees))
    }


def bench_decode(
    specs: list[KVCacheSpec], eviction: EvictionPolicy, num_requests: int = 256, steps: int = 64
) -> float:
    """Median seconds of one decode step: allocate_slots(1 token) for every running request."""
    manager = make_manager(specs, len(specs) * num_requests * 80 + 16, eviction)
    requests = []
    for index in range(num_requests):
        request = Request(f"d{index}", [index % 7] * 500 + [index, 1, 2], SamplingParams(), BLOCK)
        hit = manager.get_computed_blocks(request)
        num_new = request.num_tokens - hit.num_tokens
        assert manager.allocate_slots(request, num_new, hit.num_tokens, hit.blocks) is not None
        request.num_computed_tokens = request.num_tokens
        requests.append(request)
    durations = []
    for _ in range(steps):
        for request in requests:
            request.append_output_token_ids([3])
        start = time.perf_counter()
        for request in requests:
            manager.allocate_slots(request, 1)
            request.num_computed_tokens += 1
        durations.append(time.perf_counter() - start)
    return statistics.median(durations)


STEP_BYTES = BLOCK * 8


def in_use(tokens: list[int]) -> object:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, BLOCK)
    return hashes


def packed(digest: Callable[[bytes], bytes]) -> Callable[[list[int]], object]:
    """Chain `digest(parent + block bytes)` over one packed buffer of the prompt."""

    def run(tokens: list[int]) -> object:
        data, parent, out = array("q", tokens).tobytes(), SEED, []
        for offset in range(0, len(data), STEP_BYTES):
            parent = digest(parent + data[offset : offset + STEP_BYTES])
            out.append(parent)
        return out

    return run


def per_block_streaming(tokens: list[int]) -> object:
    parent, out = SEED, []
    for start in range(0, len(tokens), BLOCK):
        hasher = xxhash.xxh3_128(parent)
        hasher.update(array("q", tokens[start : start + BLOCK]).tobytes())
        parent = hasher.digest()
        out.append(parent)
    return out


def sha256_pickle(tokens: list[int]) -> object:
    parent, out = SEED, []
    for start in range(0, len(tokens), BLOCK):
        key = (parent, tuple(tokens[start : start + BLOCK]), None)
        parent = hashlib.sha256(pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


def builtin_tuple_hash(tokens: list[int]) -> object:
    parent, out = 0, []
    for start in range(0, len(tokens), BLOCK):
        parent = hash((parent, tuple(tokens[start : start + BLOCK])))
        out.append(parent)
    return out


def hash_candidates() -> dict[str, Callable[[list[int]], object]]:
    """Ways to chain-hash blocks of 16 tokens; the first is the one in use (the baseline)."""
    return {
        "xxh3_128, one packed buffer (in use)": in_use,
        "xxh3_128, array per block, streaming": per_block_streaming,
        "xxh3_64, one packed buffer": packed(xxhash.xxh3_64_digest),
        "blake2b-128, one packed buffer": packed(
            lambda data: hashlib.blake2b(data, digest_size=16).digest()
        ),
        "sha256, one packed buffer": packed(lambda data: hashlib.sha256(data).digest()),
        "sha256 over pickle (vLLM default)": sha256_pickle,
        "builtin hash of tuples (not stable)": builtin_tuple_hash,
    }


def bench_hashes(repeats: int = 7) -> dict[str, float]:
    tokens = make_prompt(0)
    timings = {}
    for name, function in hash_candidates().items():
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            function(tokens)
            samples.append(time.perf_counter() - start)
        timings[name] = min(samples)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--eviction", choices=[p.value for p in EvictionPolicy], default="chain")
    args = parser.parse_args()
    eviction = EvictionPolicy(args.eviction)
    print(
        f"prompts of {PROMPT} tokens ({SHARED} shared), block {BLOCK}; medians over "
        f"{args.requests} requests"
    )
    print(
        "| model | lookup µs | allocate µs | free µs | lookup ns/token | allocate ns/token "
        "| free ns/token | decode step (256 req) µs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, specs in model_specs().items():
        times = bench_prefill(specs, args.requests, eviction)
        decode = bench_decode(specs, eviction)
        per_call = " | ".join(f"{times[k] * 1e6:.0f}" for k in ("lookup", "allocate", "free"))
        per_token = " | ".join(
            f"{times[k] * 1e9 / PROMPT:.1f}" for k in ("lookup", "allocate", "free")
        )
        print(f"| {name} | {per_call} | {per_token} | {decode * 1e6:.0f} |")
    hashes = bench_hashes()
    baseline = next(iter(hashes.values()))
    print("\n| hash candidate | ns/token | time vs in use |")
    print("|---|---|---|")
    for name, seconds in hashes.items():
        print(f"| {name} | {seconds * 1e9 / PROMPT:.1f} | {seconds / baseline:.2f}x |")


if __name__ == "__main__":
    main()
