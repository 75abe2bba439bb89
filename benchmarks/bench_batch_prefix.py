"""Batch throughput of prefix-grouped order against input order, output lines in input order.

The batch: `--groups` groups of `--per-group` `/v1/completions` lines; the lines of a group share
a `--prefix-tokens` prompt prefix and differ in an 8-token suffix, and the groups are interleaved
in the input (line j of group g at position j * groups + g). Each line asks for `--max-tokens`
tokens (greedy, EOS ignored). The KV cache (`--kv-cache-mib`) holds only a few prefixes, so in
input order a group's prefix is evicted before its next line comes and is computed again; in
prefix order (`cluster.serve.batch_dispatch`) a group's leader computes it once and the other
lines of the group find it cached.

Both orders run the same lines through the same in-process model server and the same code as
`hybridserve run-batch` (`cluster.batch.openai_run.run_lines`, the CLI's window), alternating,
`--repeats` times each; the best run of each is kept. Both outputs are written in input order and
checked: each line's `custom_id` where it was in the input, every answer equal between the
orders. The model: a random llama (`--hidden-size`, 4 layers) with the tests' word tokenizer.

    .venv/bin/python benchmarks/bench_batch_prefix.py [--groups 6] [--per-group 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.batch.openai_run import run_lines, write_output
from cluster.cli.run_batch import DEFAULT_WINDOW
from cluster.openai_api.batch_protocol import BatchLine, read_batch_lines
from cluster.serve.batch_dispatch import Order
from cluster.serve.llm_server import LLMServer
from tests.helpers.serve_app import save_word_tokenizer
from tests.helpers.tiny_models import save_tiny_model

GOAL = 1.5
SUFFIX_TOKENS = 8
VOCAB = 256


def batch_input(groups: int, per_group: int, prefix_tokens: int, max_tokens: int) -> str:
    """The JSONL input: the groups' lines interleaved."""
    rng = random.Random(0)
    words = [f"t{i}" for i in range(1, VOCAB)]
    prefixes = [" ".join(rng.choices(words, k=prefix_tokens)) for _ in range(groups)]
    lines = []
    for position in range(per_group):
        for group, prefix in enumerate(prefixes):
            suffix = " ".join(rng.choices(words, k=SUFFIX_TOKENS))
            body = {
                "model": "bench",
                "prompt": f"{prefix} {suffix}",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            custom_id = f"g{group}-{position}"
            line = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions"}
            lines.append(json.dumps({**line, "body": body}))
    return "\n".join(lines) + "\n"


def make_server(model_dir: Path, kv_cache_bytes: int) -> LLMServer:
    config = {
        "model_loading_config": {"model_id": "bench", "model_source": str(model_dir)},
        "engine_kwargs": {
            "dtype": "float32",
            "block_size": 16,
            "kv_cache_memory_bytes": kv_cache_bytes,
            "distributed_executor_backend": "uni",
        },
        "log_engine_metrics": False,
    }
    return LLMServer(config)


async def run_once(
    server: LLMServer, lines: list[BatchLine], order: Order, folder: Path
) -> tuple[float, list[dict[str, Any]]]:
    """Seconds for the whole batch in `order` from an empty prefix cache, and its output lines
    (in input order)."""
    partial, output = folder / f"{order}.partial", folder / f"{order}.jsonl"
    partial.unlink(missing_ok=True)
    assert await server.control("reset_prefix_cache")
    start = time.perf_counter()
    finished = await run_lines(server, lines, partial, DEFAULT_WINDOW, order)
    seconds = time.perf_counter() - start
    write_output(output, lines, finished)
    return seconds, [json.loads(text) for text in output.read_text().splitlines()]


async def run_orders(
    server: LLMServer, lines: list[BatchLine], folder: Path, repeats: int
) -> tuple[dict[str, float], dict[str, list[dict[str, Any]]]]:
    """Each order's best seconds and its output lines; the orders alternate."""
    best: dict[str, float] = {}
    outputs: dict[str, list[dict[str, Any]]] = {}
    await run_once(server, lines[:4], "input", folder)  # warm-up
    for _ in range(repeats):
        for order in ("input", "prefix"):
            seconds, output = await run_once(server, lines, order, folder)
            best[order] = min(best.get(order, seconds), seconds)
            outputs[order] = output
            print(f"  {order:6s} order: {seconds:6.2f} s", flush=True)
    return best, outputs


def texts(output_lines: list[dict[str, Any]]) -> list[str]:
    return [line["response"]["body"]["choices"][0]["text"] for line in output_lines]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--kv-cache-mib", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="bench-batch-prefix-"))
    model_dir = folder / "model"
    save_tiny_model(
        "llama",
        model_dir,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        max_position_embeddings=2 * (args.prefix_tokens + SUFFIX_TOKENS + args.max_tokens),
    )
    save_word_tokenizer(model_dir, VOCAB)
    content = batch_input(args.groups, args.per_group, args.prefix_tokens, args.max_tokens)
    lines = read_batch_lines(content)
    server = make_server(model_dir, int(args.kv_cache_mib * 2**20))
    try:
        best, outputs = asyncio.run(run_orders(server, lines, folder, args.repeats))
    finally:
        server.__del__()
    for order, output in outputs.items():
        assert [line["custom_id"] for line in output] == [line.custom_id for line in lines], order
        assert all(line["error"] is None for line in output), order
    assert texts(outputs["input"]) == texts(outputs["prefix"]), "answers differ between orders"
    count = len(lines)
    ratio = best["input"] / best["prefix"]
    print(
        f"{count} lines ({args.groups} groups x {args.per_group}, {args.prefix_tokens}-token "
        f"prefixes, {args.max_tokens} tokens out, KV cache {args.kv_cache_mib:g} MiB, window "
        f"{DEFAULT_WINDOW}): input order {count / best['input']:.2f} lines/s, prefix order "
        f"{count / best['prefix']:.2f} lines/s: {ratio:.2f}x (goal >= {GOAL}x); output lines "
        "in input order, answers equal"
    )
    return 0 if ratio >= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
