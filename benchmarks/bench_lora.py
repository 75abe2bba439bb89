"""Multi-LoRA decoding cost: output tok/s with 0, 1, 4 and 16 distinct adapters in the batch,
against the base model (an engine without LoRA) in the same run; and adapter load time.

The model is the embedded default (SmolLM2-135M); adapters are random rank-`--rank` PEFT folders
on every projection (q/k/v/o, gate/up/down), written here. Each setting runs `--concurrency`
requests at once (greedy, EOS ignored, `--max-tokens` each), adapters assigned round robin;
settings alternate over `--repeats` runs and each keeps its best. Ratios are against the base.

    .venv/bin/python benchmarks/bench_lora.py [--concurrency 16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import LLM, LoRARequest, SamplingParams
from worker.default_model import ensure_default_model

PROJECTIONS = {
    "self_attn.q_proj": ("hidden", "q"),
    "self_attn.k_proj": ("hidden", "kv"),
    "self_attn.v_proj": ("hidden", "kv"),
    "self_attn.o_proj": ("q", "hidden"),
    "mlp.gate_proj": ("hidden", "inner"),
    "mlp.up_proj": ("hidden", "inner"),
    "mlp.down_proj": ("inner", "hidden"),
}


def write_adapter(model: Path, folder: Path, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter of the Llama-family model in `model` on every projection."""
    config = json.loads((model / "config.json").read_text())
    head = config["hidden_size"] // config["num_attention_heads"]
    sizes = {
        "hidden": config["hidden_size"],
        "q": config["num_attention_heads"] * head,
        "kv": config["num_key_value_heads"] * head,
        "inner": config["intermediate_size"],
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in PROJECTIONS.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            a = torch.randn(rank, sizes[fan_in], generator=generator) * 0.01
            tensors[f"{key}.lora_A.weight"] = a
            b = torch.randn(sizes[fan_out], rank, generator=generator) * 0.01
            tensors[f"{key}.lora_B.weight"] = b
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    peft_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": sorted({m.rpartition(".")[2] for m in PROJECTIONS}),
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(peft_config))


def run(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None], tokens: int) -> float:
    """Output tok/s of one batch of `prompts` (all queued at once)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(r.outputs[0].token_ids) for r in results) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    model = ensure_default_model()
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    adapters = []
    for index in range(16):
        write_adapter(model, root / f"a{index}", args.rank, seed=index)
        adapters.append(LoRARequest(f"a{index}", index + 1, str(root / f"a{index}")))
    prompts = [
        [(97 * i + 13 * j + 5) % 40000 + 100 for j in range(args.prompt_len)]
        for i in range(args.concurrency)
    ]
    engine = {"max_num_seqs": args.concurrency, "enable_prefix_caching": False, "seed": 0}
    base = LLM(str(model), **engine)
    lora = LLM(str(model), enable_lora=True, max_loras=16, max_lora_rank=args.rank, **engine)
    load_start = time.perf_counter()
    lora.generate([prompts[0]], SamplingParams(max_tokens=1), lora_request=adapters[0])
    first_request_s = time.perf_counter() - load_start
    settings: dict[str, tuple[LLM, list[LoRARequest | None]]] = {"base": (base, [None] * 16)}
    for count in (0, 1, 4, 16):
        chosen = [adapters[i % count] if count else None for i in range(args.concurrency)]
        settings[f"{count} adapters"] = (lora, chosen)
    for llm in (base, lora):  # warm up both engines (and load every adapter once)
        run(llm, prompts, [None] * args.concurrency, 2)
    run(lora, prompts, settings["16 adapters"][1], 2)
    print(f"concurrency {args.concurrency}, {args.max_tokens} output tokens, rank {args.rank}")
    best = dict.fromkeys(settings, 0.0)
    for repeat in range(args.repeats):
        for name, (llm, loras) in settings.items():
            rate = run(llm, prompts, loras[: args.concurrency], args.max_tokens)
            best[name] = max(best[name], rate)
            print(f"  run {repeat}: {name:>12} {rate:8.1f} output tok/s", flush=True)
    for name, rate in best.items():
        print(f"{name:>12}: {rate:8.1f} output tok/s   {rate / best['base']:.3f} x base")
    loads = lora.client.core.lora_load_seconds  # type: ignore[attr-defined]
    print(
        f"adapter read+check: median {sorted(loads.values())[len(loads) // 2] * 1e3:.0f} ms "
        f"over {len(loads)} adapters; first request with a new adapter {first_request_s:.2f} s"
    )


if __name__ == "__main__":
    main()
