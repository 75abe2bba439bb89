"""The end-to-end figure of the GPU check: batch decode of a Llama-8B-shaped random model.

Our offline `LLM` (random weights: `load_format="dummy"`, the default kernels) and transformers'
`LlamaForCausalLM` with SDPA attention (the same forward with attention replaced by SDPA) each
generate for `batch` prompts of `prompt_len` random tokens at once, first one token (the
prefill), then `1 + new_tokens`; the difference is the decode time of `new_tokens` steps.

The roofline of a decode step reads every weight once and every request's K/V once, at the
copy bandwidth measured in the same run: `batch / ((weight bytes + K/V bytes) / bandwidth)`
tokens/s at the mean context of the decode steps. Each side reports its fraction of it.
`tiny` swaps in a two-layer model for the CPU dry run.
"""

from __future__ import annotations

import gc
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers

from cluster import LLM, SamplingParams

LLAMA_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
TINY = {**LLAMA_8B, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


@dataclass(frozen=True)
class DecodeRun:
    """One measured shape."""

    shape: dict[str, object]
    batch: int
    prompt_len: int
    new_tokens: int
    dtype: torch.dtype
    device: str

    @property
    def config(self) -> transformers.LlamaConfig:
        return transformers.LlamaConfig(
            **self.shape, architectures=["LlamaForCausalLM"], eos_token_id=None,
            bos_token_id=None, pad_token_id=None, dtype=str(self.dtype).removeprefix("torch."),
        )  # fmt: skip

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.new_tokens + 16

    def prompts(self) -> list[list[int]]:
        rng = random.Random(0)
        vocab = int(self.shape["vocab_size"])  # type: ignore[call-overload]
        return [[rng.randrange(vocab) for _ in range(self.prompt_len)] for _ in range(self.batch)]


def decode_run(tiny: bool, device: torch.device) -> DecodeRun:
    if tiny:
        return DecodeRun(TINY, 8, 32, 16, torch.float32, device.type)
    return DecodeRun(LLAMA_8B, 64, 512, 128, torch.bfloat16, device.type)


def e2e_figures(run: DecodeRun, copy_gbs: float) -> dict[str, object]:
    """Decode tokens/s of ours and of transformers + SDPA, and each one's roofline fraction."""
    roofline = _roofline_tok_s(run, copy_gbs)
    ours = _ours_decode_tok_s(run)
    _release_memory()
    theirs = _transformers_decode_tok_s(run)
    _release_memory()
    return {
        "model": "Llama-8B-shaped" if run.shape is LLAMA_8B else "tiny Llama",
        "batch": run.batch,
        "prompt_len": run.prompt_len,
        "new_tokens": run.new_tokens,
        "dtype": str(run.dtype),
        "roofline_tok_s": round(roofline),
        "ours_tok_s": round(ours),
        "ours_fraction_of_roofline": round(ours / roofline, 3),
        "sdpa_tok_s": round(theirs),
        "sdpa_fraction_of_roofline": round(theirs / roofline, 3),
        "ours_vs_sdpa": round(ours / theirs, 3),
    }


def _roofline_tok_s(run: DecodeRun, copy_gbs: float) -> float:
    config = run.config
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    element = torch.tensor([], dtype=run.dtype).element_size()
    weight_bytes = sum(p.numel() for p in model.parameters()) * element
    mean_context = run.prompt_len + run.new_tokens / 2
    step_bytes = weight_bytes + run.batch * mean_context * _kv_bytes_per_token(run)
    return run.batch * copy_gbs * 1e9 / step_bytes


def _decode_seconds(generate: Callable[[int], object], run: DecodeRun) -> float:
    """Seconds of `new_tokens` decode steps: (1 + new) tokens minus 1 token, best of two."""
    generate(2)  # warm-up: kernels compiled, memory pools grown
    spans = []
    for _ in range(2):
        start = time.perf_counter()
        generate(1)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        generate(1 + run.new_tokens)
        spans.append(time.perf_counter() - start - prefill)
    return min(spans)


def _ours_decode_tok_s(run: DecodeRun) -> float:
    prompts = run.prompts()
    with tempfile.TemporaryDirectory() as folder:
        llm = _our_llm(run, folder)
        try:

            def generate(num: int) -> object:
                params = SamplingParams(temperature=0, max_tokens=num, ignore_eos=True)
                return llm.generate(prompts, params, use_tqdm=False)

            seconds = _decode_seconds(generate, run)
        finally:
            llm.shutdown()
    return run.batch * run.new_tokens / seconds


def _our_llm(run: DecodeRun, folder: str) -> LLM:
    """Our engine on a random model of the run's shape, saved as config.json in `folder`."""
    run.config.save_pretrained(folder)
    return LLM(folder, load_format="dummy", device=run.device, dtype=str(run.dtype)[6:],
               max_num_seqs=run.batch, enable_prefix_caching=False, max_model_len=run.max_len,
               kv_cache_memory_bytes=_kv_bytes(run))  # fmt: skip


def _kv_bytes(run: DecodeRun) -> int:
    """Room for every request's whole sequence, twice over."""
    return 2 * run.batch * run.max_len * _kv_bytes_per_token(run)


def _kv_bytes_per_token(run: DecodeRun) -> int:
    """K and V of one token over every layer."""
    config = run.config
    element = torch.tensor([], dtype=run.dtype).element_size()
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element


def _transformers_decode_tok_s(run: DecodeRun) -> float:
    with torch.device(run.device):
        model = transformers.LlamaForCausalLM._from_config(
            run.config, attn_implementation="sdpa", dtype=run.dtype
        ).eval()
    input_ids = torch.tensor(run.prompts(), device=run.device)

    def generate(num: int) -> object:
        with torch.no_grad():
            return model.generate(
                input_ids, max_new_tokens=num, min_new_tokens=num, do_sample=False
            )

    seconds = _decode_seconds(generate, run)
    return run.batch * run.new_tokens / seconds


def profile_decode(run: DecodeRun, steps: int = 16) -> str:
    """torch.profiler's tables (by self CPU time, then by device time) of our engine generating
    `steps` tokens for the batch from 16-token prompts (a short prefill, so decode dominates),
    headed by the wall time per step and the device-busy share of it."""
    from torch.profiler import ProfilerActivity, profile

    short = DecodeRun(run.shape, run.batch, 16, steps, run.dtype, run.device)
    activities = [ProfilerActivity.CPU]
    if run.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with tempfile.TemporaryDirectory() as folder:
        llm = _our_llm(short, folder)
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        try:
            llm.generate(short.prompts(), params, use_tqdm=False)  # warm-up
            start = time.perf_counter()
            with profile(activities=activities) as prof:
                llm.generate(short.prompts(), params, use_tqdm=False)
            wall = time.perf_counter() - start
        finally:
            llm.shutdown()
    averages = prof.key_averages()
    device_us = sum(event.self_device_time_total for event in averages)
    head = (f"{steps} steps of batch {run.batch}: {wall / steps * 1e3:.2f} ms per step (wall, "
            f"profiled), device busy {device_us / 1e3 / wall / 10:.1f} % of it")  # fmt: skip
    by_cpu = averages.table(sort_by="self_cpu_time_total", row_limit=25)
    by_device = averages.table(sort_by="self_device_time_total", row_limit=25)
    _release_memory()
    return f"{head}\n\nby self CPU time:\n{by_cpu}\n\nby device time:\n{by_device}\n"


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
