"""Speculative decoding with a draft model against plain decoding, both in this process, same run.

The draft model is the default model itself (`--draft` takes any folder with the same
vocabulary): every draft is accepted, so the figures show what the drafter's own steps cost
(its catch-up in each step and k single-token steps after sampling) against the target steps
that acceptance saves. Workloads and timing as `bench_spec_decode.py` (copy-heavy and
non-repetitive prompts, greedy, EOS ignored, best of `--repeats` alternating runs); greedy
outputs of the two engines must be identical (checked).

    .venv/bin/python benchmarks/bench_spec_drafters.py [--k 3] [--concurrency 1,16]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec_decode import best_runs, copy_prompts, drafts, random_prompts, run

from cluster import LLM
from worker.default_model import ensure_default_model


def compare(
    plain: LLM, draft: LLM, prompts: list[list[int]], concurrency: int, args: argparse.Namespace
) -> str:
    before = drafts(draft)
    engines = {"plain": plain, "draft": draft}
    best, outputs = best_runs(engines, prompts, concurrency, args, temperature=0.0)
    after = drafts(draft)
    drafted, accepted = after[0] - before[0], after[1] - before[1]
    tokens = sum(len(out) for out in outputs["plain"])
    rate = {name: tokens / seconds for name, seconds in best.items()}
    return (
        f"c={concurrency:<3} plain {rate['plain']:7.1f} tok/s  draft_model {rate['draft']:7.1f} "
        f"tok/s = {rate['draft'] / rate['plain']:.2f}x  acceptance "
        f"{accepted / max(drafted, 1):.0%} of {drafted} drafts  "
        f"identical={outputs['plain'] == outputs['draft']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--draft", default=None, help="draft model folder (default: the target)")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--single", type=int, default=2, help="requests at concurrency 1")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    path = str(ensure_default_model())
    spec = {"method": "draft_model", "model": args.draft or path, "num_speculative_tokens": args.k}
    plain = LLM(path, device="cpu")
    draft = LLM(path, device="cpu", speculative_config=spec)
    vocab = plain.info.vocab_size
    print(f"torch threads {torch.get_num_threads()}; k={args.k}; {args.max_tokens} tokens each")
    for llm in (plain, draft):
        run(llm, random_prompts(2, vocab, 1), 2, 8)  # warm-up
    for workload in ("copy-heavy", "non-repetitive"):
        for concurrency in map(int, args.concurrency.split(",")):
            count = args.single if concurrency == 1 else concurrency
            if workload == "copy-heavy":
                prompts = copy_prompts(plain, count)
            else:
                prompts = random_prompts(count, vocab, concurrency)
            print(f"{workload:14} {compare(plain, draft, prompts, concurrency, args)}", flush=True)
    plain.shutdown()
    draft.shutdown()


if __name__ == "__main__":
    main()
