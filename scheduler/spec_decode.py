"""Speculative decoding in the scheduler: how many drafts a step verifies, the commit of the
accepted count, and the acceptance counters.

    before the step   tokens [ ... known | d1 .. dk ]   computed c, known c + 1
    verify step       computes c .. c + k (k + 1 tokens), samples at each of them
    after the step    a drafts accepted: computed c + 1 + a, known c + 2 + a (the a drafts and
                      the token sampled after them); the KV and states past c + a are stale
                      and are overwritten by later steps

Block hashes cover known tokens only, and the KV cache manager registers blocks up to the known
tokens, so nothing past the accepted point is ever cached.

Async scheduling (step N+1 scheduled before step N's output is back): drafts are verified only
by a request with no token in flight (its drafts were proposed after its last token), and a
request verifying drafts is not run ahead of (how many tokens it gains is unknown until its
output is back). A request with drafts to verify waits for its token in flight rather than run
ahead of it, so it verifies every other step while requests without drafts run every step;
a paused (acceptance-aware switch) or batch-size-limited request runs ahead as usual.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.kv_cache.manager import KVCacheManager
from scheduler.request import Request
from scheduler.spec_config import SpeculativeConfig
from scheduler.spec_switch import DEFAULT_SWITCH, AcceptanceSwitch


@dataclass(frozen=True)
class SpecDecodingStats:
    """Cumulative acceptance counters (vLLM's `vllm:spec_decode_*` metrics)."""

    num_drafts: int = 0
    """Verify steps of a request with at least one draft."""
    num_draft_tokens: int = 0
    """Draft tokens verified."""
    num_accepted_tokens: int = 0
    """Draft tokens accepted."""
    num_accepted_tokens_per_pos: tuple[int, ...] = ()
    """Per draft position (0 = the first draft): drafts accepted there."""


@dataclass
class _Counters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    per_pos: list[int] = field(default_factory=list)


class DraftVerification:
    """The scheduler's side of speculative decoding (one per scheduler)."""

    def __init__(
        self, config: SpeculativeConfig, manager: KVCacheManager, max_model_len: int
    ) -> None:
        self.config = config
        self.manager = manager
        self.max_model_len = max_model_len
        self.switch: AcceptanceSwitch | None = AcceptanceSwitch(DEFAULT_SWITCH)
        """Per-request pauses of drafting while drafts keep being rejected (None: off)."""
        self.verifying: set[str] = set()
        """Async scheduling: requests whose verify step is in flight."""
        self._counters = _Counters(per_pos=[0] * config.num_speculative_tokens)

    def waits(self, request: Request, num_unfinished: int) -> bool:
        """Async scheduling: whether `request`, with a token in flight, waits for it instead of
        running ahead (its verify step is in flight, or it has drafts to verify next)."""
        if request.req_id in self.verifying:
            return True
        switch = self.switch
        return self._has_drafts(request, num_unfinished) and (
            switch is None or not switch.is_paused(request.req_id)
        )

    def _has_drafts(self, request: Request, num_unfinished: int) -> bool:
        """Whether `request` has drafts and the batch-size switch lets it verify them."""
        limit = self.config.disable_by_batch_size
        return bool(request.spec_token_ids) and (limit is None or num_unfinished < limit)

    def num_drafts(self, request: Request, budget: int, num_unfinished: int) -> int:
        """Drafts of a decoding request to verify this step (0: a plain decode step).

        Capped by the token budget, max_tokens and max_model_len (every token a step may emit
        is allowed), the recurrent groups' block ends and the next state checkpoint (states
        there are written exactly as without speculation), the batch-size switch and the
        acceptance-aware switch (`scheduler.spec_switch`).
        """
        if not self._has_drafts(request, num_unfinished):
            return 0
        if self.switch is not None and not self.switch.allows(request.req_id):
            return 0
        if request.num_output_placeholders:
            return 0  # its drafts follow a token the scheduler has not seen yet
        params = request.sampling_params
        computed = request.num_computed_tokens
        num = min(
            len(request.spec_token_ids),
            self.config.num_speculative_tokens,
            budget - 1,
            params.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        slots = self.manager.spec_slots
        if slots is not None:
            num = min(num, slots.window_tokens(computed) - 1)
        checkpoints = self.manager.checkpoints
        while (
            num > 0 and checkpoints is not None and checkpoints.wants(request, computed + 1 + num)
        ):
            num -= 1
        if num > 0 and slots is not None and not slots.reserve(request.req_id):
            return 0
        return max(num, 0)

    def plan(self, request: Request, num_drafts: int) -> list[int]:
        """The drafts a step verifies (the recurrent groups keep the state after each)."""
        if self.manager.spec_slots is not None:
            self.manager.spec_slots.plan_saves(
                request.req_id, request.num_computed_tokens, num_drafts
            )
        return request.spec_token_ids[:num_drafts]

    def commit(
        self, request: Request, num_drafts: int, token_ids: list[int], *, preempted: bool = False
    ) -> None:
        """After a verify step: roll computed tokens back past the rejected drafts (call before
        the tokens are appended). `token_ids`: the accepted drafts and the token after them.
        `preempted`: the request was preempted while the step ran (async scheduling; it
        recomputes from scratch, so there is nothing to roll back)."""
        self.verifying.discard(request.req_id)
        num_accepted = len(token_ids) - 1
        assert 0 <= num_accepted <= num_drafts, (num_accepted, num_drafts)
        slots = self.manager.spec_slots
        if not preempted:
            request.num_computed_tokens -= num_drafts - num_accepted
            if num_accepted < num_drafts and slots is not None:
                slots.restore(request.req_id, num_accepted, request.num_computed_tokens)
        counters = self._counters
        counters.num_drafts += 1
        counters.num_draft_tokens += num_drafts
        counters.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            counters.per_pos[pos] += 1
        switch = self.switch
        if switch is not None and switch.record(request.req_id, num_drafts, num_accepted):
            self.manager.release_spec_slots(request.req_id)  # paused: room for others

    def commit_step(
        self,
        request: Request,
        verified: list[int] | None,
        token_ids: list[int],
        drafts: dict[str, list[int]] | None,
        preempted: bool,
    ) -> None:
        """A request's step output: roll back past the rejected drafts of what it verified
        (`commit`), and keep the drafts the workers proposed for its next step."""
        if verified:
            self.commit(request, len(verified), token_ids, preempted=preempted)
        if token_ids:
            request.spec_token_ids = drafts.get(request.req_id, []) if drafts else []

    def forget(self, req_id: str) -> None:
        """A finished request."""
        self.verifying.discard(req_id)
        if self.switch is not None:
            self.switch.forget(req_id)

    def make_stats(self) -> SpecDecodingStats:
        """A snapshot of the cumulative counters."""
        counters = self._counters
        return SpecDecodingStats(
            counters.num_drafts,
            counters.num_draft_tokens,
            counters.num_accepted_tokens,
            tuple(counters.per_pos),
        )
