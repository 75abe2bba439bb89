"""Requests kept through a sleep that releases the KV pool: every one goes back to the queue.

A request the engine keeps (`mode="keep"`) while its pool is released loses its KV pages; it
is preempted as the scheduler preempts for room (blocks freed, to be recomputed from its
tokens at the queue's front), so the prefix cache can then be reset with no block in use. Its
next schedule sends the workers its whole token list and new blocks (a resumed request).
"""

from __future__ import annotations

from scheduler.request import RequestStatus
from scheduler.scheduler import Scheduler
from scheduler.step_plan import StepPlan


def preempt_all(scheduler: Scheduler) -> list[str]:
    """Preempt every running request and every request waiting for offload-tier loads (in
    that order at the queue's front, oldest first); their IDs."""
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
        scheduler._preempt(request, plan)
    return plan.preempted_req_ids
