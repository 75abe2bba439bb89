"""The proposer a `SpeculativeConfig` asks for."""

from __future__ import annotations

from torch import nn

from scheduler.spec_config import SpecMethod, SpeculativeConfig
from worker.models.decoder import DecoderForCausalLM
from worker.models.qwen3_next_mtp import Qwen3NextMTP
from worker.spec_decode.draft_model import DraftModelProposer
from worker.spec_decode.mtp import MtpProposer
from worker.spec_decode.proposer import DraftProposer, NgramProposer


def make_proposer(config: SpeculativeConfig, drafter: nn.Module | None = None) -> DraftProposer:
    """The proposer of `config.method`; `drafter`: the draft model ('draft_model') or the
    checkpoint's MTP layer ('mtp'), loaded by the worker."""
    k = config.num_speculative_tokens
    if config.method is SpecMethod.NGRAM:
        return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method is SpecMethod.DRAFT_MODEL and isinstance(drafter, DecoderForCausalLM):
        return DraftModelProposer(k, drafter)
    if config.method is SpecMethod.MTP and isinstance(drafter, Qwen3NextMTP):
        return MtpProposer(k, drafter)
    raise ValueError(
        f"speculative_config method {config.method.value!r}: its drafter is not loaded "
        f"(got {type(drafter).__name__})"
    )
