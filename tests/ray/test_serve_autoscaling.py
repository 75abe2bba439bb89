"""The hybrid autoscaling policy on real Ray Serve: streamed chats through the `openai` client
queue up in the one replica's scheduler, the policy scales the model deployment 1 -> 2 on that
queue (the controller's log names the signal), and back to 1 once the load is gone. Every
streamed answer, before, during and after the scaling, is complete and equals the greedy
answer of the offline `LLM` on the same model.

Short delays and look-back keep it quick: the engine admits two requests at a time, so eight
concurrent chats leave about six waiting against a target of one per replica.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import ray
from ray import serve

from cluster.config.autoscaling import HYBRID_POLICY
from cluster.llm import LLM
from cluster.serve import build_openai_app, deployment_name
from scheduler.request import SamplingParams
from tests.helpers.serve_app import deployed, save_tiny_served_model
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.ray

APP = "autoscaling"
MODEL = "tiny-autoscaled"
ENGINE = {
    "dtype": "float32",
    "block_size": 4,
    "kv_cache_memory_bytes": 8 * 1024 * 1024,
    "max_num_seqs": 2,
    "device": "cpu",
    "distributed_executor_backend": "uni",
}
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "upscale_delay_s": 1.0,
    "downscale_delay_s": 2.0,
    "look_back_period_s": 1.0,
    "metrics_interval_s": 0.25,
    "policy": {
        "policy_function": HYBRID_POLICY,
        "policy_kwargs": {"target_queue_len": 1, "target_ttft_s": 30.0},
    },
}
NUM_CLIENTS = 8
MAX_TOKENS = 16
PROMPTS = [" ".join(f"t{(11 * n + 5 * i) % 200 + 20}" for i in range(8)) for n in range(6)]


def _app_config(model_dir: Path) -> dict[str, Any]:
    """The model autoscaled between one and two replicas, each a tenth of a CPU plus a
    quarter for its engine (two fit the default CPUs beside the ingress)."""
    config = {
        "model_loading_config": {"model_id": MODEL, "model_source": str(model_dir)},
        "engine_kwargs": ENGINE,
        "placement_group_config": {"bundles": [{"CPU": 0.25}]},
        "deployment_config": {
            "autoscaling_config": AUTOSCALING,
            "ray_actor_options": {"num_cpus": 0.1},
            "health_check_period_s": 1,
        },
    }
    return {"llm_configs": [config], "ingress_deployment_config": {}}


@dataclass(frozen=True)
class Answer:
    prompt: str
    text: str
    finish_reason: str | None


def _stream_chat(client: openai.OpenAI, prompt: str) -> Answer:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    parts, finish_reason = [], None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish_reason = choice.finish_reason or finish_reason
    return Answer(prompt, "".join(parts), finish_reason)


class Load:
    """`NUM_CLIENTS` threads streaming chats back to back until stopped."""

    def __init__(self, base_url: str) -> None:
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=120)
        self.answers: list[Answer] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(NUM_CLIENTS)
        ]

    def _run(self, client_index: int) -> None:
        turn = 0
        while not self._stop.is_set():
            prompt = PROMPTS[(client_index + turn) % len(PROMPTS)]
            try:
                self.answers.append(_stream_chat(self.client, prompt))
            except Exception as error:  # reported by the test, with the answers
                self.errors.append(error)
            turn += 1

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)


def _running_replicas() -> int:
    status = serve.status().applications[APP].deployments[deployment_name(MODEL)]
    return int(status.replica_states.get("RUNNING", 0))


def _replica_report() -> dict[str, float]:
    """What the (one) replica reports to the autoscaler now."""
    handle = serve.get_deployment_handle(deployment_name(MODEL), app_name=APP)
    return dict(handle.record_autoscaling_stats.remote().result())


def _controller_log() -> str:
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path()) / "serve"
    return "".join(path.read_text() for path in logs.glob("controller_*.log"))


@dataclass(frozen=True)
class Served:
    model_dir: Path
    base_url: str


@pytest.fixture(scope="module")
def served(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir = save_tiny_served_model(tmp_path_factory.mktemp("autoscaled"))
    with deployed(build_openai_app(_app_config(model_dir)), APP) as address:
        yield Served(model_dir, address.base_url)


def _greedy_answers(model_dir: Path) -> dict[str, str]:
    engine = {k: v for k, v in ENGINE.items() if k not in ("device", "max_num_seqs")}
    llm = LLM(str(model_dir), **engine)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        return {
            prompt: llm.chat([{"role": "user", "content": prompt}], greedy)[0].outputs[0].text
            for prompt in PROMPTS
        }
    finally:
        llm.shutdown()


def test_scales_up_under_load_and_down_when_idle(served: Served) -> None:
    assert _running_replicas() == 1
    with Load(served.base_url) as load:
        wait_until(lambda: load.answers, "a first answer")
        report = _replica_report()
        wait_until(lambda: _running_replicas() == 2, "a second replica under load", 60)
        served_before = len(load.answers)
        wait_until(lambda: len(load.answers) >= served_before + NUM_CLIENTS, "answers on two")
    wait_until(lambda: _running_replicas() == 1, "back to one replica when idle", 30)
    assert "replicas 1 -> 2, driven by queue_len" in _controller_log()
    assert load.errors == []
    assert set(report) == {"kv_pressure:0:full_attention", "num_waiting", "ttft_p90_s"}
    assert report["ttft_p90_s"] > 0
    want = _greedy_answers(served.model_dir)
    for answer in load.answers:
        assert answer.finish_reason in ("length", "stop"), answer
        assert answer.text == want[answer.prompt], answer
