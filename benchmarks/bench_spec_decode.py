"""Speculative decoding (n-gram) against plain decoding, both in this process, same run.

Workloads on the default model (greedy, EOS ignored, `--max-tokens` output tokens each):
- copy-heavy: chat prompts asking to copy a given text (outputs largely repeat the prompt);
- non-repetitive: random-token prompts, sampled at temperature 1 (seeded): nothing for a prompt
  lookup to find in prompt or output (greedy decoding of a small model falls into loops, which
  n-gram drafts copy), so most drafts are rejected and the acceptance-aware switch pauses them.
Each runs at every `--concurrency` (c requests queued at once, `--rounds` times; c = 1 runs the
requests one after the other); acceptance and output tok/s, the best of `--repeats` alternating
runs per side. Then a repeated-prefix trace (conversations sharing long prefixes, one request
at a time) gives the prefix-cache hit rate with and without speculation. Greedy outputs of the
two engines must be identical (checked on the copy-heavy workload; sampled outputs differ by
draw, not by distribution).

    .venv/bin/python benchmarks/bench_spec_decode.py [--k 3] [--concurrency 1,16,64]
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import LLM, SamplingParams
from cluster.engine.metric_reader import Counter
from worker.default_model import ensure_default_model

TEXTS = [
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, members agreed to increase funding for the library and the public parks, "
    "while reducing the amount spent on consultants. The final vote was seven to two.",
    "To install the package, download the archive, extract it into a new folder, and run the "
    "setup script from a terminal. If the script reports a missing dependency, install it "
    "with your package manager and run the script again before starting the service.",
    "Rivers carry water from the mountains to the sea. Along the way they shape valleys, feed "
    "farmland and provide homes for fish and birds. In spring, melting snow raises the water "
    "level, and in late summer many small rivers become narrow streams.",
    "Our support team answers questions every weekday from nine in the morning until six in "
    "the evening. Please include your order number and a short description of the problem, "
    "and attach a photo if the item arrived damaged.",
]
Prompts = list[list[int]]


def copy_prompts(llm: LLM, count: int) -> Prompts:
    tokenizer = llm.get_tokenizer()
    prompts = []
    for index in range(count):
        text = TEXTS[index % len(TEXTS)]
        message = f"Copy the following text exactly, word for word:\n\n{text}"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


def random_prompts(count: int, vocab: int, seed: int) -> Prompts:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(32, 96))] for _ in range(count)]


def run(
    llm: LLM, prompts: Prompts, concurrency: int, max_tokens: int, temperature: float = 0.0
) -> tuple[float, Prompts]:
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
    start = time.perf_counter()
    outputs: Prompts = []
    for first in range(0, len(prompts), concurrency):
        results = llm.generate(prompts[first : first + concurrency], params, use_tqdm=False)
        outputs += [list(r.outputs[0].token_ids) for r in results]
    return time.perf_counter() - start, outputs


def reset_prefix_cache(llm: LLM) -> None:
    """Every run starts with a cold cache (the in-process engine's scheduler)."""
    assert llm.client.core.scheduler.reset_prefix_cache()  # type: ignore[attr-defined]


def counter(llm: LLM, name: str) -> int:
    for metric in llm.get_metrics():
        if metric.name == name and isinstance(metric, Counter):
            return metric.value
    return 0


def num_pauses(llm: LLM) -> int:
    switch = llm.client.core.scheduler.spec.switch  # type: ignore[attr-defined]
    return 0 if switch is None else int(switch.num_pauses)


def drafts(llm: LLM) -> tuple[int, int]:
    """Draft tokens verified and accepted so far."""
    return (
        counter(llm, "vllm:spec_decode_num_draft_tokens"),
        counter(llm, "vllm:spec_decode_num_accepted_tokens"),
    )


def best_runs(
    engines: dict[str, LLM], prompts: Prompts, concurrency: int, args: Any, temperature: float
) -> tuple[dict[str, float], dict[str, Prompts]]:
    """Per engine: the best seconds of `args.repeats` alternating cold-cache runs, and outputs."""
    best = {name: float("inf") for name in engines}
    outputs: dict[str, Prompts] = {}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            reset_prefix_cache(llm)
            seconds, outputs[name] = run(llm, prompts, concurrency, args.max_tokens, temperature)
            best[name] = min(best[name], seconds)
    return best, outputs


def compare(
    engines: dict[str, LLM], prompts: Prompts, concurrency: int, args: Any, temperature: float
) -> str:
    spec = engines["ngram"]
    before, pauses = drafts(spec), num_pauses(spec)
    best, outputs = best_runs(engines, prompts, concurrency, args, temperature)
    same = outputs["plain"] == outputs["ngram"] if temperature == 0 else "n/a (sampled)"
    after = drafts(spec)
    drafted, accepted = after[0] - before[0], after[1] - before[1]
    tokens = sum(len(out) for out in outputs["plain"])
    rate = {name: tokens / seconds for name, seconds in best.items()}
    return (
        f"c={concurrency:<3} plain {rate['plain']:7.1f} tok/s  ngram {rate['ngram']:7.1f} tok/s "
        f"= {rate['ngram'] / rate['plain']:.2f}x  acceptance {accepted / max(drafted, 1):.0%} "
        f"of {drafted} drafts  pauses {num_pauses(spec) - pauses}  identical={same}"
    )


def hit_rates(engines: dict[str, LLM], llm_prompts: Prompts, max_tokens: int) -> str:
    """A repeated-prefix trace, one request at a time: each prompt's first half is shared."""
    trace = []
    for index in range(12):
        base = llm_prompts[index % 4]
        trace.append(base + [(7 * index + 3) % 1000 + 100 for _ in range(8)])
    parts = []
    for name, llm in engines.items():
        reset_prefix_cache(llm)
        queries = counter(llm, "vllm:prefix_cache_queries")
        hits = counter(llm, "vllm:prefix_cache_hits")
        run(llm, trace, 1, max_tokens)
        rate = (counter(llm, "vllm:prefix_cache_hits") - hits) / max(
            counter(llm, "vllm:prefix_cache_queries") - queries, 1
        )
        parts.append(f"{name} {rate:.1%}")
    return "prefix hit rate (repeated prefixes): " + ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--lookup", type=int, default=3, help="prompt_lookup_max (min = 2)")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=1, help="batches of c requests per run")
    parser.add_argument("--single", type=int, default=4, help="requests at concurrency 1")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workloads", default="copy-heavy,non-repetitive", help="'' for none")
    parser.add_argument("--hit-rate-tokens", type=int, default=16, help="0: no hit-rate trace")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    path = str(ensure_default_model())
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": args.lookup,
    }
    engines = {
        "plain": LLM(path, device="cpu"),
        "ngram": LLM(path, device="cpu", speculative_config=spec),
    }
    vocab = engines["plain"].info.vocab_size
    print(f"torch threads {torch.get_num_threads()}; k={args.k}; {args.max_tokens} tokens each")
    for llm in engines.values():
        run(llm, random_prompts(2, vocab, 1), 2, 8)  # warm-up
    for workload in filter(None, args.workloads.split(",")):
        for concurrency in map(int, args.concurrency.split(",")):
            count = args.single if concurrency == 1 else concurrency * args.rounds
            if workload == "copy-heavy":
                prompts, temperature = copy_prompts(engines["plain"], count), 0.0
            else:
                prompts, temperature = random_prompts(count, vocab, concurrency), 1.0
            line = compare(engines, prompts, concurrency, args, temperature)
            print(f"{workload:14} {line}", flush=True)
    if args.hit_rate_tokens:
        print(hit_rates(engines, copy_prompts(engines["plain"], 4), args.hit_rate_tokens))
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
