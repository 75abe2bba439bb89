"""The proposer a `SpeculativeConfig` asks for."""

from __future__ import annotations

from scheduler.spec_config import SpecMethod, SpeculativeConfig
from worker.spec_decode.draft_model import DraftModelProposer
from worker.spec_decode.proposer import DrafterModel, DraftProposer, NgramProposer


def make_proposer(
    config: SpeculativeConfig, draft_model: DrafterModel | None = None
) -> DraftProposer:
    """The proposer of `config.method`; ValueError when its model is missing."""
    k = config.num_speculative_tokens
    if config.method is SpecMethod.NGRAM:
        return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method is SpecMethod.DRAFT_MODEL:
        if draft_model is None:
            raise ValueError("speculative_config.model: the draft model is not loaded")
        return DraftModelProposer(k, draft_model)
    raise ValueError(
        f"speculative_config method {config.method.value!r} is not supported yet; use 'ngram' "
        "or 'draft_model'"
    )
