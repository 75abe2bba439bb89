"""The KV pull figure of the GPU check: from how many prompt tokens pulling a peer's cached
prefix beats recomputing it, on the Llama-8B shape (`pull_threshold_tokens`, provisional 256).

Two engine actors of one random model (`load_format="dummy"`) on local Ray, sharing the device
(on CUDA a fraction of the GPU each, each with its own KV pool): a sender with the direct
transport (pages rank to rank, staged through host memory) and a receiver. Per prompt length N,
fresh prompts every time, the two ways alternating:
- recompute: the receiver prefills the N-token prompt and samples one token (time to first
  token through the actor);
- pull: the sender has prefilled the prompt (untimed); `pull_prefix` moves its cached prefix
  into the receiver, which then runs the same request on the hit (pull + time to first token).
Each figure is the median of `repeats`, after one untimed round per length. The crossover is
interpolated linearly where (pull - recompute) changes sign for the last time over the measured
lengths (None when pulling never wins, or always does).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from itertools import count
from pathlib import Path

import ray
import torch
import transformers
from gpu_check_e2e import LLAMA_8B, TINY

from cluster.config.engine_args import EngineArgs
from cluster.engine.client import collect
from cluster.engine.executor.placement import PlacementSpec
from cluster.engine.kv_transfer_ray import pull_prefix
from cluster.engine.ray_client import RayEngineClient
from cluster.engine.request import EngineRequest
from scheduler.request import SamplingParams

Figures = dict[str, object]
BLOCK_SIZE = 16


def kv_pull_figures(device: torch.device, tiny: bool) -> Figures:
    """Per length: recompute and pull milliseconds; then the crossover in tokens."""
    lengths = (32, 128) if tiny else (64, 128, 256, 512, 1024, 2048, 4096)
    repeats = 1 if tiny else 5
    shape, dtype = (TINY, "float32") if tiny else (LLAMA_8B, "bfloat16")
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", _node_ip_address="127.0.0.2", include_dashboard=False)
    with tempfile.TemporaryDirectory() as folder:
        _save_config(shape, dtype, Path(folder))
        sender = _start(folder, dtype, device, "direct", max(lengths), tiny)
        receiver = _start(folder, dtype, device, "object_store", max(lengths), tiny)
        try:
            rows = [_length_row(sender, receiver, length, repeats) for length in lengths]
        finally:
            sender.shutdown()
            receiver.shutdown()
            if started_ray:
                ray.shutdown()
    return {
        "model": "Llama-8B-shaped" if shape is LLAMA_8B else "tiny Llama",
        "dtype": dtype,
        "kv_bytes_per_token": _kv_bytes_per_token(shape, dtype),
        "rows": rows,
        "crossover_tokens": crossover(rows),
        "pull_threshold_tokens_now": 256,
    }


def crossover(rows: list[dict[str, object]]) -> int | None:
    """Tokens where pulling starts to win for good (linear between the two lengths around the
    last sign change of pull - recompute); None if it never wins or always does."""
    gaps = [(int(row["tokens"]), float(row["pull_ms"]) - float(row["recompute_ms"]))  # type: ignore[call-overload, arg-type]
            for row in rows]  # fmt: skip
    if not gaps or gaps[-1][1] >= 0 or all(gap < 0 for _, gap in gaps):
        return None
    last_loss = max(i for i, (_, gap) in enumerate(gaps) if gap >= 0)
    (low, low_gap), (high, high_gap) = gaps[last_loss], gaps[last_loss + 1]
    return round(low + (high - low) * low_gap / (low_gap - high_gap))


def _length_row(
    sender: RayEngineClient, receiver: RayEngineClient, length: int, repeats: int
) -> dict[str, object]:
    recompute: list[float] = []
    pull: list[float] = []
    for repeat in range(repeats + 1):  # the first round warms this length up
        prompt = _fresh_prompt(length)
        recompute_s = _timed(lambda prompt=prompt: _first_token(receiver, prompt))
        prompt = _fresh_prompt(length)
        _first_token(sender, prompt)
        pull_s = _timed(lambda prompt=prompt: _pull_then_first_token(sender, receiver, prompt))
        if repeat:
            recompute.append(recompute_s)
            pull.append(pull_s)
    recompute_ms, pull_ms = statistics.median(recompute) * 1e3, statistics.median(pull) * 1e3
    return {
        "tokens": length,
        "recompute_ms": round(recompute_ms, 2),
        "pull_ms": round(pull_ms, 2),
        "pull_vs_recompute": round(pull_ms / recompute_ms, 3),
    }


def _pull_then_first_token(
    sender: RayEngineClient, receiver: RayEngineClient, prompt: list[int]
) -> None:
    result = pull_prefix(sender.actor, receiver.actor, prompt, timeout_s=60)
    assert result.num_blocks > 0, "the pull moved no block"
    _first_token(receiver, prompt)


def _first_token(client: RayEngineClient, prompt: list[int]) -> None:
    request = EngineRequest(
        f"r{next(_REQUEST_IDS)}", tuple(prompt), SamplingParams(temperature=0, max_tokens=1)
    )
    collect(client.add_request(request))


_REQUEST_IDS = count()
_PROMPT_SEEDS = count(1)


def _fresh_prompt(length: int) -> list[int]:
    """A prompt no engine has seen (the first token differs from every earlier prompt's)."""
    seed = next(_PROMPT_SEEDS)
    return [seed, *((seed * 31 + 7 * i) % 250 + 1 for i in range(length - 1))]


def _timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _save_config(shape: dict[str, object], dtype: str, folder: Path) -> None:
    config = transformers.LlamaConfig(
        **shape, architectures=["LlamaForCausalLM"], eos_token_id=None, bos_token_id=None,
        pad_token_id=None, dtype=dtype,
    )  # fmt: skip
    config.save_pretrained(folder)


def _start(
    folder: str, dtype: str, device: torch.device, transport: str, max_len: int, tiny: bool
) -> RayEngineClient:
    kv_bytes = (64 << 20) if tiny else (12 << 30)
    args = EngineArgs(
        model=folder, load_format="dummy", dtype=dtype, device=device.type,
        block_size=BLOCK_SIZE, max_model_len=max_len + BLOCK_SIZE,
        max_num_batched_tokens=max(2048, max_len), kv_cache_memory_bytes=kv_bytes,
        kv_transfer_transport=transport,  # type: ignore[arg-type]
    )  # fmt: skip
    bundle = {"CPU": 0.1} if device.type == "cpu" else {"CPU": 0.1, "GPU": 0.45}
    return RayEngineClient.start(args, placement=PlacementSpec((bundle,)))


def _kv_bytes_per_token(shape: dict[str, object], dtype: str) -> int:
    layers, kv_heads = int(shape["num_hidden_layers"]), int(shape["num_key_value_heads"])  # type: ignore[call-overload]
    head_dim = int(shape["hidden_size"]) // int(shape["num_attention_heads"])  # type: ignore[call-overload]
    return 2 * layers * kv_heads * head_dim * (4 if dtype == "float32" else 2)
