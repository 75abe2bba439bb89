"""CUDA graphs of decode steps against eager steps, token for token in fp32, every layout.

Per family (every layer type: full, sliding window, chunked local, sinks, K = V, KV sharing,
Mamba-2, gated DeltaNet, short conv, MoE) one engine with graphs (captured at sizes 1, 2, 4, 8:
5 requests replay padded to 8, 3 to 4) and one with `enforce_eager=True` generate the same
prompts (shared prefixes: prefix-cache hits); their greedy tokens must be equal, and the graph
engine must have replayed. Then speculative verify (n-gram on repetitive prompts, and the MTP
layer of Qwen3.5), LoRA rows, and a replay after the graphs were
dropped and captured again (what a weight reload does).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster import LLM, SamplingParams
from scheduler.lora import LoRARequest
from tests.helpers.tiny_layouts import TEXT_FAMILIES, save_family
from tests.helpers.tiny_lora import save_random_adapter
from tests.helpers.tiny_models import save_tiny_model
from tests.helpers.tiny_mtp import save_tiny_with_mtp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BASE = [(7 * i + 3) % 256 for i in range(24)]
PROMPTS = [
    BASE,
    [*BASE[:20], 9, 8, 7],  # shares a prefix with the first
    [1, 2, 3, 4, 5, 6] * 4,  # repetitive: n-gram drafts find matches
    [(5 * i + 1) % 256 for i in range(17)],
    [4, 5] * 9,
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
ARGS = {
    "dtype": "float32",
    "device": "cuda",
    "block_size": 16,
    "kv_cache_memory_bytes": 1 << 26,
    "max_num_seqs": 8,
    "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8]},
}


def _runner(llm: LLM):  # type: ignore[no-untyped-def]
    return llm.client.core.executor.worker.model_runner


def _tokens(llm: LLM, prompts: list[list[int]] = PROMPTS, **kwargs: object) -> list[list[int]]:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, **kwargs)  # type: ignore[arg-type]
    return [output.outputs[0].token_ids for output in outputs]


def _both(path: Path, prompts: list[list[int]] = PROMPTS, **args: object) -> tuple[list, list, LLM]:
    """Eager tokens, graph tokens, and the graph engine (still running)."""
    eager_llm = LLM(model=str(path), enforce_eager=True, **{**ARGS, **args})  # type: ignore[arg-type]
    try:
        eager = _tokens(eager_llm, prompts)
    finally:
        eager_llm.shutdown()
    llm = LLM(model=str(path), **{**ARGS, **args})  # type: ignore[arg-type]
    return eager, _tokens(llm, prompts), llm


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_graphs_give_eager_tokens(family: str, tmp_path: Path) -> None:
    save_family(family, tmp_path)
    eager, graphs, llm = _both(tmp_path)
    try:
        assert graphs == eager
        runner = _runner(llm)
        assert runner.graphs is not None
        assert runner.graphs.num_graphs > 0
        assert runner.graphs.static_steps[1] > 0
        # a weight reload moves addresses: graphs dropped and captured again, replays agree
        runner.rebuild_cuda_graphs()
        assert _tokens(llm) == eager
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", ["llama", "gemma3", "bamba", "qwen3_5", "lfm2"])
def test_ngram_verify_steps_replay(family: str, tmp_path: Path) -> None:
    save_family(family, tmp_path)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    repetitive = [[1, 2, 3] * 6, [4, 5] * 8, [7, 8, 9, 10] * 4]
    eager, graphs, llm = _both(tmp_path, repetitive, speculative_config=spec)
    try:
        assert graphs == eager
    finally:
        llm.shutdown()


def test_mtp_verify_steps_replay(tmp_path: Path) -> None:
    save_tiny_with_mtp("qwen3_5", tmp_path)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    eager, graphs, llm = _both(tmp_path, speculative_config=spec)
    try:
        assert graphs == eager
        assert _runner(llm).graphs.static_steps[3] > 0
    finally:
        llm.shutdown()


def test_lora_rows_replay(tmp_path: Path) -> None:
    hf_model = save_tiny_model("llama", tmp_path / "base", num_hidden_layers=2)
    save_random_adapter(hf_model, tmp_path / "adapter", rank=4, seed=1)
    adapter = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    loras = [adapter, None, adapter, None, adapter]
    args = {"enable_lora": True, "max_loras": 2}
    eager_llm = LLM(model=str(tmp_path / "base"), enforce_eager=True, **ARGS, **args)  # type: ignore[arg-type]
    try:
        eager = _tokens(eager_llm, lora_request=loras)
    finally:
        eager_llm.shutdown()
    llm = LLM(model=str(tmp_path / "base"), **ARGS, **args)  # type: ignore[arg-type]
    try:
        assert _tokens(llm, lora_request=loras) == eager
    finally:
        llm.shutdown()
