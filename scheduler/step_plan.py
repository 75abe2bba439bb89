"""What one step sends the workers: the step plan and the workers' view of every request.

`Scheduler.schedule()` fills a `StepPlan` and turns it into messages through `WorkerView`, which
knows what every worker already holds, so that each step sends only deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.kv_cache.manager import KVCacheBlocks, KVCacheManager
from scheduler.output import CachedRequestData, NewRequestData
from scheduler.request import Request


@dataclass
class StepPlan:
    """What one `schedule()` call has decided so far.

    The token budget shrinks as requests are scheduled and grows back when an already scheduled
    request is preempted later in the same step (priority policy).
    """

    budget: int
    encoder_budget: int = 0
    """Image positions the step may still encode (`scheduler.image_chunks`)."""
    scheduled: list[Request] = field(default_factory=list)
    """Scheduled requests in scheduling order (the batch order sent to workers)."""
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_blocks: dict[str, KVCacheBlocks] = field(default_factory=dict)
    """Blocks newly allocated this step, per scheduled request."""
    preempted_req_ids: list[str] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens verified this step, per scheduled request that has some."""
    table_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    """Whole block tables (IDs per group) of the requests admitted this step, read as they are
    admitted: their blocks were just touched, and nothing later in the step changes them."""

    def add(
        self,
        request: Request,
        num_tokens: int,
        new_blocks: KVCacheBlocks,
        spec_tokens: list[int] | None = None,
    ) -> None:
        """Schedule `num_tokens` of `request` with the blocks just allocated for them (among
        them `spec_tokens`, drafts to verify)."""
        self.scheduled.append(request)
        if spec_tokens:
            self.spec_tokens[request.req_id] = spec_tokens
        self.num_scheduled_tokens[request.req_id] = num_tokens
        self.new_blocks[request.req_id] = new_blocks
        self.budget -= num_tokens

    def withdraw(self, request: Request) -> bool:
        """Undo `add` for a request preempted after it was scheduled; False: it was not."""
        num_tokens = self.num_scheduled_tokens.pop(request.req_id, None)
        if num_tokens is None:
            return False
        self.budget += num_tokens
        del self.new_blocks[request.req_id]
        self.spec_tokens.pop(request.req_id, None)
        self.table_ids.pop(request.req_id, None)
        self.scheduled.remove(request)
        return True

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class WorkerView:
    """What the workers hold of each request, so that each step sends only deltas.

    A request unknown here is sent in full (`NewRequestData`); a known one as a delta of tokens
    and blocks; one preempted after the workers saw it as a resumed delta with complete lists.
    """

    def __init__(self, kv_cache_manager: KVCacheManager, sends_sampled: bool = True) -> None:
        self._manager = kv_cache_manager
        self._sends_sampled = sends_sampled
        """False under async scheduling: the workers append their sampled tokens themselves."""
        self._num_sent_tokens: dict[str, int] = {}
        self._resumed_req_ids: set[str] = set()
        self.finished_req_ids: set[str] = set()
        """Requests finished since the last step's message."""
        self.recomputed_req_ids: set[str] = set()
        """Requests preempted between steps (a weight update): dropped by the next message."""

    def request_data(
        self,
        request: Request,
        new_blocks: KVCacheBlocks,
        table_ids: tuple[list[int], ...] | None = None,
    ) -> NewRequestData | CachedRequestData:
        """The message part for one scheduled request (before its computed tokens advance);
        `table_ids`: its whole table, if read already (`StepPlan.table_ids`)."""
        req_id = request.req_id
        num_sent = self._num_sent_tokens.get(req_id)
        self._num_sent_tokens[req_id] = len(request.all_token_ids)
        if num_sent is not None and req_id not in self._resumed_req_ids:
            return CachedRequestData(  # positional: this runs for every request every step
                req_id,
                request.num_computed_tokens,
                request.all_token_ids[num_sent:] if self._sends_sampled else [],
                None if new_blocks.is_empty else new_blocks.get_block_ids(),
            )
        if table_ids is None:
            table_ids = self._manager.get_block_ids(req_id)
        if num_sent is None:
            return NewRequestData(
                req_id=req_id,
                prompt_token_ids=list(request.prompt_token_ids),
                sampling_params=request.sampling_params,
                block_ids=table_ids,
                num_computed_tokens=request.num_computed_tokens,
                lora_request=request.lora_request,
                mm_features=request.mm_features,
            )
        self._resumed_req_ids.discard(req_id)
        return CachedRequestData(
            req_id=req_id,
            num_computed_tokens=request.num_computed_tokens,
            new_token_ids=list(request.output_token_ids),
            new_block_ids=table_ids,
            is_resumed=True,
        )

    def preempted(self, req_id: str) -> None:
        """The workers drop the request's blocks; its next schedule replaces them."""
        if req_id in self._num_sent_tokens:
            self._resumed_req_ids.add(req_id)

    def finished(self, req_id: str) -> None:
        """The workers drop the request at the next step."""
        self._num_sent_tokens.pop(req_id, None)
        self._resumed_req_ids.discard(req_id)
        self.finished_req_ids.add(req_id)

    def take_recomputed(self) -> frozenset[str]:
        """Requests preempted between steps, for this step's message; the set starts over."""
        recomputed = frozenset(self.recomputed_req_ids)
        self.recomputed_req_ids.clear()
        return recomputed

    def take_finished(self) -> frozenset[str]:
        """Finished IDs for this step's message; the set starts over."""
        finished = frozenset(self.finished_req_ids)
        self.finished_req_ids.clear()
        return finished
