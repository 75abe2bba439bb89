"""Speculative decoding settings (vLLM's `speculative_config`), and which requests may use it.

One frozen `SpeculativeConfig` is built by `cluster/` from the user's `speculative_config`; the
scheduler reads the draft count and the batch-size switch, the workers the proposer settings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from scheduler.sampling_params import SamplingParams


class SpecMethod(enum.Enum):
    """Where draft tokens come from."""

    NGRAM = "ngram"
    """Prompt lookup: the tokens that followed the last occurrence of the context's tail."""
    DRAFT_MODEL = "draft_model"
    """A separate (smaller) model run autoregressively for the drafts."""
    MTP = "mtp"
    """The checkpoint's own multi-token-prediction layers."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How many tokens to draft, and how."""

    method: SpecMethod
    num_speculative_tokens: int
    """Most draft tokens verified per request per step (k)."""
    prompt_lookup_min: int = 5
    """ngram: shortest context tail looked up."""
    prompt_lookup_max: int = 5
    """ngram: longest context tail looked up (the longest match wins)."""
    model: str | None = None
    """draft_model: the draft model's folder or ID."""
    disable_by_batch_size: int | None = None
    """No drafts are verified while this many requests or more are unfinished (None: always)."""

    def __post_init__(self) -> None:
        if not isinstance(self.method, SpecMethod):
            raise TypeError(f"method must be a SpecMethod, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min must be >= 1 and <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}"
            )
        if (self.method is SpecMethod.DRAFT_MODEL) != (self.model is not None):
            raise ValueError("model names the draft model: set it for method 'draft_model' only")

    @property
    def draft_lookahead(self) -> int:
        """Slots past each step's tokens a drafter model writes its drafts' KV into (its k
        autoregressive steps start at the last known token); 0 for n-gram lookup."""
        return 0 if self.method is SpecMethod.NGRAM else self.num_speculative_tokens


def supports_speculation(params: SamplingParams) -> bool:
    """Whether a request's tokens can be verified several at a time.

    Structured outputs can: the engine sends a grammar mask per draft position (the grammar
    advanced over the drafts before it) and the verifier applies it. Logits edits that depend
    on the tokens before each position (penalties, min_tokens, bad words) would differ per
    draft position, and the verifier applies no other logits edits (logit bias, allowed
    tokens): such requests decode one token per step, so their outputs stay exactly those
    without speculation.
    """
    return not (
        params.uses_penalties
        or params.min_tokens
        or params.logit_bias
        or params.allowed_token_ids is not None
        or params.bad_words
        or params.bad_words_token_ids
    )
