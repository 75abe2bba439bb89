"""Sampled tokens into requests: stop conditions and the engine-facing `RequestStepOutput`.

`Scheduler.update_from_output` calls `apply_sampled_tokens` for every scheduled request; the stop
rules (EOS unless ignored, stop token IDs after `min_tokens`, `max_tokens`, `max_model_len`) live
in `check_stop`.
"""

from __future__ import annotations

from scheduler.output import FinishReason, RequestStepOutput, TokenLogprobs
from scheduler.request import Request, RequestStatus

_NOT_FINISHED: tuple[FinishReason | None, int | None] = (None, None)


def make_step_output(
    request: Request,
    new_token_ids: list[int],
    finish: tuple[FinishReason | None, int | None],
    new_logprobs: list[TokenLogprobs] | None = None,
    prompt_logprobs: list[TokenLogprobs] | None = None,
) -> RequestStepOutput:
    """One request's `RequestStepOutput`; `finish` is (reason or None, stop token or None)."""
    reason, stop_token = finish
    return RequestStepOutput(  # positional: this runs for every request every step
        request.req_id,
        new_token_ids,
        reason,
        stop_token,
        new_logprobs,
        prompt_logprobs,
        len(request.prompt_token_ids),
        request.num_cached_tokens or 0,
    )


def apply_sampled_tokens(
    request: Request,
    token_ids: list[int],
    max_model_len: int,
    logprobs: list[TokenLogprobs] | None = None,
    prompt_logprobs: list[TokenLogprobs] | None = None,
    *,
    in_flight: bool = False,
) -> RequestStepOutput | None:
    """Append one step's sampled tokens to `request`, stopping at the first stop condition.

    `in_flight` (async scheduling): the step's tokens were placeholders, and computed tokens
    (already advanced by the next step, or reset by a preemption) say nothing about whether
    the step sampled, so the tokens are taken as they are.

    Returns the request's output for this step, or None when there is nothing to report.
    """
    if in_flight:
        request.num_output_placeholders = max(0, request.num_output_placeholders - len(token_ids))
    elif request.num_computed_tokens < len(request.all_token_ids):
        token_ids = []  # a prefill chunk that is not the last samples nothing
    elif len(token_ids) == 1:  # the common case: one token per step
        request.append_output_token_ids(token_ids)
        finish = check_stop(request, max_model_len)
        return make_step_output(
            request, token_ids, finish or _NOT_FINISHED, logprobs, prompt_logprobs
        )
    finish = None
    num_kept = 0
    for token_id in token_ids:
        request.append_output_token_ids([token_id])
        num_kept += 1
        finish = check_stop(request, max_model_len)
        if finish is not None:
            break
    if not num_kept and prompt_logprobs is None:
        return None
    if num_kept < len(token_ids):
        token_ids = token_ids[:num_kept]
        logprobs = logprobs[:num_kept] if logprobs is not None else None
    return make_step_output(request, token_ids, finish or _NOT_FINISHED, logprobs, prompt_logprobs)


def check_stop(request: Request, max_model_len: int) -> tuple[FinishReason, int | None] | None:
    """Whether the token just appended ends `request`; sets its finished status.

    Returns (reason, stop token) or None. A stop token (EOS unless `ignore_eos`, or one of
    `stop_token_ids`) counts only once `min_tokens` tokens exist, and wins over the length limits
    when both apply to the same token.
    """
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
        last = request.output_token_ids[-1]
        if (last == request.eos_token_id and not params.ignore_eos) or (
            last in params.stop_token_ids
        ):
            request.status = RequestStatus.FINISHED_STOPPED
            return FinishReason.STOP, last
    if num_output >= params.max_tokens or len(request.all_token_ids) >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return FinishReason.LENGTH, None
    return None
