"""The GPU check's `graphs` section: decode with CUDA graphs against eager steps and transformers.

For a Llama-8B-shaped, a Qwen3.5-shaped (gated DeltaNet + full attention, 16 of the 27B's 64
layers) and a Gemma-3-shaped (sliding window + full, Gemma-3-4B's text layers) random model
(`load_format="dummy"`), at batch 1, 8 and 64: decode tokens/s of our engine with graphs (the
default), with `enforce_eager=True`, and of transformers (SDPA), each as a fraction of the
bandwidth roofline measured in the same run (every weight and every request's KV / state read
once per step); and kernel launches per decode step (graph launches count one each). `tiny`
swaps in two-layer models at batch 2 for the CPU dry run (graphs are off on CPU: the
graph and eager columns then run the same path).
"""

from __future__ import annotations

import gc
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from cluster import LLM, SamplingParams

LLAMA_8B = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rope_theta": 500000.0, "tie_word_embeddings": False,
}  # fmt: skip
QWEN3_5 = {
    "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
    "num_hidden_layers": 16, "num_attention_heads": 24, "num_key_value_heads": 4,
    "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": False,
}  # fmt: skip
GEMMA3 = {
    "vocab_size": 262144, "hidden_size": 2560, "intermediate_size": 10240,
    "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 1024,
}  # fmt: skip
TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
TINY_DELTA = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
              "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
              "layer_types": ["linear_attention", "full_attention"]}  # fmt: skip
MODELS = {
    "Llama-8B-shaped": ("LlamaConfig", "LlamaForCausalLM", LLAMA_8B, {}),
    "Qwen3.5-shaped": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", QWEN3_5, TINY_DELTA),
    "Gemma-3-shaped": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3, {"sliding_window": 8}),
}
MODES = ("graphs", "eager", "transformers")


@dataclass(frozen=True)
class GraphRun:
    """One model at one batch size."""

    name: str
    config: Any
    model_class: str
    batch: int
    prompt_len: int
    new_tokens: int
    dtype: torch.dtype
    device: str

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.new_tokens + 16

    def prompts(self) -> list[list[int]]:
        rng = random.Random(0)
        vocab = self.config.vocab_size
        return [[rng.randrange(vocab) for _ in range(self.prompt_len)] for _ in range(self.batch)]


def graph_runs(tiny: bool, device: torch.device) -> list[GraphRun]:
    dtype = torch.float32 if tiny else torch.bfloat16
    runs = []
    for name, (config_class, model_class, shape, tiny_extra) in MODELS.items():
        values = {**shape, **TINY, **tiny_extra} if tiny else shape
        config = getattr(transformers, config_class)(
            **values, architectures=[model_class], eos_token_id=None, bos_token_id=None,
            pad_token_id=None, max_position_embeddings=4096, dtype=str(dtype)[6:],
        )  # fmt: skip
        for batch in (2,) if tiny else (1, 8, 64):
            new_tokens = 4 if tiny else 64
            runs.append(GraphRun(name, config, model_class, batch, 16 if tiny else 512,
                                 new_tokens, dtype, device.type))  # fmt: skip
    return runs


def graphs_figures(device: torch.device, tiny: bool, copy_gbs: float) -> list[dict[str, object]]:
    """One row per model and batch: tokens/s and roofline fraction of each mode."""
    rows = []
    for run in graph_runs(tiny, device):
        roofline = _roofline_tok_s(run, copy_gbs)
        row: dict[str, object] = {"model": run.name, "batch": run.batch,
                                  "roofline_tok_s": round(roofline)}  # fmt: skip
        for mode in MODES:
            tok_s, launches = _decode_tok_s(run, mode)
            row[f"{mode}_tok_s"] = round(tok_s, 1)
            row[f"{mode}_fraction"] = round(tok_s / roofline, 3)
            if launches is not None:
                row[f"{mode}_launches_per_step"] = launches
            _release_memory()
        row["graphs_vs_eager"] = round(row["graphs_tok_s"] / row["eager_tok_s"], 3)  # type: ignore[operator]
        rows.append(row)
    return rows


