"""Logits edits applied on the whole batch before sampling, and the bad-word matcher.

The sampler calls `process_logits` with the step's `SamplingTensors`. Order, as vLLM applies them:

    allowed_token_ids mask -> banned tokens (bad words; stop tokens before min_tokens)
    -> logit_bias -> repetition penalty -> frequency and presence penalties
    -> (sampler) greedy argmax, or temperature -> min-p -> top-k -> top-p -> draw

Masks commute with each other and with everything after them (a -inf logit stays -inf); the one
order that matters is bias before the repetition penalty, which scales the biased logit. Greedy
rows get every edit here too. Each edit touches only the rows that use it, and a batch with none
of them skips this module. Logprobs stay those of the raw logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

WILDCARD = -1
"""Pattern entry left of a bad word's prefix: matches any token."""
NO_TOKEN = -2
"""Tail entry before the first output token: matches no pattern entry but the wildcard."""


@dataclass(frozen=True)
class AllowedTokens:
    """Rows restricted to a set of tokens (`allowed_token_ids`)."""

    rows: torch.Tensor  # [A] int64: sampling rows
    pair_idx: torch.Tensor  # [Q] int64: index into `rows` of each allowed pair
    token_ids: torch.Tensor  # [Q] int64


@dataclass(frozen=True)
class TokenBias:
    """(row, token, bias) triples added to the logits (`logit_bias`)."""

    rows: torch.Tensor  # [B] int64
    token_ids: torch.Tensor  # [B] int64
    values: torch.Tensor  # [B] fp32


@dataclass(frozen=True)
class Penalties:
    """Rows with a repetition, presence or frequency penalty, and their token statistics."""

    rows: torch.Tensor  # [P] int64
    prompt_mask: torch.Tensor  # [P, V] bool: token occurs in the prompt
    output_counts: torch.Tensor  # [P, V] int32: times the token was generated
    repetition: torch.Tensor  # [P] fp32
    frequency: torch.Tensor  # [P] fp32
    presence: torch.Tensor  # [P] fp32


@dataclass(frozen=True)
class LogitsAdjustments:
    """The step's edits besides banned tokens (None: no row uses that edit)."""

    allowed: AllowedTokens | None = None
    bias: TokenBias | None = None
    penalties: Penalties | None = None


def process_logits(
    logits: torch.Tensor,
    banned: tuple[torch.Tensor, torch.Tensor] | None,
    adjustments: LogitsAdjustments | None,
) -> torch.Tensor:
    """The logits the sampler draws from; `logits` itself is left unchanged (raw logprobs)."""
    if banned is None and adjustments is None:
        return logits
    out = logits.clone()
    if adjustments is not None and adjustments.allowed is not None:
        mask_disallowed(out, adjustments.allowed)
    if banned is not None:
        out.index_put_(banned, torch.tensor(float("-inf"), device=out.device))
    if adjustments is not None and adjustments.bias is not None:
        bias = adjustments.bias
        out.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
    if adjustments is not None and adjustments.penalties is not None:
        pen = adjustments.penalties
        out[pen.rows] = apply_penalties(out[pen.rows], pen)
    return out


def mask_disallowed(logits: torch.Tensor, allowed: AllowedTokens) -> None:
    """Set every token outside a restricted row's allowed set to -inf (in place)."""
    disallowed = torch.ones(
        (len(allowed.rows), logits.shape[-1]), dtype=torch.bool, device=logits.device
    )
    disallowed[allowed.pair_idx, allowed.token_ids] = False
    logits[allowed.rows] = logits[allowed.rows].masked_fill(disallowed, float("-inf"))


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens, then frequency and presence penalties
    over output tokens. `logits` are the penalised rows, `[P, V]`.

    Repetition (CTRL/HF definition): a seen token's logit is divided by the penalty when
    positive, multiplied when not. Frequency/presence (OpenAI): subtract `frequency * count`
    and `presence * (count > 0)`.
    """
    counts = penalties.output_counts
    seen_in_output = counts > 0
    seen = penalties.prompt_mask | seen_in_output
    factor = torch.where(seen, penalties.repetition[:, None], 1.0)
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    logits = logits - penalties.frequency[:, None] * counts
    return logits - penalties.presence[:, None] * seen_in_output


@dataclass(frozen=True)
class BadWordPatterns:
    """One request's bad words as arrays, built once per request.

    prefixes [W, K]: each word's tokens but the last, right-aligned, WILDCARD-padded on the left;
    last [W]: the token banned when the prefix matches the end of the output.
    """

    prefixes: np.ndarray
    last: np.ndarray

    @classmethod
    def build(cls, token_ids: Sequence[Sequence[int]]) -> BadWordPatterns:
        width = max((len(ids) - 1 for ids in token_ids), default=0)
        prefixes = np.full((len(token_ids), width), WILDCARD, dtype=np.int64)
        for index, ids in enumerate(token_ids):
            if len(ids) > 1:
                prefixes[index, width - len(ids) + 1 :] = ids[:-1]
        last = np.array([ids[-1] for ids in token_ids], dtype=np.int64)
        return cls(prefixes, last)


def bad_word_bans(
    patterns: Sequence[BadWordPatterns], outputs: Sequence[Sequence[int]]
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens to ban now: a word's last token where its prefix ends the output.

    One vectorised comparison for all requests (`patterns[i]` with output tokens `outputs[i]`);
    a prefix longer than the output never matches; single-token words are always banned.
    Returns (index into `patterns`, token id) pairs.
    """
    width = max(p.prefixes.shape[1] for p in patterns)
    prefixes = np.concatenate(
        [
            np.pad(p.prefixes, ((0, 0), (width - p.prefixes.shape[1], 0)), constant_values=WILDCARD)
            for p in patterns
        ]
    )  # [W_total, width]
    owner = np.repeat(np.arange(len(patterns)), [len(p.last) for p in patterns])
    tails = np.full((len(patterns), width), NO_TOKEN, dtype=np.int64)
    for index, output in enumerate(outputs):
        tail = output[max(0, len(output) - width) :] if width else ()
        tails[index, width - len(tail) :] = tail
    matches = np.all((prefixes == WILDCARD) | (prefixes == tails[owner]), axis=1)
    last = np.concatenate([p.last for p in patterns])
    return owner[matches], last[matches]
