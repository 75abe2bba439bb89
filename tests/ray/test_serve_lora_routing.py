"""LoRA adapters through the `openai` client on real Ray Serve: two replicas behind
`HybridPrefixRouter`, requests naming `model="<base>:<adapter>"`.

Two unrelated prompts of one adapter, then two of another: each adapter's second request lands
on the replica its first loaded it on (a router blind to adapters sends the second new
conversation to the other, idler replica, which then loads the adapter too), and greedy
outputs equal the offline `LLM`'s with the same `LoRARequest`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from ray import serve
from transformers import AutoModelForCausalLM

from cluster.llm import LLM
from cluster.openai_api.protocol import CompletionRequest
from cluster.serve import build_openai_app, deployment_name
from scheduler.lora import LoRARequest
from scheduler.request import SamplingParams
from tests.helpers.router_view import loaded_adapters, local_router, wait_until_heard
from tests.helpers.serve_app import deployed, save_tiny_served_model
from tests.helpers.tiny_lora import save_random_adapter

pytestmark = pytest.mark.ray
# Two replicas (a one-CPU rank bundle each) plus the ingress and the replicas' own share.
RAY_CPUS = 4

APP = "lora-routing"
MODEL = "tiny-lora"
ROUTER = "cluster.serve.routing:HybridPrefixRouter"
ENGINE = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_seqs": 8,
    "max_model_len": 128,
    "kv_cache_memory_bytes": 1 << 20,
    "distributed_executor_backend": "uni",
    "max_loras": 2,
}
ADAPTERS = ("one", "two")
MAX_TOKENS = 4


def _prompt(adapter: int, turn: int) -> str:
    """Twelve words, unrelated across adapters and turns (no shared prefix block)."""
    return " ".join(f"t{(50 * adapter + 23 * turn + 7 * i) % 230 + 20}" for i in range(12))


def _app_config(model_dir: Path, adapters: Path) -> dict[str, Any]:
    router = {"request_router_class": ROUTER, "request_routing_stats_period_s": 0.2}
    config = {
        "model_loading_config": {"model_id": MODEL, "model_source": str(model_dir)},
        "engine_kwargs": {**ENGINE, "device": "cpu"},
        "lora_config": {"dynamic_lora_loading_path": str(adapters)},
        "placement_group_config": {"bundles": [{"CPU": 0.25}]},
        "deployment_config": {
            "num_replicas": 2,
            "ray_actor_options": {"num_cpus": 0.1},
            "request_router_config": router,
        },
    }
    ingress = {"ray_actor_options": {"num_cpus": 0.1}}
    return {"llm_configs": [config], "ingress_deployment_config": ingress}


def _probed_router() -> Any:
    """This process's router of the deployment, made by a base-model request through a handle;
    it hears the replicas' stats as the ingress's router does."""
    handle: Any = serve.get_deployment_handle(deployment_name(MODEL), app_name=APP)
    request = CompletionRequest(model=MODEL, prompt="t5 t6", max_tokens=1, temperature=0)
    list(handle.options(stream=True).generate.remote(request, "probe", False))
    return local_router(handle)


def test_adapters_route_to_the_replica_that_loaded_them(ray_cluster: None, tmp_path: Path) -> None:
    model_dir = save_tiny_served_model(tmp_path / "base")
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir)
    for seed, name in enumerate(ADAPTERS, start=1):
        save_random_adapter(hf_model, tmp_path / "adapters" / name, seed=seed)
    app = build_openai_app(_app_config(model_dir, tmp_path / "adapters"))
    with deployed(app, APP) as address:
        client = openai.OpenAI(base_url=f"{address.base_url}/v1", api_key="unused")
        router = _probed_router()
        served: dict[tuple[int, int], str] = {}
        for adapter, name in enumerate(ADAPTERS):
            for turn in range(2):
                completion = client.completions.create(
                    model=f"{MODEL}:{name}",
                    prompt=_prompt(adapter, turn),
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                )
                served[adapter, turn] = completion.choices[0].text
                wait_until_heard(router, "the replicas' stats reach the routers")
        loaded = loaded_adapters(router)
        holders = {name: [k for k, names in loaded.items() if name in names] for name in ADAPTERS}
        assert all(len(keys) == 1 for keys in holders.values()), loaded

    llm = LLM(
        str(model_dir),
        **{k: v for k, v in ENGINE.items() if k != "max_loras"},
        enable_lora=True,
        max_loras=2,
    )
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        for (adapter, turn), text in served.items():
            name = ADAPTERS[adapter]
            lora = LoRARequest(name, adapter + 1, str(tmp_path / "adapters" / name))
            want = llm.generate([_prompt(adapter, turn)], greedy, lora_request=lora)
            assert text == want[0].outputs[0].text, (name, turn)
    finally:
        llm.shutdown()
