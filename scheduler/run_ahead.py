"""Async scheduling: which running requests may be scheduled again while their last step's
sampled token is still in flight (a placeholder), and when a step samples.

The scheduler schedules step N+1 before step N's output is back. A request in step N that will
sample gets a placeholder for that token (`Request.num_output_placeholders`); step N+1 computes
it (the workers take it from their own last sample). A placeholder that would be a request's
last token (max_tokens, max_model_len) is not run ahead of: the request waits for its output. A
token the request turns out not to need (it stopped at step N) is discarded with the request.
"""

from __future__ import annotations

from scheduler.kv_cache.manager import KVCacheManager
from scheduler.request import Request


def may_run_ahead(request: Request, max_model_len: int, manager: KVCacheManager) -> bool:
    """Whether `request`, with tokens in flight, may compute one more placeholder token now."""
    in_flight = request.num_output_placeholders
    if request.num_output_tokens + in_flight >= request.sampling_params.max_tokens:
        return False
    if request.num_tokens + in_flight >= max_model_len:
        return False
    checkpoints = manager.checkpoints
    end = request.num_computed_tokens + 1
    # A state checkpoint needs the hash of the tokens before it: wait until they are known.
    return checkpoints is None or not checkpoints.wants(request, end)


def samples_this_step(request: Request) -> bool:
    """After the step's computed tokens were added: the step reaches the request's last token
    (known or in flight), so the workers sample one more."""
    return request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders
