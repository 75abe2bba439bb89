"""`SamplingParams`: how to pick tokens and when to stop, with vLLM's field names and defaults.

Users build it (the offline `LLM`, the OpenAI edge); the scheduler reads its stop conditions, the
workers its sampling fields, the detokenizer its text fields. Sequences given as lists are stored
as tuples and `logit_bias` as sorted (token, bias) pairs, so the object stays immutable, hashable
and cheap to pickle. Every invalid value raises ValueError naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from scheduler.sampling_checks import (
    MAX_LOGPROBS,
    MIN_TEMPERATURE,
    SEED_MAX,
    SEED_MIN,
    bias_pairs,
    check,
    check_types,
    str_tuple,
    token_id_tuple,
    token_sequences,
)
from scheduler.structured_outputs import StructuredOutputsParams

__all__ = ["MAX_LOGPROBS", "MIN_TEMPERATURE", "SEED_MAX", "SEED_MIN", "SamplingParams"]

MAX_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)."""


@dataclass(frozen=True, init=False)
class SamplingParams:
    """How to pick tokens and when to stop (OpenAI/vLLM semantics).

    Lists are accepted wherever vLLM accepts them and stored as tuples; `logit_bias` is stored as
    sorted (token id, bias) pairs (`dict(params.logit_bias)` gives the mapping back).
    """

    n: int = 1
    """Completions to generate per prompt."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all (vLLM's convention)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """> 0; tokens of the prompt or output get positive logits divided, negative multiplied by it
    (1.0: off)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits; biases are clamped to [-100, 100]."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Only these tokens may be generated (None: all)."""
    bad_words: tuple[str, ...] = ()
    """Words that may not be generated (the engine tokenizes them into `bad_words_token_ids`)."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    """Token sequences of `bad_words`, set by the engine with `with_bad_words_token_ids`
    (None: not tokenized yet)."""
    max_tokens: int = 16
    """Most tokens to generate."""
    min_tokens: int = 0
    """Stop conditions (EOS, stop tokens, stop strings) are ignored until this many tokens exist."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; the text is cut before the first one found."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end generation (besides EOS)."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the request in its text."""
    ignore_eos: bool = False
    """Keep generating past EOS."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top logprobs per step (0-20)."""
    prompt_logprobs: int | None = None
    """Return this many top logprobs per prompt token (0-20)."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    spaces_between_special_tokens: bool = True
    """Put a space between special tokens and their neighbours in the text."""
    structured_outputs: StructuredOutputsParams | None = None
    """A constraint the output must satisfy (JSON schema, regex, choice, grammar, ...)."""

    def __init__(  # noqa: PLR0913 - vLLM's keyword arguments, one per field
        self,
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] | None = None,
        allowed_token_ids: Sequence[int] | None = None,
        bad_words: Sequence[str] | None = None,
        bad_words_token_ids: Sequence[Sequence[int]] | None = None,
        max_tokens: int = 16,
        min_tokens: int = 0,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        include_stop_str_in_output: bool = False,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        seed: int | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> None:
        # NOTE: a hand-written __init__ (as the messages in scheduler.output have) normalises the
        # list arguments before the instance exists, so no field is ever written twice and the
        # frozen object needs no object.__setattr__. The generated __repr__, __eq__, __hash__
        # and dataclasses.replace (which passes every field by keyword) still apply.
        self.__dict__.update(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            logit_bias=bias_pairs(logit_bias),
            allowed_token_ids=(
                None
                if allowed_token_ids is None
                else token_id_tuple("allowed_token_ids", allowed_token_ids)
            ),
            bad_words=str_tuple("bad_words", bad_words, allow_str=False),
            bad_words_token_ids=(
                None
                if bad_words_token_ids is None
                else token_sequences("bad_words_token_ids", bad_words_token_ids)
            ),
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop=str_tuple("stop", stop, allow_str=True),
            stop_token_ids=(
                () if stop_token_ids is None else token_id_tuple("stop_token_ids", stop_token_ids)
            ),
            include_stop_str_in_output=include_stop_str_in_output,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            seed=seed,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
            structured_outputs=structured_outputs,
        )
        check_types(self)
        self._check_ranges()
        self._check_penalties()
        check(
            structured_outputs is None or isinstance(structured_outputs, StructuredOutputsParams),
            "structured_outputs must be a StructuredOutputsParams",
        )

    def _check_ranges(self) -> None:
        check(self.n >= 1, f"n must be >= 1, got {self.n}")
        check(
            0 <= self.temperature < math.inf,
            f"temperature must be >= 0 and finite, got {self.temperature}",
        )
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(
            self.top_k >= -1 and self.top_k != 0,
            f"top_k must be -1 (disabled) or >= 1, got {self.top_k}",
        )
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        check(
            0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(
                value is None or 0 <= value <= MAX_LOGPROBS,
                f"{name} must be in [0, {MAX_LOGPROBS}], got {value}",
            )
        check(
            self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
            f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}",
        )

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(
                -MAX_PENALTY <= value <= MAX_PENALTY,
                f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}",
            )
        check(
            0 < self.repetition_penalty < math.inf,
            f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}",
        )
        check(
            self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
            "allowed_token_ids must not be empty (None allows every token)",
        )

    @property
    def is_greedy(self) -> bool:
        """Whether sampling reduces to argmax (temperatures too small to divide by included)."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        """Whether any of the repetition, presence or frequency penalties is active."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def with_bad_words_token_ids(self, token_ids: Sequence[Sequence[int]]) -> SamplingParams:
        """A copy carrying the token sequences of `bad_words` (the engine has the tokenizer)."""
        return replace(self, bad_words_token_ids=token_sequences("bad_words_token_ids", token_ids))

    def verify_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError when `logit_bias`, `allowed_token_ids` or `bad_words_token_ids` name a
        token outside the model's vocabulary (only the engine knows its size)."""
        fields: dict[str, Sequence[int]] = {
            "logit_bias": [token for token, _ in self.logit_bias],
            "allowed_token_ids": self.allowed_token_ids or (),
            "bad_words_token_ids": [t for ids in self.bad_words_token_ids or () for t in ids],
        }
        for name, token_ids in fields.items():
            outside = sorted({t for t in token_ids if t >= vocab_size})
            check(
                not outside,
                f"{name} has token ids outside the vocabulary (size {vocab_size}): {outside[:5]}",
            )
