"""gRPC through Serve's gRPC proxy, the prefix-aware router, and drain on shutdown (one app).

The app runs its model deployment with Ray's `PrefixCacheAffinityRouter` named in
`request_router_config`; the last test shuts Serve down with a request in flight.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from ray import serve
from ray.serve.config import HTTPOptions, gRPCOptions

from cluster.llm import LLM
from cluster.serve import build_openai_app
from cluster.serve.grpc import llm_pb2, llm_pb2_grpc
from scheduler.request import SamplingParams
from tests.helpers.ray_local import NODE_IP
from tests.helpers.serve_app import free_port, llm_config, save_tiny_served_model

pytestmark = pytest.mark.ray

APP = "grpc-app"
SERVICER = "cluster.serve.grpc.llm_pb2_grpc.add_LLMServiceServicer_to_server"
ROUTER = "ray.serve.llm.request_router.PrefixCacheAffinityRouter"
METADATA = (("application", APP),)


@dataclass
class Served:
    http_url: str
    stub: llm_pb2_grpc.LLMServiceStub
    model_dir: Path


@pytest.fixture(scope="module")
def served(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Served:
    model_dir = save_tiny_served_model(tmp_path_factory.mktemp("grpc-model"))
    http_port, grpc_port = free_port(), free_port()
    serve.start(
        http_options=HTTPOptions(host=NODE_IP, port=http_port),
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[SERVICER]),
    )
    config = llm_config(model_dir)
    config["deployment_config"].update(
        {
            "request_router_config": {
                "request_router_class": ROUTER,
                "request_router_kwargs": {"imbalanced_threshold": 4},
            },
            "graceful_shutdown_timeout_s": 30,
            "graceful_shutdown_wait_loop_s": 0.2,
        }
    )
    serve.run(build_openai_app({"llm_configs": [config]}), name=APP, route_prefix="/")
    channel = grpc.insecure_channel(f"{NODE_IP}:{grpc_port}")
    yield Served(f"http://{NODE_IP}:{http_port}", llm_pb2_grpc.LLMServiceStub(channel), model_dir)
    channel.close()
    serve.shutdown()


def test_grpc_stream_matches_llm_generate(served: Served) -> None:
    llm = LLM(
        str(served.model_dir),
        block_size=4,
        kv_cache_memory_bytes=8 * 1024 * 1024,
        distributed_executor_backend="uni",
    )
    try:
        want = llm.generate(["t3 t4 t5"], SamplingParams(temperature=0, max_tokens=6))[0]
    finally:
        llm.shutdown()
    request = llm_pb2.CompletionRequest(
        model="tiny",
        prompt="t3 t4 t5",
        max_tokens=6,
        temperature=0,
        stream_options=llm_pb2.StreamOptions(include_usage=True),
    )
    chunks = list(served.stub.CompletionStream(request, metadata=METADATA))
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert len(texts) >= 2, "tokens arrive as separate messages"
    assert "".join(texts) == want.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 6
    unary = served.stub.Completion(request, metadata=METADATA)
    assert unary.choices[0].text == want.outputs[0].text
    assert unary.choices[0].finish_reason == "length"


def test_grpc_chat_and_models(served: Served) -> None:
    request = llm_pb2.ChatCompletionRequest(
        model="tiny",
        messages=[llm_pb2.ChatMessage(role="user", content="t8 t9")],
        max_tokens=3,
        temperature=0,
    )
    whole = served.stub.ChatCompletion(request, metadata=METADATA)
    streamed = list(served.stub.ChatCompletionStream(request, metadata=METADATA))
    assert whole.choices[0].message.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in streamed) == whole.choices[0].message.content
    models = served.stub.ListModels(llm_pb2.ListModelsRequest(), metadata=METADATA)
    assert [m.id for m in models.models] == ["tiny"]


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"max_tokens": -1}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": " ".join(["t1"] * 1100)}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"model": "missing"}, grpc.StatusCode.NOT_FOUND),
    ],
)
def test_grpc_errors_are_status_codes(
    served: Served, fields: dict[str, Any], code: grpc.StatusCode
) -> None:
    request = llm_pb2.CompletionRequest(**{"model": "tiny", "prompt": "t1", **fields})
    for call in (
        served.stub.Completion,
        lambda r, **kw: list(served.stub.CompletionStream(r, **kw)),
    ):
        with pytest.raises(grpc.RpcError) as error:
            call(request, metadata=METADATA)
        assert error.value.code() == code
        assert error.value.details()


def test_prefix_router_serves_shared_prefixes(served: Served) -> None:
    prompt = "t1 t2 t3 t4 t5 t6 t7 t8 t9 t10 t11 t12"
    bodies = [{"model": "tiny", "prompt": f"{prompt} t{i}", "max_tokens": 2} for i in range(4)]
    responses = [
        httpx.post(served.http_url + "/v1/completions", json=b, timeout=30) for b in bodies
    ]
    assert [r.status_code for r in responses] == [200] * 4
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses]
    assert cached[0] == 0
    assert min(cached[1:]) >= 8


def test_shutdown_drains_in_flight_requests(served: Served) -> None:
    body = {"model": "tiny", "prompt": "t1 t2", "max_tokens": 300, "ignore_eos": True}
    result: dict[str, Any] = {}

    def request() -> None:
        response = httpx.post(served.http_url + "/v1/completions", json=body, timeout=120)
        result["status"] = response.status_code
        result["body"] = response.json()

    thread = threading.Thread(target=request)
    thread.start()
    handle = serve.get_deployment_handle("LLMServer:tiny", app_name=APP)
    deadline = time.monotonic() + 10
    while not handle.stats.remote().result()["num_running"]:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    serve.delete(APP)  # waits for the replicas to drain and stop
    thread.join(timeout=60)
    assert result["status"] == 200, result
    choice = result["body"]["choices"][0]
    assert choice["finish_reason"] == "length"
    assert result["body"]["usage"]["completion_tokens"] == 300
