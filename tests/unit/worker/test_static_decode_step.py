"""Decode steps from the static buffers of captured steps, on CPU: every family's decode
forward compiles with `torch.compile(fullgraph=True)` (a graph break or a host sync fails), and
the static path (buffers filled, 3 requests padded to 4, outputs sliced) gives the eager path's
greedy tokens, with speculative verify steps and LoRA adapters too.

The compile check runs with the "eager" backend: what matters is one graph without breaks, not
the generated code. Each family's tiny checkpoint runs prefill eagerly, then its decode steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import LLM, SamplingParams
from scheduler.lora import LoRARequest
from tests.helpers.drafters import ScriptedProposer, install_proposer
from tests.helpers.static_steps import use_static_steps
from tests.helpers.tiny_layouts import TEXT_FAMILIES, save_family
from tests.helpers.tiny_lora import save_random_adapter
from tests.helpers.tiny_models import save_tiny_model

PROMPTS = [
    [(7 * i + 3) % 256 for i in range(10)],
    [(5 * i + 1) % 256 for i in range(13)],
    [1, 2, 3, 4] * 3,  # repetitive: n-gram drafts find matches
]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LLM_ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "kv_cache_memory_bytes": 1 << 22,
    "max_num_batched_tokens": 64,
    "enable_prefix_caching": False,
}
COVERING = ("llama4", "gemma4", "gpt_oss", "bamba", "qwen3_5_moe", "lfm2")
"""Families whose decode steps hold every layer type: chunked local and NoPE (llama4), K = V
and KV sharing (gemma4), sliding window and sinks (gpt_oss), Mamba-2 (bamba), gated DeltaNet
(qwen3_5_moe), short conv (lfm2), MoE (all but bamba and lfm2); the default suite compiles these,
the other families are marked slow."""


def _tokens(llm: LLM, **kwargs: object) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, **kwargs)  # type: ignore[arg-type]
    return [output.outputs[0].token_ids for output in outputs]


@pytest.mark.parametrize(
    "family",
    [
        family if family in COVERING else pytest.param(family, marks=pytest.mark.slow)
        for family in TEXT_FAMILIES
    ],
)
def test_decode_forward_compiles_fullgraph_with_eager_tokens(family: str, tmp_path: Path) -> None:
    save_family(family, tmp_path)
    llm = LLM(model=str(tmp_path), **LLM_ARGS)  # type: ignore[arg-type]
    try:
        eager = _tokens(llm)
        static = use_static_steps(llm, compile_backend="eager")
        assert _tokens(llm) == eager
        assert static.static_steps[1] == GREEDY.max_tokens - 1  # every decode step
    finally:
        llm.shutdown()


def test_verify_steps_of_a_recurrent_model_run_static(tmp_path: Path) -> None:
    """Drafts verified k + 1 rows per request from the static buffers, every draft position's
    gated DeltaNet state cut (half the drafts rejected: states restored from those cuts), give
    the tokens of decoding without drafts."""
    save_family("qwen3_5", tmp_path)
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    llm = LLM(model=str(tmp_path), speculative_config=spec, **LLM_ARGS)  # type: ignore[arg-type]
    try:
        want = _tokens(llm)  # n-gram drafts: none found on these random outputs
        sequences = [[*prompt, *tokens] for prompt, tokens in zip(PROMPTS, want, strict=True)]
        install_proposer(llm, ScriptedProposer(2, sequences, "perturbed"))
        static = use_static_steps(llm)
        assert _tokens(llm) == want
        assert static.static_steps[3] > 0
    finally:
        llm.shutdown()


def test_lora_rows_take_their_adapter_in_static_steps(tmp_path: Path) -> None:
    """Two requests with an adapter and one without, padded to four static rows."""
    hf_model = save_tiny_model("llama", tmp_path / "base", num_hidden_layers=2)
    save_random_adapter(hf_model, tmp_path / "adapter", rank=4, seed=1)
    adapter = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    loras = [adapter, None, adapter]
    llm = LLM(model=str(tmp_path / "base"), enable_lora=True, max_loras=2, **LLM_ARGS)  # type: ignore[arg-type]
    try:
        eager = _tokens(llm, lora_request=loras)
        assert eager != _tokens(llm)  # the adapter changes the tokens
        static = use_static_steps(llm)
        assert _tokens(llm, lora_request=loras) == eager
        assert static.static_steps[1] > 0
    finally:
        llm.shutdown()
