"""Structured outputs with speculative decoding (tiny random byte-level Llama, CPU fp32): a
constrained request verifies drafts, each draft position masked by the grammar advanced over the
drafts before it, and the grammar keeps only accepted tokens. Greedy texts equal those without
speculation for drafts that are all accepted, half rejected, or mostly refused by the grammar;
sampled texts satisfy the constraint. Both grammar backends."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cluster import LLM, SamplingParams
from scheduler.structured_outputs import StructuredOutputsParams
from tests.helpers.byte_model import save_byte_model
from tests.helpers.drafters import ScriptedProposer, install_proposer
from tests.helpers.engine_probe import engine_stats

pytestmark = pytest.mark.parity

REGEX = r"[0-9]{3}-[a-z]{2,4}(-[0-9]{2}){1,3}"
PROMPTS = ["abc", "code: ", "xyz"]
ARGS = {"block_size": 16, "kv_cache_memory_bytes": 4 << 20}
K = 3


def _params(backend: str, **sampling: object) -> list[SamplingParams]:
    regex = StructuredOutputsParams(regex=REGEX, backend=backend)
    choice = StructuredOutputsParams(
        choice=["alpha-beta", "gamma", "delta-epsilon"], backend=backend
    )
    return [
        SamplingParams(max_tokens=24, structured_outputs=regex, **sampling),  # type: ignore[arg-type]
        SamplingParams(max_tokens=24, structured_outputs=choice, **sampling),  # type: ignore[arg-type]
        SamplingParams(max_tokens=12, **sampling),  # type: ignore[arg-type]
    ]


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_byte_model(tmp_path_factory.mktemp("byte-model"))


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_constrained_requests_verify_drafts_with_a_mask_per_position(
    byte_model: Path, backend: str
) -> None:
    greedy = _params(backend, temperature=0.0)
    plain = LLM(str(byte_model), **ARGS)
    expected = plain.generate(PROMPTS, greedy, use_tqdm=False)
    plain.shutdown()
    texts = [r.outputs[0].text for r in expected]
    assert re.fullmatch(REGEX, texts[0])
    spec = {"method": "ngram", "num_speculative_tokens": K}
    llm = LLM(str(byte_model), speculative_config=spec, **ARGS)
    tokenizer = llm.get_tokenizer()
    sequences = [
        [*tokenizer(p, add_special_tokens=False)["input_ids"], *r.outputs[0].token_ids]
        for p, r in zip(PROMPTS, expected, strict=True)
    ]
    for kind in ("oracle", "perturbed", "random"):
        install_proposer(llm, ScriptedProposer(K, sequences, kind))
        before = engine_stats(llm).spec_decoding
        assert before is not None
        results = llm.generate(PROMPTS, greedy, use_tqdm=False)
        assert [r.outputs[0].token_ids for r in results] == [
            r.outputs[0].token_ids for r in expected
        ], kind
        after = engine_stats(llm).spec_decoding
        assert after is not None
        drafted = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        assert drafted > 0, kind
        if kind == "oracle":
            assert accepted == drafted
    seeded = _params(backend, temperature=1.0, seed=7)
    for result in llm.generate(PROMPTS, seeded, use_tqdm=False)[:1]:
        assert re.fullmatch(REGEX, result.outputs[0].text)
    llm.shutdown()


def test_a_constrained_request_alone_accepts_every_oracle_draft(byte_model: Path) -> None:
    """The oracle drafts of a constrained request alone: every draft verified and accepted (so
    the structured request itself drafted, not only its unconstrained neighbour)."""
    greedy = _params("xgrammar", temperature=0.0)[:1]
    plain = LLM(str(byte_model), **ARGS)
    (expected,) = plain.generate(PROMPTS[:1], greedy, use_tqdm=False)
    plain.shutdown()
    llm = LLM(
        str(byte_model), speculative_config={"method": "ngram", "num_speculative_tokens": K}, **ARGS
    )
    prompt = llm.get_tokenizer()(PROMPTS[0], add_special_tokens=False)["input_ids"]
    install_proposer(
        llm, ScriptedProposer(K, [[*prompt, *expected.outputs[0].token_ids]], "oracle")
    )
    (result,) = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)
    stats = engine_stats(llm).spec_decoding
    llm.shutdown()
    assert result.outputs[0].token_ids == expected.outputs[0].token_ids
    assert stats is not None
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
