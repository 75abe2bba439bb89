"""The case of the KV transfer tests between engine actors: a tiny Mamba-2 hybrid's engine
settings, a prompt of 15 full blocks and a token, and a request's tokens through an actor."""

from __future__ import annotations

import time

from cluster.engine.client import collect
from cluster.engine.ray_client import RayEngineClient
from cluster.engine.request import EngineRequest
from scheduler.request import SamplingParams

ENGINE = {"block_size": 4, "max_model_len": 128, "max_num_batched_tokens": 64}
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(61)]
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def run(client: RayEngineClient, prompt: list[int], params: SamplingParams) -> list[int]:
    """The tokens of one request of `prompt` through the engine actor behind `client`."""
    request = EngineRequest(f"r{time.monotonic_ns()}", tuple(prompt), params)
    return list(collect(client.add_request(request)).outputs[0].token_ids)


def prefill_all_but_last(client: RayEngineClient) -> None:
    """Cache the prompt's full blocks on the engine (all of it but the last token)."""
    run(client, PROMPT[:-1], SamplingParams(temperature=0, max_tokens=1))
