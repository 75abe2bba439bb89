"""Structured outputs on CPU: compile time per schema and per-step mask cost, for xgrammar and
llguidance in the same run, against a decode step of the embedded default model (SmolLM2-135M,
vocabulary 49,152).

Per step the engine fills one bitmask row per constrained request (`fill`: the backend's batch
call in its own threads, plus the copy into the step's message) and rank 0 unpacks and applies
it to the logits (`apply`). Rows are spread over several schemas and grammar states: each
matcher first takes a seeded random walk of 0-40 allowed tokens. The decode step is measured
with the default model in the offline `LLM`'s engine at the same batch sizes: the median time of
`--steps` engine steps once every request is decoding (greedy, `ignore_eos`, unconstrained).
The goal: fill + apply <= 5 % of a decode step at batch 256.

    .venv/bin/python benchmarks/bench_structured.py [--batches 1 32 256] [--steps 4]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from typing import Any

import torch

from cluster import LLM, SamplingParams
from cluster.engine.request import EngineRequest
from cluster.engine.structured.backends import GrammarBackend, Matcher, make_backend
from scheduler.output import GrammarBitmask
from scheduler.structured_outputs import StructuredOutputsParams
from worker.default_model import ensure_default_model
from worker.grammar_mask import GrammarMask, apply_grammar_mask

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "format": "email"},
        },
        "required": ["name", "age"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"},
                        "quantity": {"type": "integer", "minimum": 1},
                        "price": {"type": "number"},
                    },
                    "required": ["sku", "quantity", "price"],
                },
            },
            "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        },
        "required": ["id", "items", "status"],
    },
    "tool_calls": {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"enum": [f"tool_{i}"]},
                        "parameters": {
                            "type": "object",
                            "properties": {
                                "query": {"type": "string"},
                                "limit": {"type": "integer"},
                            },
                            "required": ["query"],
                        },
                    },
                    "required": ["name", "parameters"],
                }
                for i in range(8)
            ]
        },
    },
    "wide_40_fields": {
        "type": "object",
        "properties": {
            f"field_{i}": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}][i % 3]
            for i in range(40)
        },
        "required": [f"field_{i}" for i in range(0, 40, 2)],
    },
}


def compile_ms(backend: GrammarBackend, schema: dict[str, Any], repeats: int) -> float:
    """Median ms of parse + compile of `schema` (no cache)."""
    params = StructuredOutputsParams(json=schema)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.matcher(backend.compile(backend.parse(params)))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def allowed_tokens(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    words = bitmask[row].tolist()
    return [t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1]


def walked_matchers(
    backend: GrammarBackend, batch: int, vocab_size: int, eos: int, seed: int
) -> list[Matcher]:
    """`batch` matchers over the schemas, each advanced by a random walk of allowed tokens."""
    rng = random.Random(seed)
    compiled = [
        backend.compile(backend.parse(StructuredOutputsParams(json=schema)))
        for schema in SCHEMAS.values()
    ]
    scratch = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
    matchers = []
    for row in range(batch):
        matcher = backend.matcher(compiled[row % len(compiled)])
        for _ in range(rng.randint(0, 40)):
            backend.fill_rows([matcher], [0], scratch)
            choices = [t for t in allowed_tokens(scratch, 0, vocab_size) if t != eos]
            if not choices:
                break
            matcher.accept(rng.choice(choices))
        matchers.append(matcher)
    return matchers


def mask_ms(
    backend: GrammarBackend, matchers: list[Matcher], vocab_size: int, repeats: int
) -> tuple[float, float]:
    """Median ms per step of (fill + copy to the message, unpack + apply to fp32 logits)."""
    batch = len(matchers)
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros((batch, words), dtype=torch.int32)
    logits = torch.randn(batch, vocab_size)
    req_ids = [str(row) for row in range(batch)]
    fills, applies = [], []
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        start = time.perf_counter()
        backend.fill_rows(matchers, list(range(batch)), bitmask)
        message = GrammarBitmask(tuple(req_ids), words, bitmask.numpy().tobytes())
        middle = time.perf_counter()
        mask = GrammarMask.build(message, req_ids, torch.device("cpu"))
        assert mask is not None
        apply_grammar_mask(logits, mask)
        end = time.perf_counter()
        fills.append(middle - start)
        applies.append(end - middle)
    return 1e3 * statistics.median(fills[1:]), 1e3 * statistics.median(applies[1:])


def decode_step_ms(llm: LLM, batch: int, steps: int) -> float:
    """Median ms of an engine step once `batch` requests are all decoding (prefill excluded)."""
    core = llm.client.core  # type: ignore[attr-defined]
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for index in range(batch):
        ids = tuple(tokenizer(f"Item {index}: write a short JSON record.").input_ids)
        core.add_request(EngineRequest(f"decode-{batch}-{index}", ids, params))
    for _ in range(3):  # prefill (one step at these sizes) and the first decode
        core.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    core.abort([f"decode-{batch}-{index}" for index in range(batch)])
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from transformers import AutoTokenizer

    model_dir = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = 49152
    eos = tokenizer.eos_token_id
    backends = {
        name: make_backend(name, tokenizer, vocab_size, [eos]) for name in ("xgrammar", "guidance")
    }
    print("compile ms per schema (parse + compile + first matcher, median of 3)")
    print("| schema | " + " | ".join(backends) + " |")
    print("|---|" + "---|" * len(backends))
    for name, schema in SCHEMAS.items():
        cells = [f"{compile_ms(b, schema, 3):.1f}" for b in backends.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    llm = LLM(str(model_dir), max_num_seqs=max(args.batches), max_model_len=256)
    print("\nper-step mask cost vs a decode step of the default model")
    print("| batch | decode step ms | backend | fill ms | apply ms | mask % of step |")
    print("|---|---|---|---|---|---|")
    for batch in args.batches:
        step = decode_step_ms(llm, batch, args.steps)
        for name, backend in backends.items():
            matchers = walked_matchers(backend, batch, vocab_size, eos, seed=batch)
            fill, apply = mask_ms(backend, matchers, vocab_size, args.repeats)
            share = 100 * (fill + apply) / step
            print(f"| {batch} | {step:.1f} | {name} | {fill:.2f} | {apply:.2f} | {share:.1f} |")
    llm.shutdown()


if __name__ == "__main__":
    main()
