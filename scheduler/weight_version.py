"""The scheduler's side of a weight update: every cache key moves to the new weights' root.

Nothing computed under the old weights may be reused, yet the prefix cache is not reset: the new
weight version gives a new root to every block-hash chain (`scheduler.block_hash.weights_root`),
so blocks, Mamba state checkpoints and offload-tier pages cached under the old root are simply
never hit again and age out like any other cached block. Router events carry the new root.

Requests in flight keep running ("keep"): each running request is preempted, its blocks freed
(cached under the old root only), and it is recomputed from its first token under the new
weights, prompt and tokens generated so far alike; a request waiting for offload-tier loads
(pages found under the old root) gives them up and is recomputed too; waiting requests are
hashed again.
"""

from __future__ import annotations

from scheduler.block_hash import BlockHash
from scheduler.request import RequestStatus
from scheduler.scheduler import Scheduler
from scheduler.step_plan import StepPlan


def move_to_weights_root(scheduler: Scheduler, root: BlockHash) -> list[str]:
    """Preempt every running request for recomputation and hash every unfinished request again
    from `root`; the IDs of the requests that will be recomputed."""
    plan = StepPlan(budget=0)
    manager = scheduler.kv_cache_manager
    for req_id in reversed(list(scheduler.loading)):
        request, _ = scheduler.loading.pop(req_id)
        manager.finish_load(request, succeeded=False)
        manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        scheduler.waiting.prepend(request)
        plan.preempted_req_ids.append(req_id)
    for request in reversed(list(scheduler.running)):
        scheduler._preempt(request, plan)  # frees its blocks under the old hashes
    scheduler._worker_view.recomputed_req_ids.update(plan.preempted_req_ids)
    for request in scheduler.requests.values():
        request.rehash(root)
    sink = manager.pool.event_sink
    if sink is not None:
        sink.set_hash_root(root)
    return list(plan.preempted_req_ids)
