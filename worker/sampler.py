"""Token sampling and logprobs for one step, batched on the device.

The model runner calls `Sampler.sample` with the logits of the requests that sample this step.
Order of operations per row: the logits edits of `worker.logits_processors` (allowed tokens ->
banned tokens -> logit bias -> repetition, frequency, presence penalties; rows and batches that
use none skip them) -> greedy argmax, or temperature -> min-p -> top-k -> top-p -> draw. Greedy
rows (`SamplingParams.is_greedy`: temperature below 1e-5, 0 included) take the argmax of the
edited logits; logprobs are those of the raw logits (log-softmax), as OpenAI and vLLM report them.
Draws use the exponential-race trick (argmax of p / Exp(1) noise), so a seeded request only
needs its own generator for its noise row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scheduler.output import TokenLogprobs
from scheduler.request import SamplingParams
from worker.grammar_mask import GrammarMask, apply_grammar_mask
from worker.logits_processors import LogitsAdjustments, process_logits


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters as device tensors (rows = requests that sample)."""

    temperature: torch.Tensor  # [N] fp32, 1.0 on greedy rows
    is_greedy: torch.Tensor  # [N] bool
    top_k: torch.Tensor  # [N] int64, vocab size where disabled
    top_p: torch.Tensor  # [N] fp32
    min_p: torch.Tensor  # [N] fp32
    generators: tuple[torch.Generator | None, ...]
    num_logprobs: tuple[int | None, ...]
    all_greedy: bool
    uses_top_k: bool
    uses_top_p: bool
    uses_min_p: bool
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows, token ids) that may not be drawn this step (bad words; stop tokens before
    min_tokens)."""
    adjustments: LogitsAdjustments | None = None
    """Allowed tokens, logit bias and penalties of the rows that use them."""
    grammar: GrammarMask | None = None
    """Structured-outputs bitmask of the constrained rows (applied before the other edits)."""

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
        banned_token_ids: Sequence[Sequence[int]] = (),
        adjustments: LogitsAdjustments | None = None,
    ) -> SamplingTensors:
        """Gather the parameters of the sampling rows (one host list per field, one copy each).

        Args:
            banned_token_ids: per row, tokens to mask out (empty or one list per row).
        """
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        banned_rows = [row for row, ids in enumerate(banned_token_ids) for _ in ids]
        banned_ids = [token for ids in banned_token_ids for token in ids]
        banned = None
        if banned_ids:
            banned = (
                _tensor(banned_rows, torch.int64, device),
                _tensor(banned_ids, torch.int64, device),
            )
        return cls(
            temperature=_tensor(
                [1.0 if p.is_greedy else p.temperature for p in params], torch.float32, device
            ),
            is_greedy=_tensor([p.is_greedy for p in params], torch.bool, device),
            top_k=_tensor(top_k, torch.int64, device),
            top_p=_tensor([p.top_p for p in params], torch.float32, device),
            min_p=_tensor([p.min_p for p in params], torch.float32, device),
            generators=tuple(generators),
            num_logprobs=tuple(p.logprobs for p in params),
            all_greedy=all(p.is_greedy for p in params),
            uses_top_k=any(k < vocab_size for k in top_k),
            uses_top_p=any(p.top_p < 1.0 for p in params),
            uses_min_p=any(p.min_p > 0.0 for p in params),
            banned=banned,
            adjustments=adjustments,
        )


def _tensor(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device)


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: list[TokenLogprobs | None]
    """Per row, when the request asked for logprobs."""


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below `min_p` times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's `top_k` best tokens, then the smallest head holding mass `top_p`.

    One descending sort serves both masks; the best token is always kept.
    """
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]  # [1, V]
    if top_k is not None:
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0) & (ranks > 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def exponential_noise(
    shape: torch.Size,
    generators: Sequence[torch.Generator | None],
    default: torch.Generator,
    device: torch.device,
) -> torch.Tensor:
    """Exp(1) noise `[N, V]`; rows of seeded requests come from their own generator."""
    noise = torch.empty(shape, device=device).exponential_(generator=default)
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return noise


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprob and rank (1 = best) of `token_ids`, plus the `num_top` best per row.

    Returns (logprob [N], rank [N], top ids [N, k], top logprobs [N, k]) with
    k = min(num_top, vocab size): a vocabulary smaller than the request yields all of it.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None].long())  # [N, 1]
    rank = (logprobs > chosen).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    return chosen[:, 0], rank, top_ids, top_logprobs


def to_token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_tops: Sequence[int]
) -> list[TokenLogprobs]:
    """One `TokenLogprobs` per row, with `num_tops[row]` alternatives."""
    if not num_tops:
        return []
    chosen, rank, top_ids, top_lps = compute_logprobs(logits, token_ids, max(num_tops))
    rows = zip(
        token_ids.tolist(),
        chosen.tolist(),
        rank.tolist(),
        top_ids.tolist(),
        top_lps.tolist(),
        num_tops,
        strict=True,
    )
    return [
        TokenLogprobs(
            token_id=tok, logprob=lp, rank=rk, top_token_ids=ids[:n], top_logprobs=lps[:n]
        )
        for tok, lp, rk, ids, lps, n in rows
    ]


def sampling_probs(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Per row, the distribution random sampling draws from: temperature, then min-p, top-k
    and top-p where a row asks for them. [num_rows, vocab] fp32."""
    scaled = logits / tensors.temperature[:, None]
    if tensors.uses_min_p:
        scaled = apply_min_p(scaled, tensors.min_p)
    if tensors.uses_top_k or tensors.uses_top_p:
        scaled = apply_top_k_top_p(
            scaled,
            tensors.top_k if tensors.uses_top_k else None,
            tensors.top_p if tensors.uses_top_p else None,
        )
    return torch.softmax(scaled, dim=-1)


class Sampler:
    """Samples one token per row of a `[N, vocab]` fp32 logits tensor."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, tensors: SamplingTensors) -> SamplerOutput:
        """Draw one token per row; logprobs (when asked) are those of the raw `logits`."""
        constrained = (
            logits if tensors.grammar is None else apply_grammar_mask(logits, tensors.grammar)
        )
        allowed = process_logits(constrained, tensors.banned, tensors.adjustments)
        greedy_ids = allowed.argmax(dim=-1)
        if tensors.all_greedy:
            token_ids = greedy_ids
        else:
            token_ids = torch.where(
                tensors.is_greedy, greedy_ids, self._random_sample(allowed, tensors)
            )
        logprobs = self._logprobs(logits, token_ids, tensors)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _random_sample(self, logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
        probs = sampling_probs(logits, tensors)
        noise = exponential_noise(probs.shape, tensors.generators, self.generator, self.device)
        return (probs / noise).argmax(dim=-1)

    def _logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, tensors: SamplingTensors
    ) -> list[TokenLogprobs | None]:
        rows = [row for row, n in enumerate(tensors.num_logprobs) if n is not None]
        result: list[TokenLogprobs | None] = [None] * len(tensors.num_logprobs)
        if not rows:
            return result
        index = torch.tensor(rows, device=logits.device)
        num_tops = [tensors.num_logprobs[row] or 0 for row in rows]
        entries = to_token_logprobs(logits[index], token_ids[index], num_tops)
        for row, entry in zip(rows, entries, strict=True):
            result[row] = entry
        return result
