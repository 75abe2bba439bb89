"""Property tests: random hybrid configurations and request histories keep the KV cache sound.

A small scheduler model admits, prefills (in chunks, block-aligned when a Mamba group needs it),
decodes, preempts and frees requests; a shadow of the worker records what each block holds after
every step. After every operation: pool and table invariants, every cached hash maps to a block
holding exactly the tokens it names, hits are whole aligned blocks that give each layer type what
it reads, and a twin manager without the decode fast path is in exactly the same state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from kv_cache_helpers import full, make_config, make_request, mamba, model_specs

from scheduler.kv_cache.manager import CacheHit, KVCacheManager
from scheduler.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)
from scheduler.prefill_split import block_aligned_num_tokens
from scheduler.request import Request

BASE = [1000 + index for index in range(48)]
MAX_MODEL_LEN = 96


class SlowManager(KVCacheManager):
    _use_quiet_path = False


@st.composite
def configs(draw: st.DrawFn) -> tuple[list[KVCacheSpec], int, bool]:
    specs = draw(model_specs())
    caching = draw(st.sampled_from([True, True, True, False]))
    return specs, draw(st.integers(len(specs) + 1, 30)), caching


PREFIXES = st.sampled_from([0, 3, 8, 16, 17, 24, 32, 40, 48])
ADD = st.tuples(st.just("add"), PREFIXES, st.lists(st.integers(0, 2), max_size=4))
OTHER = st.tuples(st.sampled_from(["step"] * 3 + ["free", "preempt"]), st.integers(0, 99))
OPS = st.lists(st.one_of(ADD, OTHER), min_size=10, max_size=50)


@dataclass
class Model:
    """Both managers, the requests, and the worker shadow (block ID -> token prefix held)."""

    specs: list[KVCacheSpec]
    fast: KVCacheManager
    slow: KVCacheManager
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    content: dict[int, tuple[int, ...]] = field(default_factory=dict)
    prefix_of: dict[bytes, tuple[int, ...]] = field(default_factory=dict)
    junction: dict[str, int] = field(default_factory=dict)
    slow_hit: CacheHit | None = None

    def both(self, method: str, *args: object) -> object:
        """Call `method` on both managers (the slow one gets its own hit blocks) and check that
        they answer the same."""
        fast = getattr(self.fast, method)(*args)
        if method == "allocate_slots" and len(args) > 3:
            args = (*args[:3], self.slow_hit.blocks)  # type: ignore[union-attr]
        slow = getattr(self.slow, method)(*args)
        if method == "get_computed_blocks":
            self.slow_hit = slow
        assert summary(fast) == summary(slow), method
        return fast

    def chunk_size(self, request: Request, start: int, budget: int) -> int:
        size = min(request.num_tokens - start, 1 + budget % 24)
        if self.fast.needs_block_aligned_prefill and start < request.num_tokens:
            size = block_aligned_num_tokens(
                request.num_tokens,
                self.fast.alignment_tokens,
                start,
                size,
                self.junction[request.req_id],
            )
        return size

    def add(self, prefix_len: int, tail: list[int]) -> None:
        tokens = BASE[:prefix_len] + tail or [7]
        req_id = f"r{len(self.junction)}"
        self.junction[req_id] = 0
        self.waiting.append(make_request(req_id, tokens, self.fast.hash_block_size))

    def step(self, budget: int) -> None:
        """One scheduler step: every running request advances, then waiting ones are admitted
        in order until one does not fit."""
        for request in list(self.running):
            if request in self.running:
                self.advance(request, budget)
                self.check()
        for request in list(self.waiting):
            if not self.admit(request, budget):
                break
            self.check()

    def admit(self, request: Request, budget: int) -> bool:
        found = self.both("get_computed_blocks", request)
        assert isinstance(found, CacheHit)
        self.check_hit(request, found)
        event("hit" if found.num_tokens else "miss")
        self.junction[request.req_id] = found.junction_tokens
        size = self.chunk_size(request, found.num_tokens, budget)
        if size == 0:
            return False
        if self.both("allocate_slots", request, size, found.num_tokens, found.blocks) is None:
            return False
        self.waiting.remove(request)
        self.running.append(request)
        self.write(request, found.num_tokens, size)
        return True

    def advance(self, request: Request, budget: int) -> None:
        start = request.num_computed_tokens
        if start == request.num_tokens:
            if request.num_tokens >= MAX_MODEL_LEN - 1:
                self.finish(request, preempt=False)
                return
            request.append_output_token_ids([budget % 3])
        size = self.chunk_size(request, start, budget)
        if size == 0:
            return
        if self.both("allocate_slots", request, size) is None:
            event("pool full while running")
            self.finish(request, preempt=True)
            return
        self.write(request, start, size)

    def finish(self, request: Request, preempt: bool) -> None:
        self.both("free", request)
        self.running.remove(request)
        if preempt:
            request.num_computed_tokens = 0
            self.waiting.append(request)

    def write(self, request: Request, start: int, size: int) -> None:
        """The worker's writes for tokens [start, start + size) of `request`."""
        end = start + size
        tokens = request.all_token_ids
        for spec, ids in zip(self.specs, self.fast.get_block_ids(request.req_id), strict=True):
            bs = spec.block_size
            if isinstance(spec, MambaSpec):
                for boundary in range(start // bs * bs + bs, end + 1, bs):
                    if spec.mamba_cache_mode is MambaCacheMode.ALL:
                        self.content[ids[boundary // bs - 1]] = tuple(tokens[:boundary])
                state = (
                    ids[-1]
                    if spec.mamba_cache_mode is not MambaCacheMode.ALL
                    else ids[(end - 1) // bs]
                )
                assert state != 0
                self.content[state] = tuple(tokens[:end])
                continue
            for index in range(start // bs, (end - 1) // bs + 1):
                assert ids[index] != 0, "a computed token has no slot"
                self.content[ids[index]] = tuple(tokens[: min(end, (index + 1) * bs)])
        request.num_computed_tokens = end
        for index, block_hash in enumerate(request.block_hashes):
            self.prefix_of[block_hash] = tuple(tokens[: (index + 1) * request.hash_block_size])

    def check_hit(self, request: Request, found: CacheHit) -> None:
        hit = found.num_tokens
        assert hit <= max(request.num_tokens - 1, 0)
        assert found.junction_tokens >= hit
        if not self.fast.enable_caching:
            assert hit == 0
            return
        assert hit % self.fast.alignment_tokens == 0
        assert hit == longest_valid_hit(self.fast, self.specs, request)
        tokens = request.all_token_ids
        for spec, blocks in zip(self.specs, found.blocks.blocks, strict=True):
            bs = spec.block_size
            assert len(blocks) * bs == hit
            ids = [block.block_id for block in blocks]
            for index in required_indices(spec, hit):
                assert ids[index] != 0, (spec, ids)
            for index, block_id in enumerate(ids):
                if block_id:
                    assert self.content[block_id] == tuple(tokens[: (index + 1) * bs])

    def check(self) -> None:
        self.fast.check_invariants()
        self.slow.check_invariants()
        assert self.fast.pool.free_queue.block_ids() == self.slow.pool.free_queue.block_ids()
        for request in self.running:
            assert self.fast.get_block_ids(request.req_id) == self.slow.get_block_ids(
                request.req_id
            )
        blocks = zip(self.fast.pool.blocks, self.slow.pool.blocks, strict=True)
        for fast_block, slow_block in blocks:
            assert fast_block.block_hash == slow_block.block_hash
            if fast_block.block_hash is not None:
                expected = self.prefix_of[fast_block.block_hash]
                assert self.content[fast_block.block_id] == expected, fast_block


def summary(result: object) -> object:
    """Block objects differ between the twin managers: compare IDs."""
    if isinstance(result, CacheHit):
        return result.blocks.get_block_ids(), result.num_tokens, result.junction_tokens
    if result is None:
        return None
    return result.get_block_ids()  # type: ignore[attr-defined]


def longest_valid_hit(manager: KVCacheManager, specs: list[KVCacheSpec], request: Request) -> int:
    """Brute force: the longest aligned length every group can serve from its own cache."""
    best = 0
    for length in range(0, request.num_tokens, manager.alignment_tokens):
        if all(
            is_servable(manager, group_id, spec, request, length)
            for group_id, spec in enumerate(specs)
        ):
            best = length
    return best


def is_servable(
    manager: KVCacheManager, group_id: int, spec: KVCacheSpec, request: Request, length: int
) -> bool:
    """Whether group `group_id` caches every block a token recomputed at `length` reads."""
    if length and isinstance(spec, MambaSpec) and spec.mamba_cache_mode is MambaCacheMode.NONE:
        return False
    ratio = spec.block_size // request.hash_block_size
    for index in required_indices(spec, length):
        block_hash = request.block_hashes[index * ratio + ratio - 1]
        if manager.pool.get_cached_block(block_hash, group_id) is None:
            return False
    return True


def required_indices(spec: KVCacheSpec, hit: int) -> range:
    """Table entries a token recomputed at `hit` reads: they must be real blocks."""
    bs = spec.block_size
    last = hit // bs
    if isinstance(spec, SlidingWindowSpec):
        return range(max(0, last - cdiv(spec.sliding_window - 1, bs)), last)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return range(hit // spec.attention_chunk_size * spec.attention_chunk_size // bs, last)
    if isinstance(spec, MambaSpec):
        return range(last - 1, last) if hit else range(0)
    return range(last)


@settings(max_examples=100, deadline=None)
@given(config=configs(), ops=OPS)
@example(  # a Mamba tail computed in two steps across a block end (a state was misregistered)
    config=([full(2), mamba(2, MambaCacheMode.ALIGN), full(4)], 8, True),
    ops=[("add", 3, []), ("step", 0), ("step", 1)],
)
def test_random_histories_keep_every_invariant(
    config: tuple[list[KVCacheSpec], int, bool], ops: list[tuple]
) -> None:
    specs, num_blocks, caching = config
    kv_config = make_config(num_blocks, *specs)
    model = Model(
        specs,
        KVCacheManager(kv_config, max_model_len=MAX_MODEL_LEN, enable_caching=caching),
        SlowManager(kv_config, max_model_len=MAX_MODEL_LEN, enable_caching=caching),
    )
    assert model.fast.alignment_tokens == math.lcm(*(spec.block_size for spec in specs))
    for op in ops:
        if op[0] == "add":
            model.add(op[1], op[2])
        elif op[0] == "step":
            model.step(op[1])
        elif model.running:
            request = model.running[op[1] % len(model.running)]
            model.finish(request, preempt=op[0] == "preempt")
        model.check()
    for request in list(model.running):
        model.finish(request, preempt=False)
    model.check()
    event(f"evictions > 0: {model.fast.make_stats().num_evictions > 0}")
    assert model.fast.num_free_blocks == num_blocks - 1
    assert all(block.ref_cnt == 0 for block in model.fast.pool.blocks)
