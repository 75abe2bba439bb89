"""Int4 checkpoints (AWQ gemm, GPTQ, compressed-tensors W4A16) end to end, CPU fp32: greedy
tokens through `LLM` equal transformers' on the weights an independent few-line dequantizer
reads from the same files (tests/helpers/quantized_int4_checkpoints.py).

Llama and Granite-4.0-H (Mamba-2 in_proj/out_proj, attention and the shared MLP quantized; the
routed experts and routers stay plain, as the quantizers leave them) at hidden size 256, so a
group of 128 is one of several per row; group sizes 32 and 128, symmetric and with zero points,
GPTQ desc_act and compressed-tensors actorder (shuffled groups). Then the same checkpoints
under tensor parallelism (two ranks), with LoRA adapters made for the dequantized weights, and
as a speculative draft model of a target holding the reference weights (every draft accepted).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster import LLM, LoRARequest, SamplingParams
from tests.helpers.engine_probe import engine_stats
from tests.helpers.quantized_int4_checkpoints import (
    Int4Format,
    reference_from_folder,
    reference_model,
    write_int4_checkpoint,
)
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_lora import save_random_adapter
from tests.helpers.tiny_models import hf_greedy, save_tiny_model

pytestmark = pytest.mark.parity

NUM_NEW = 8
PROMPTS = [[(7 * i + 3) % 256 for i in range(21)], [(11 * i + 5) % 256 for i in range(9)]]
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW)
LLM_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 16,
    "kv_cache_memory_bytes": 1 << 22,
}
SHAPES: dict[str, dict[str, Any]] = {
    "llama": {"hidden_size": 256, "intermediate_size": 512},
    "granitemoehybrid": {"hidden_size": 256, "mamba_n_heads": 8, "shared_intermediate_size": 128},
}
CASES = [
    ("llama", Int4Format("awq", 128)),
    ("llama", Int4Format("gptq", 32, symmetric=True, act_order=True)),
    ("llama", Int4Format("gptq", 128)),
    ("llama", Int4Format("compressed-tensors", 128, symmetric=True)),
    ("llama", Int4Format("compressed-tensors", 32, act_order=True)),
    ("granitemoehybrid", Int4Format("awq", 32)),
    ("granitemoehybrid", Int4Format("gptq", 128, act_order=True)),
    ("granitemoehybrid", Int4Format("compressed-tensors", 128)),
    ("granitemoehybrid", Int4Format("compressed-tensors", 32, symmetric=True)),
]


@pytest.fixture(scope="module")
def plain_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """family -> (folder of the unquantized checkpoint, its transformers model)."""
    root = tmp_path_factory.mktemp("int4_plain")
    return {
        "llama": (root / "llama", save_tiny_model("llama", root / "llama", **SHAPES["llama"])),
        "granitemoehybrid": (
            root / "granite",
            save_tiny_hybrid("granitemoehybrid", root / "granite", **SHAPES["granitemoehybrid"]),
        ),
    }


def _quantized(
    plain_models: dict[str, tuple[Path, Any]], family: str, fmt: Int4Format, out: Path
) -> tuple[Path, torch.nn.Module]:
    """The int4 checkpoint of `family` in `fmt` and transformers' model of its reference
    dequantization."""
    plain, hf_model = plain_models[family]
    folder = write_int4_checkpoint(plain, out / fmt.label, fmt)
    return folder, reference_model(hf_model, folder, fmt)


def _generate(folder: Path, **overrides: Any) -> list[list[int]]:
    llm = LLM(str(folder), **{**LLM_ARGS, **overrides})
    try:
        results = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    return [result.outputs[0].token_ids for result in results]


def _hf_tokens(model: torch.nn.Module) -> list[list[int]]:
    return [hf_greedy(model, prompt, NUM_NEW) for prompt in PROMPTS]


@pytest.mark.parametrize(("family", "fmt"), CASES, ids=[f"{f}-{q.label}" for f, q in CASES])
def test_greedy_tokens_match_transformers_on_the_reference_dequantization(
    plain_models: dict[str, tuple[Path, Any]], family: str, fmt: Int4Format, tmp_path: Path
) -> None:
    folder, reference = _quantized(plain_models, family, fmt, tmp_path)
    expected = _hf_tokens(reference)
    assert expected != _hf_tokens(plain_models[family][1])  # 4 bits change the tokens
    assert _generate(folder) == expected


def test_tensor_parallel_2_splits_dequantized_weights_with_their_scales(
    plain_models: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """Two ranks (a process each) on a GPTQ checkpoint in activation order with zero points:
    each rank's rows and columns (q/k/v, gate/up, and the row-parallel o/down inputs that cut
    through groups) are those of the dequantized weight."""
    fmt = Int4Format("gptq", 32, act_order=True)
    folder, reference = _quantized(plain_models, "llama", fmt, tmp_path)
    assert _generate(folder, tensor_parallel_size=2) == _hf_tokens(reference)


def test_lora_adapters_on_a_quantized_hybrid_base(
    plain_models: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """An adapter on every linear layer of Granite-4.0-H (Mamba in/out projections included),
    made for the dequantized weights, applied over a GPTQ base in activation order: the tokens
    of transformers + PEFT with the adapter merged into the reference weights."""
    fmt = Int4Format("gptq", 32, symmetric=True, act_order=True)
    folder, reference = _quantized(plain_models, "granitemoehybrid", fmt, tmp_path)
    merged = save_random_adapter(reference, tmp_path / "adapter", seed=1)
    expected = _hf_tokens(merged) + _hf_tokens(reference)
    assert expected[:2] != expected[2:]  # the adapter changes the tokens
    adapter = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    llm = LLM(str(folder), enable_lora=True, max_loras=1, **LLM_ARGS)
    try:
        results = llm.generate(
            PROMPTS * 2, GREEDY, lora_request=[adapter, adapter, None, None], use_tqdm=False
        )
    finally:
        llm.shutdown()
    tokens = [result.outputs[0].token_ids for result in results]
    assert tokens == expected


def test_quantized_draft_model_drafts_what_its_dequantized_target_computes(
    plain_models: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """The AWQ checkpoint drafts for a plain target holding the reference's weights: the
    drafter computes what the target does, so every draft is accepted, and the tokens are
    the target's without speculation."""
    fmt = Int4Format("awq", 128)
    folder, reference = _quantized(plain_models, "llama", fmt, tmp_path)
    target = tmp_path / "target"
    reference.save_pretrained(target)
    expected = _generate(target)
    spec = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 2}
    llm = LLM(str(target), speculative_config=spec, **LLM_ARGS)
    try:
        results = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = engine_stats(llm).spec_decoding
    finally:
        llm.shutdown()
    assert [result.outputs[0].token_ids for result in results] == expected
    assert stats is not None
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_example_script_writes_a_checkpoint_the_engine_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m benchmarks.make_quantized_checkpoint OUT --act-order` writes a GPTQ
    checkpoint with a tokenizer; `LLM(OUT)` generates from a text prompt the tokens transformers
    generates from the folder's weights dequantized by the reference."""
    out = tmp_path / "tiny-gptq"
    monkeypatch.setattr(sys, "argv", ["make_quantized_checkpoint", str(out), "--act-order"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("benchmarks.make_quantized_checkpoint", run_name="__main__")
    assert exited.value.code == 0
    assert f"--model {out}" in capsys.readouterr().out
    reference = reference_from_folder(out, Int4Format("gptq", 128, act_order=True))
    llm = LLM(str(out), **LLM_ARGS)
    try:
        prompt = "Quantized weights, "
        (result,) = llm.generate([prompt], GREEDY, use_tqdm=False)
        prompt_ids = llm.get_tokenizer()(prompt)["input_ids"]
    finally:
        llm.shutdown()
    assert result.outputs[0].token_ids == hf_greedy(reference, prompt_ids, NUM_NEW)
