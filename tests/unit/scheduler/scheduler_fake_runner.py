"""A deterministic stand-in for the workers, for scheduler tests.

`FakeModelRunner` keeps per-request state from `SchedulerOutput` deltas exactly as a worker must
(new requests in full, appended tokens and blocks, padded or replaced lists), checks every delta
against what it sampled itself, and simulates each KV cache group's memory: every computed token
writes an identity of its whole prefix into its slot, and every read of a visible position (full,
sliding window, chunked local) must find the identity of that position's prefix; a recurrent-state
group reads the state after the previous token and writes the state after the last one. A wrong
block ID, a stale table or a block handed to two requests at once therefore fails an assertion.
The next token is a hash of all tokens so far (read back from the cache), modulo the vocabulary;
`reference_tokens` computes what a request must therefore generate, without any cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
    manager_spec,
)
from scheduler.output import (
    BlockCopy,
    CachedRequestData,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    OffloadOps,
    SchedulerOutput,
)
from scheduler.request import SamplingParams

VOCAB_SIZE = 97
EOS = 0


def prefix_identity(parent: int, token: int) -> int:
    """Identity of a prefix, from its parent prefix's identity and its last token."""
    return hash((parent, token))


def reference_tokens(
    prompt: list[int], params: SamplingParams, eos: int | None, max_model_len: int
) -> tuple[list[int], FinishReason]:
    """The tokens and finish reason a request gets from this runner, computed without a cache."""
    identity = 0
    for token in prompt:
        identity = prefix_identity(identity, token)
    outputs: list[int] = []
    while True:
        token = identity % VOCAB_SIZE
        outputs.append(token)
        identity = prefix_identity(identity, token)
        is_stop = (token == eos and not params.ignore_eos) or token in params.stop_token_ids
        if is_stop and len(outputs) >= params.min_tokens:
            return outputs, FinishReason.STOP
        if len(outputs) >= params.max_tokens or len(prompt) + len(outputs) >= max_model_len:
            return outputs, FinishReason.LENGTH


@dataclass
class _WorkerRequest:
    prompt: list[int]
    tokens: list[int]
    block_ids: list[list[int]] | None
    num_computed: int
    sampled: list[int] = field(default_factory=list)
    """Tokens sampled by this runner that the scheduler has not sent back yet."""
    prefix_ids: list[int] = field(default_factory=list)
    expected_outputs: list[int] = field(default_factory=list)
    """Outputs held when preempted: what the resume must send back."""

    def prefix_id(self, position: int) -> int:
        while len(self.prefix_ids) <= position:
            parent = self.prefix_ids[-1] if self.prefix_ids else 0
            self.prefix_ids.append(prefix_identity(parent, self.tokens[len(self.prefix_ids)]))
        return self.prefix_ids[position]


