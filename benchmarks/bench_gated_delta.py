"""Gated delta rule kernel throughput: the chunked (prefill) form against the recurrent
(token-by-token) form measured in the same run, for one gated DeltaNet layer of one rank.

Shapes: `--k-heads` key heads and twice as many value heads, 128 x 128 each (Qwen3-Next's
per-head sizes); fp32 on CPU, bf16 inputs on CUDA (where fla-core is also timed when
installed). Cases: one prefill of `--prefill` tokens, and a decode step of `--decodes`
one-token sequences. Tokens per second, best of `--repeats`.

    .venv/bin/python benchmarks/bench_gated_delta.py [--prefill 2048] [--decodes 64]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import gated_delta_reference as ref
from kernels.gated_delta_registry import select_gated_delta_kernels

DIM = 128


def _inputs(num_tokens: int, k_heads: int, device: torch.device) -> ref.DeltaRuleInputs:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device)

    return ref.DeltaRuleInputs(
        q=ref.l2_normalize(rand(num_tokens, k_heads, DIM)).to(dtype),
        k=ref.l2_normalize(rand(num_tokens, k_heads, DIM)).to(dtype),
        v=rand(num_tokens, 2 * k_heads, DIM).to(dtype),
        g=-F.softplus(rand(num_tokens, 2 * k_heads)),
        beta=torch.sigmoid(rand(num_tokens, 2 * k_heads)).to(dtype),
    )


def _best(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--decodes", type=int, default=64)
    parser.add_argument("--k-heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    forms = {
        "torch chunked": ref.chunked_gated_delta_rule,
        "torch recurrent": ref.recurrent_gated_delta_rule,
    }
    selected = select_gated_delta_kernels(device)
    if selected.name != "torch":
        forms[f"{selected.name} chunked"] = selected.chunked
        forms[f"{selected.name} recurrent"] = selected.recurrent
    cases = {"prefill": [0, args.prefill], "decode": list(range(args.decodes + 1))}
    print(f"device {device}, {args.k_heads} key / {2 * args.k_heads} value heads of {DIM}")
    print("| case | kernel | tokens/s | vs torch recurrent |")
    print("|---|---|---|---|")
    for case, starts in cases.items():
        inputs = _inputs(starts[-1], args.k_heads, device)
        states = torch.zeros(len(starts) - 1, 2 * args.k_heads, DIM, DIM, device=device)
        seconds = {}
        for name, fn in forms.items():

            def run(fn=fn, inputs=inputs, states=states, starts=starts) -> object:
                return fn(inputs, states, starts, DIM**-0.5)

            seconds[name] = _best(run, device, args.repeats)
        for name, took in seconds.items():
            ratio = seconds["torch recurrent"] / took
            print(f"| {case} | {name} | {starts[-1] / took:,.0f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