def _decode_tok_s(run: GraphRun, mode: str) -> tuple[float, float | None]:
    """Decode tokens/s of `mode`, and its kernel launches per decode step (CUDA)."""
    if mode == "transformers":
        return _transformers_tok_s(run), None
    prompts = run.prompts()
    with tempfile.TemporaryDirectory() as folder:
        run.config.save_pretrained(folder)
        llm = LLM(folder, load_format="dummy", device=run.device, dtype=str(run.dtype)[6:],
                  max_num_seqs=max(run.batch, 8), enable_prefix_caching=False,
                  max_model_len=run.max_len, enforce_eager=mode == "eager",
                  gpu_memory_utilization=0.8)  # fmt: skip
        try:

            def generate(num: int) -> object:
                params = SamplingParams(temperature=0, max_tokens=num, ignore_eos=True)
                return llm.generate(prompts, params, use_tqdm=False)

            seconds = _decode_seconds(generate, run)
            launches = _launches_per_step(generate, run) if run.device == "cuda" else None
        finally:
            llm.shutdown()
    return run.batch * run.new_tokens / seconds, launches


def _transformers_tok_s(run: GraphRun) -> float:
    model_class = getattr(transformers, run.model_class)
    with torch.device(run.device):
        model = model_class._from_config(run.config, attn_implementation="sdpa", dtype=run.dtype)
    model.eval()
    input_ids = torch.tensor(run.prompts(), device=run.device)

    def generate(num: int) -> object:
        with torch.no_grad():
            return model.generate(input_ids, max_new_tokens=num, min_new_tokens=num,
                                  do_sample=False)  # fmt: skip

    seconds = _decode_seconds(generate, run)
    return run.batch * run.new_tokens / seconds


def _decode_seconds(generate: Callable[[int], object], run: GraphRun) -> float:
    """Seconds of `new_tokens` decode steps: (1 + new) tokens minus 1 token, best of two."""
    generate(2)
    spans = []
    for _ in range(2):
        start = time.perf_counter()
        generate(1)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        generate(1 + run.new_tokens)
        spans.append(time.perf_counter() - start - prefill)
    return min(spans)


LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")


def _launches_per_step(generate: Callable[[int], object], run: GraphRun) -> float:
    """Kernel and graph launches of `new_tokens` decode steps (minus the prefill's), per step."""
    from torch.profiler import ProfilerActivity, profile

    def launches(num: int) -> int:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            generate(num)
        return sum(e.count for e in prof.key_averages() if e.key in LAUNCH_EVENTS)

    return round((launches(1 + run.new_tokens) - launches(1)) / run.new_tokens, 1)


def _roofline_tok_s(run: GraphRun, copy_gbs: float) -> float:
    """batch / (bytes of one decode step / copy bandwidth) at the mean context."""
    model_class = getattr(transformers, run.model_class)
    with torch.device("meta"):
        model = model_class._from_config(run.config)
    element = torch.tensor([], dtype=run.dtype).element_size()
    weight_bytes = sum(p.numel() for p in model.parameters()) * element
    context = run.prompt_len + run.new_tokens / 2
    step_bytes = weight_bytes + run.batch * _request_bytes(run.config, context, element)
    return run.batch * copy_gbs * 1e9 / step_bytes


def _request_bytes(config: Any, context: float, element: int) -> float:
    """KV (and recurrent state) bytes one request reads per decode step."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_key_value_heads * head_dim * element
    total = 0.0
    for layer_type in (
        getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    ):
        if layer_type == "sliding_attention":
            total += per_token * min(context, config.sliding_window)
        elif layer_type == "linear_attention":
            total += (
                element
                * config.linear_num_value_heads
                * (config.linear_key_head_dim * config.linear_value_head_dim)
            )
        else:
            total += per_token * context
    return total


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