class FakeModelRunner:
    """Worker-side state and a simulated paged KV cache, validated at every step."""

    def __init__(self, kv_cache_config: KVCacheConfig, *, check_full_reads: bool = True) -> None:
        self.groups = [manager_spec(group.spec) for group in kv_cache_config.groups]
        self.kv: list[dict[int, int]] = [{} for _ in self.groups]
        self.requests: dict[str, _WorkerRequest] = {}
        self.check_full_reads = check_full_reads
        self.num_steps = 0
        self.appends_sampled = False
        """Async scheduling: keep each sampled token (the next step may compute it already)."""
        self.offloaded: dict[int, tuple[int, list[int | None]]] = {}
        """Offload-tier slot -> (group, the block's slot values)."""
        self.fail_loads = False
        """Report every offload-tier load as failed (and write garbage into its blocks)."""
        self.num_loaded_blocks = 0
        self.load_steps = 0
        """Steps after the one that issues them that loads are reported done."""
        self._slow_loads: list[tuple[int, str]] = []
        self.loaded_req_ids: set[str] = set()
        """Requests whose offload-tier loads this runner reported done."""
        self.files: dict[str, tuple[int, list[int | None]]] = {}
        """Disk-level block files by name: (group, the block's slot values)."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.appends_sampled = out.workers_append_sampled
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in out.preempted_req_ids:
            state = self.requests.get(req_id)
            if state is None or state.block_ids is None:  # back from loads, preempted unrun
                assert req_id in self.loaded_req_ids, req_id
                continue
            self._preempt(state)
        for new in out.scheduled_new_reqs:
            self._add(new)
        for cached in out.scheduled_cached_reqs:
            self._update(cached)
        assert set(out.num_scheduled_tokens) == {
            *(r.req_id for r in out.scheduled_new_reqs),
            *(r.req_id for r in out.scheduled_cached_reqs),
        }
        loaded, failed = self._run_offload(out.offload)
        self._copy_blocks(out.copies_before_step)
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            self._write(self.requests[req_id], num_tokens)
        self._save_states(out)
        self._copy_blocks(out.copies_after_step)
        sampled = [
            self._read_and_sample(req_id, n) for req_id, n in out.num_scheduled_tokens.items()
        ]
        self.num_steps += 1
        return ModelRunnerOutput(
            req_ids=list(out.num_scheduled_tokens),
            sampled_token_ids=sampled,
            finished_loads=loaded,
            failed_loads=failed,
        )

    def _run_offload(self, ops: OffloadOps) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Stores, spills, loads, drops, disk drops, in this order; (requests loaded, requests
        whose load failed)."""
        for store in ops.stores:
            assert store.slot not in self.offloaded, store
            bs = self.groups[store.group_id].block_size
            kv = self.kv[store.group_id]
            values = [kv.get(store.block_id * bs + offset) for offset in range(bs)]
            self.offloaded[store.slot] = (store.group_id, values)
        for spill in ops.spills:
            self.files[spill.file] = self.offloaded[spill.slot]
        req_ids: dict[str, None] = {}
        for load in ops.loads:
            if load.file is not None:
                group, values = self.files[load.file]
            else:
                assert load.slot is not None
                group, values = self.offloaded[load.slot]
            assert group == load.group_id, load
            bs = self.groups[group].block_size
            for offset, value in enumerate(values):
                slot = load.block_id * bs + offset
                if value is None or self.fail_loads:
                    self.kv[group].pop(slot, None)
                else:
                    self.kv[group][slot] = value
            req_ids[load.req_id] = None
            self.num_loaded_blocks += 1
        for slot in ops.drops:
            del self.offloaded[slot]
        for file in ops.disk_drops:
            del self.files[file]
        if self.fail_loads:
            return (), tuple(req_ids)
        self._slow_loads.extend((self.num_steps + self.load_steps, req_id) for req_id in req_ids)
        done = tuple(req_id for step, req_id in self._slow_loads if step <= self.num_steps)
        self._slow_loads = [(step, r) for step, r in self._slow_loads if step > self.num_steps]
        self.loaded_req_ids.update(done)
        return done, ()

    def _copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Every slot of each source block onto its destination (all read before any write)."""
        moved = []
        for copy in copies:
            bs = self.groups[copy.group_id].block_size
            kv = self.kv[copy.group_id]
            for offset in range(bs):
                moved.append(
                    (copy.group_id, copy.dst * bs + offset, kv.get(copy.src * bs + offset))
                )
        for group, slot, value in moved:
            if value is None:
                self.kv[group].pop(slot, None)
            else:
                self.kv[group][slot] = value

    def _save_states(self, out: SchedulerOutput) -> None:
        """Recurrent states kept at checkpoints inside or at the end of this step's tokens."""
        for save in out.state_saves:
            state = self.requests[save.req_id]
            assert save.req_id in out.num_scheduled_tokens, save
            start = state.num_computed  # not advanced yet: the reads come after the saves
            end = start + out.num_scheduled_tokens[save.req_id]
            assert start < save.num_tokens <= end, (save, start)
            bs = self.groups[save.group_id].block_size
            self.kv[save.group_id][save.block_id * bs] = state.prefix_id(save.num_tokens - 1)

    def _add(self, new: NewRequestData) -> None:
        assert new.req_id not in self.requests, f"{new.req_id} sent as new twice"
        assert len(new.block_ids) == len(self.groups)
        self.requests[new.req_id] = _WorkerRequest(
            prompt=list(new.prompt_token_ids),
            tokens=list(new.prompt_token_ids),
            block_ids=[list(ids) for ids in new.block_ids],
            num_computed=new.num_computed_tokens,
        )

    @staticmethod
    def _preempt(state: _WorkerRequest) -> None:
        """Drop blocks and outputs, keep the prompt (remember the outputs only to check)."""
        assert state.block_ids is not None, "preempted twice"
        state.expected_outputs = state.tokens[len(state.prompt) :] + state.sampled
        state.tokens = list(state.prompt)
        state.sampled = []
        state.block_ids = None

    def _update(self, cached: CachedRequestData) -> None:
        state = self.requests[cached.req_id]
        if cached.is_resumed:
            assert state.block_ids is None, f"{cached.req_id} resumed without a preemption"
            assert cached.new_token_ids == state.expected_outputs, cached.req_id
            assert cached.new_block_ids is not None
            assert len(cached.new_block_ids) == len(self.groups)
            state.block_ids = [list(ids) for ids in cached.new_block_ids]
            state.num_computed = cached.num_computed_tokens
        else:
            assert state.block_ids is not None, f"{cached.req_id} scheduled while preempted"
            assert cached.num_computed_tokens == state.num_computed, cached
            assert cached.new_token_ids == state.sampled, (cached, state.sampled)
            if cached.new_block_ids is not None:
                for table, ids in zip(state.block_ids, cached.new_block_ids, strict=True):
                    table.extend(ids)
        state.tokens.extend(cached.new_token_ids)
        state.sampled = []

    def _slot(self, state: _WorkerRequest, group: int, position: int) -> int:
        assert state.block_ids is not None
        block_size = self.groups[group].block_size
        table = state.block_ids[group]
        assert position // block_size < len(table), (position, table)
        block_id = table[position // block_size]
        assert block_id != 0, f"group {group} position {position} maps to the null block"
        return block_id * block_size + position % block_size

    def _state_slot(self, state: _WorkerRequest, group: int, position: int) -> int:
        """Slot of the recurrent state after `position` (one per block; NONE: one per request)."""
        spec = self.groups[group]
        assert isinstance(spec, MambaSpec)
        if spec.mamba_cache_mode is MambaCacheMode.NONE:
            position = 0
        return self._slot(state, group, position // spec.block_size * spec.block_size)

    def _advance_state(self, state: _WorkerRequest, group: int, start: int, end: int) -> None:
        """Read the state after `start - 1`, then write the states this chunk produces: at its
        end, and (mode ALL) at every block end inside it."""
        if start:
            found = self.kv[group].get(self._state_slot(state, group, start - 1))
            assert found == state.prefix_id(start - 1), (group, start, "stale state")
        spec = self.groups[group]
        if spec.mamba_cache_mode is MambaCacheMode.ALL:
            bs = spec.block_size
            for boundary in range(start // bs * bs + bs, end, bs):
                self.kv[group][self._state_slot(state, group, boundary - 1)] = state.prefix_id(
                    boundary - 1
                )
        self.kv[group][self._state_slot(state, group, end - 1)] = state.prefix_id(end - 1)

    def _write(self, state: _WorkerRequest, num_tokens: int) -> None:
        start = state.num_computed
        assert num_tokens >= 1
        assert start + num_tokens <= len(state.tokens)
        for group, spec in enumerate(self.groups):
            if isinstance(spec, MambaSpec):
                self._advance_state(state, group, start, start + num_tokens)
                continue
            for position in range(start, start + num_tokens):
                self.kv[group][self._slot(state, group, position)] = state.prefix_id(position)

    def _visible_start(self, group: int, start: int) -> int:
        """First position any query in [start, ...) of this step attends to, in `group`."""
        spec = self.groups[group]
        if isinstance(spec, SlidingWindowSpec):
            return max(0, start - spec.sliding_window + 1)
        if isinstance(spec, ChunkedLocalAttentionSpec):
            return start // spec.attention_chunk_size * spec.attention_chunk_size
        return 0 if self.check_full_reads else start

    def _read_and_sample(self, req_id: str, num_tokens: int) -> list[int]:
        state = self.requests[req_id]
        start, end = state.num_computed, state.num_computed + num_tokens
        for group, spec in enumerate(self.groups):
            if isinstance(spec, MambaSpec):
                continue  # read in _write, before the chunk overwrote it
            for position in range(self._visible_start(group, start), end):
                found = self.kv[group].get(self._slot(state, group, position))
                assert found == state.prefix_id(position), (req_id, group, position)
        state.num_computed = end
        if end < len(state.tokens):
            return []
        if isinstance(self.groups[0], MambaSpec):
            token = self.kv[0][self._state_slot(state, 0, end - 1)] % VOCAB_SIZE
        else:
            token = self.kv[0][self._slot(state, 0, end - 1)] % VOCAB_SIZE
        if self.appends_sampled:
            state.tokens.append(token)
        else:
            state.sampled.append(token)
        return [token]
