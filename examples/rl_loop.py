"""A reinforcement-learning loop on a laptop: a trainer Ray actor and two rollout engines.

The trainer holds a tiny hybrid model (Qwen3.5 layout: gated DeltaNet layers and a full-attention
layer, random weights, fp32, transformers) and takes a few policy-gradient steps per round on the
engines' rollouts; after each round it pushes its weights to both engine replicas in place
(`WeightSender`: every rank fetches only its own shard from the trainer actor), under a new
weight version. Each round checks that the engines' logprobs of the sampled tokens equal the
trainer's own forward of the same sequences, within fp32 rounding; the prompts were cached by the
engines under the previous weights, and nothing stale is served.

    .venv/bin/python examples/rl_loop.py            # 3 rounds, 2 replicas
    .venv/bin/python examples/rl_loop.py --rounds 5 --tolerance 1e-4
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray
import torch
import transformers

from cluster import LLM, SamplingParams
from cluster.engine.weight_transfer import WeightSender, shapes_of

TINY_QWEN3_5 = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "intermediate_size": 96,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
PROMPTS = [[3, 14, 15, 92, 65, 35], [27, 18, 28, 18, 28, 45, 90], [1, 41, 42, 13, 56]]
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 128, "enable_prefix_caching": True}


def save_policy(folder: Path, seed: int = 0) -> None:
    """The initial policy: a tiny random Qwen3.5 text model saved as a checkpoint."""
    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(**TINY_QWEN3_5)
    model = transformers.Qwen3_5ForCausalLM(config).float()
    model.save_pretrained(folder)


@ray.remote(num_cpus=0)
class Trainer(WeightSender):
    """The policy being trained: forward logprobs, policy-gradient steps, weights sent."""

    def __init__(self, folder: str, learning_rate: float = 1e-2) -> None:
        torch.manual_seed(0)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=learning_rate)

    def shapes(self) -> dict[str, Any]:
        return shapes_of(self.model.state_dict())

    def token_logprobs(self, prompt: list[int], completion: list[int]) -> list[float]:
        """log p(completion[i] | prompt + completion[:i]) under the trainer's weights."""
        self.model.eval()
        with torch.no_grad():
            return self._logprobs(prompt, completion).tolist()

    def train(self, rollouts: list[tuple[list[int], list[int]]], steps: int = 2) -> float:
        """A few REINFORCE steps: reward = share of even token IDs in the completion."""
        self.model.train()
        loss_value = 0.0
        for _ in range(steps):
            self.optimizer.zero_grad()
            losses = []
            for prompt, completion in rollouts:
                reward = sum(token % 2 == 0 for token in completion) / max(len(completion), 1)
                losses.append(-(reward - 0.5) * self._logprobs(prompt, completion).sum())
            loss = torch.stack(losses).mean()
            loss.backward()
            self.optimizer.step()
            loss_value = float(loss)
        return loss_value

    def push(self, plans: list[dict[str, Any]]) -> Any:
        """Keep every rank's parts of the current weights; the handle the ranks fetch from."""
        return self.send_weights(self.model.state_dict(), plans)

    def _logprobs(self, prompt: list[int], completion: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + completion])
        logits = self.model(ids).logits[0, len(prompt) - 1 : -1].float()
        return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def rollouts(llm: LLM, seed: int) -> list[tuple[list[int], list[int], list[float]]]:
    """Sampled completions (temperature 1) with the engine's logprob of each sampled token."""
    params = SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, seed=seed)
    result = []
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False), strict=True):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        pairs = zip(tokens, completion.logprobs, strict=True)
        result.append((prompt, tokens, [entry[token].logprob for token, entry in pairs]))
    return result


def sync_weights(trainer: Any, engines: list[LLM], version: int) -> None:
    """Push the trainer's weights to every engine in place (one send serves every replica)."""
    plans = engines[0].weight_shard_plans(ray.get(trainer.shapes.remote()))
    handle = ray.get(trainer.push.remote(plans))
    for llm in engines:
        llm.start_weight_update()
        llm.update_weights({"shards": handle})
        llm.finish_weight_update(weight_version=version)
    ray.get(trainer.release_weights.remote())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max |logprob difference|")
    args = parser.parse_args()
    ray.init(num_cpus=max(2, args.replicas))
    folder = Path(tempfile.mkdtemp(prefix="rl-policy-"))
    save_policy(folder)
    trainer = Trainer.remote(str(folder))
    engines = [LLM(str(folder), address="auto", **ENGINE_ARGS) for _ in range(args.replicas)]
    worst = 0.0
    for round_index in range(args.rounds):
        for replica, llm in enumerate(engines):
            batch = rollouts(llm, seed=round_index * 100 + replica)
            for prompt, completion, engine_logprobs in batch:
                mine = ray.get(trainer.token_logprobs.remote(prompt, completion))
                diff = max(abs(a - b) for a, b in zip(engine_logprobs, mine, strict=True))
                worst = max(worst, diff)
                if diff > args.tolerance:
                    print(f"round {round_index} replica {replica}: logprobs differ by {diff:.2e}")
                    return 1
        loss = ray.get(trainer.train.remote([(p, c) for p, c, _ in batch]))
        sync_weights(trainer, engines, version=round_index + 1)
        versions = [llm.get_weight_version() for llm in engines]
        print(f"round {round_index}: loss {loss:+.4f}, weights now version {versions}")
    print(f"engine and trainer logprobs agree within {worst:.2e} over {args.rounds} rounds")
    for llm in engines:
        llm.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
