"""Batch-invariant mode: one prompt's token logprobs are bit-identical alone, in a batch of 7
others, after a prefix hit, with its prefill cut into chunks and with speculation (every draft
accepted), on every group type, with no batch-dependent torch call left outside the mode's
invariant operations; without the mode a batch changes them (CPU fp32, tiny random models, the
offline `LLM`; cases and models in `tests.helpers.batch_invariance`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster import LLM
from cluster.config.engine_args import EngineArgs
from cluster.engine.configs import cuda_graph_config, kernel_backend
from tests.helpers.batch_invariance import (
    ENGINE,
    MODELS,
    PROMPT,
    EscapeDetector,
    generate,
    in_batch,
    invariance_cases,
    save_model,
)


@pytest.fixture(scope="module", params=MODELS)
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    save_model(request.param, path)
    return path


def test_logprobs_bit_identical_in_batch_invariant_mode(model_path: Path) -> None:
    alone, cases = invariance_cases(model_path, batch_invariant=True)
    for case, logprobs in cases.items():
        assert torch.equal(logprobs, alone), f"{case}: {(logprobs - alone).tolist()}"


def test_no_batch_dependent_call_outside_the_invariant_operations(model_path: Path) -> None:
    """Every product against a weight and every transcendental pointwise function of the
    cases' steps goes through the mode's invariant operations (steps in this thread)."""
    with EscapeDetector() as detector:
        invariance_cases(model_path, batch_invariant=True, async_scheduling=False)
    assert not detector.escapes, f"batch-dependent calls outside the mode: {detector.escapes}"


def test_logprobs_differ_in_a_batch_without_the_mode(model_path: Path) -> None:
    llm = LLM(str(model_path), enable_prefix_caching=False, **ENGINE)  # type: ignore[arg-type]
    tokens, alone = generate(llm, [PROMPT])
    batch_tokens, batched = in_batch(llm)
    llm.shutdown()
    assert batch_tokens == tokens
    assert not torch.equal(batched, alone)


@pytest.mark.parametrize("variable", ["VLLM_BATCH_INVARIANT", "HYBRIDSERVE_BATCH_INVARIANT"])
def test_environment_variable_turns_the_mode_on(
    variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert kernel_backend(EngineArgs()) == "auto"
    monkeypatch.setenv(variable, "1")
    assert kernel_backend(EngineArgs()) == "batch_invariant"
    assert not cuda_graph_config(EngineArgs()).is_enabled  # graphs would bypass the mode
    with pytest.raises(ValueError, match="attention_backend must be 'auto'"):
        kernel_backend(EngineArgs(attention_backend="torch"))
