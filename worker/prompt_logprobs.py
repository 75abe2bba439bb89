"""Prompt logprobs: which hidden rows of a step score prompt tokens, and their entries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.output import TokenLogprobs
from worker.input_batch import InputBatch, RequestStates
from worker.sampler import to_token_logprobs


@dataclass(frozen=True)
class PromptLogprobRows:
    """Hidden rows whose logits score prompt tokens, grouped by request."""

    req_ids: list[str]
    counts: list[int]
    """Rows of each request, in order."""
    rows: torch.Tensor  # [num_rows] int64
    targets: torch.Tensor  # [num_rows] int64: the prompt token each row predicts
    num_tops: list[int]
    """Per row: alternatives requested."""


def prompt_logprob_rows(
    batch: InputBatch, states: RequestStates, device: torch.device
) -> PromptLogprobRows | None:
    """Rows at positions p < num_prompt - 1 this step; row p scores prompt token p + 1."""
    req_ids: list[str] = []
    counts: list[int] = []
    rows: list[int] = []
    targets: list[int] = []
    num_tops: list[int] = []
    for idx, req_id in enumerate(batch.req_ids):
        req = states.requests[req_id]
        num_top = req.sampling_params.prompt_logprobs
        start = int(batch.num_computed_np[idx])
        end = min(int(batch.seq_lens_np[idx]), len(req.prompt_token_ids) - 1)
        if num_top is None or end <= start:
            continue
        first_row = int(batch.query_start_loc_np[idx])
        req_ids.append(req_id)
        counts.append(end - start)
        rows.extend(range(first_row, first_row + end - start))
        targets.extend(req.prompt_token_ids[start + 1 : end + 1])
        num_tops.extend([num_top] * (end - start))
    if not rows:
        return None
    return PromptLogprobRows(
        req_ids=req_ids,
        counts=counts,
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        targets=torch.tensor(targets, dtype=torch.int64, device=device),
        num_tops=num_tops,
    )


def prompt_logprobs(
    logits: torch.Tensor, prompt_rows: PromptLogprobRows
) -> dict[str, list[TokenLogprobs]]:
    """Per request: the logprobs of its prompt tokens scored this step (`logits`: the rows of
    `prompt_rows`)."""
    entries = to_token_logprobs(logits, prompt_rows.targets, prompt_rows.num_tops)
    result: dict[str, list[TokenLogprobs]] = {}
    start = 0
    for req_id, count in zip(prompt_rows.req_ids, prompt_rows.counts, strict=True):
        result[req_id] = entries[start : start + count]
        start += count
    return result
