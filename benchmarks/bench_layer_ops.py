"""Operations per decoder layer per decode step: torch dispatches other than views, counted
in the offline `LLM` (in-process, synchronous steps) while 8 requests decode together.

Every decoder layer's forward is wrapped in a dispatch-counting mode (the mode is entered in
the layer's own thread, as the engine runs it); a call whose input has one row per running
request is a decode step. The figure is the mean over the decode steps of (dispatches in all
layers / number of layers), with the ops named in a per-layer breakdown. The families: a
Llama, a Gemma 3 (sliding window + full) and a Qwen3.5 (gated DeltaNet + gated full attention)
tiny random checkpoint, fp32.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_layer_ops.py [--families llama,gemma3]
        [--breakdown]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import LLM, SamplingParams

NUM_REQUESTS = 8
PROMPT_LEN = 12
NUM_NEW = 6


class DispatchCounter(TorchDispatchMode):
    """Counts the aten ops that reach dispatch, views (outputs aliasing an input) left out."""

    def __init__(self, counts: collections.Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(  # type: ignore[no-untyped-def]
        self, func, types, args=(), kwargs=None
    ):
        if not _is_view(func):
            self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _is_view(func: Any) -> bool:
    """Whether an aten op returns a view of its input (its schema's output aliases it and does
    not write: `view`, `t`, `slice`, `split`, ...)."""
    schema = func._schema
    if schema.is_mutable:
        return False
    return any(ret.alias_info is not None for ret in schema.returns)


@dataclass
class LayerOpCounts:
    """Dispatches of the decoder layers over the decode steps seen."""

    num_layers: int
    step_totals: list[int] = field(default_factory=list)
    """Per decode step: dispatches in all layers together."""
    ops: collections.Counter[str] = field(default_factory=collections.Counter)
    """Per op name, over all decode steps."""

    def per_layer(self) -> float:
        """Mean dispatches per decoder layer per decode step."""
        assert self.step_totals, "no decode step was seen"
        return sum(self.step_totals) / len(self.step_totals) / self.num_layers

    def breakdown(self) -> list[tuple[str, float]]:
        """(op, dispatches per layer per decode step), most frequent first."""
        scale = 1 / (len(self.step_totals) * self.num_layers)
        return [(name, count * scale) for name, count in self.ops.most_common()]


def decoder_layers(llm: LLM) -> torch.nn.ModuleList:
    """The in-process model's decoder layer stack (`model.layers`)."""
    model = llm.client.core.executor.worker.model_runner.model  # type: ignore[attr-defined]
    layers = model.model.layers
    assert isinstance(layers, torch.nn.ModuleList)
    return layers


@contextmanager
def count_decode_ops(llm: LLM, num_requests: int) -> Iterator[LayerOpCounts]:
    """Count the dispatches of every decoder layer in steps of `num_requests` rows."""
    layers = decoder_layers(llm)
    result = LayerOpCounts(num_layers=len(layers))
    step: collections.Counter[str] = collections.Counter()
    modes: list[DispatchCounter] = []

    def enter(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if args[0].shape[0] == num_requests:
            modes.append(DispatchCounter(step))
            modes[-1].__enter__()

    def leave(module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if modes:
            modes.pop().__exit__(None, None, None)
            if module is layers[-1]:
                result.step_totals.append(sum(step.values()))
                result.ops.update(step)
                step.clear()

    hooks = [layer.register_forward_pre_hook(enter) for layer in layers]
    hooks += [layer.register_forward_hook(leave) for layer in layers]
    try:
        yield result
    finally:
        for hook in hooks:
            hook.remove()


def decode_prompts(num_requests: int = NUM_REQUESTS) -> list[list[int]]:
    """`num_requests` prompts of `PROMPT_LEN` token ids (prefilled in one step together)."""
    return [[(7 * i + 3 * r + 1) % 200 + 1 for i in range(PROMPT_LEN)] for r in range(num_requests)]


def measure(llm: LLM, num_requests: int = NUM_REQUESTS) -> LayerOpCounts:
    """Decode `num_requests` greedy requests together and count their layers' dispatches."""
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    with torch.inference_mode(), count_decode_ops(llm, num_requests) as counts:
        llm.generate(decode_prompts(num_requests), params, use_tqdm=False)
    return counts


LLM_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 4,
    "enable_prefix_caching": False,
    "async_scheduling": False,
    "distributed_executor_backend": "uni",
    "kv_cache_memory_bytes": 1 << 23,
    "max_num_batched_tokens": 256,
}
"""Engine arguments of the count: in-process, synchronous steps, one prefill step for all."""


def _save_llama(path: Path) -> None:
    from tests.helpers.tiny_models import save_tiny_model

    save_tiny_model("llama", path)


def _save_gemma3(path: Path) -> None:
    from tests.helpers.tiny_models import save_tiny_model

    save_tiny_model("gemma3", path)


def _save_qwen3_5(path: Path) -> None:
    from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid

    save_tiny_linear_hybrid("qwen3_5", path)


FAMILIES: dict[str, Callable[[Path], None]] = {
    "llama": _save_llama,
    "gemma3": _save_gemma3,
    "qwen3_5": _save_qwen3_5,
}
"""Tiny checkpoint writers of the families counted."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--breakdown", action="store_true", help="ops per layer by name")
    opts = parser.parse_args()
    print("| family | ops per decoder layer per decode step |")
    print("|---|---:|")
    for family in opts.families.split(","):
        with tempfile.TemporaryDirectory() as folder:
            FAMILIES[family](Path(folder))
            llm = LLM(folder, **LLM_ARGS)
            counts = measure(llm)
            llm.shutdown()
        print(f"| {family} | {counts.per_layer():.1f} |", flush=True)
        if opts.breakdown:
            print("  " + ", ".join(f"{name} {n:.2f}" for name, n in counts.breakdown()))


if __name__ == "__main__":
    main()
