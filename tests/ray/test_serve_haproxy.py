"""Serve's HAProxy ingress (`hybridserve serve --ingress haproxy`) with the hybrid router kept.

A local Ray instance of its own, started with the environment the command sets for HAProxy:
HAProxy forwards HTTP straight to the ingress replica (Serve's direct ingress), whose
`HybridPrefixRouter` picks the model replica. The routing app and the multi-turn sessions are
`test_serve_hybrid_routing`'s (two replicas of a tiny sliding-window model), here behind an API
key: later turns come back to the replica that holds their session, each replica served
sessions of its own, and a request without the key is refused with 401 by the ingress; gRPC
goes through HAProxy as well (to the ingress replica's own gRPC port).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import psutil
import pytest
from ray import serve
from ray.serve.config import HTTPOptions, gRPCOptions

from cluster.cli.ingress_mode import LOCALHOST, set_mode_env
from cluster.cli.serve_apps import SERVICER, with_api_key
from cluster.serve import build_openai_app, deployment_name
from cluster.serve.grpc import llm_pb2, llm_pb2_grpc
from cluster.serve.hybrid_router import KV_EVENTS_STAT
from tests.helpers.ray_local import start_local_ray, stop_local_ray
from tests.helpers.router_view import local_router, replica_routing_stats
from tests.helpers.serve_app import free_port, shutdown_serve
from tests.ray.test_serve_hybrid_routing import (
    APP,
    MAX_TOKENS,
    MODEL,
    Routed,
    _app_config,
    _play_sessions,
    _save_model,
)

pytestmark = pytest.mark.ray
RAY_CPUS = 4
"""As the routing module: two replicas (a one-CPU rank bundle each), the ingress, their share."""
API_KEY = "sk-haproxy"


@dataclass
class KeyedRouted(Routed):
    """The routing app's chat, with the API key; its gRPC port."""

    grpc_port: int = 0

    def chat(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        url = f"{self.base_url}/v1/chat/completions"
        response = httpx.post(url, json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        return dict(response.json())


@pytest.fixture(scope="module")
def haproxy_ray() -> Iterator[None]:
    """A new local Ray instance in HAProxy mode; stopped after the module, its environment
    undone, so the next module starts the proxy mode's."""
    env: dict[str, str] = {}
    set_mode_env("haproxy", env)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    stop_local_ray()
    try:
        start_local_ray(RAY_CPUS)
        yield
    finally:
        stop_local_ray()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def routed(haproxy_ray: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedRouted]:
    model_dir = _save_model("gemma3", tmp_path_factory.mktemp("haproxy-routed"))
    port, grpc_port = free_port(), free_port()
    grpc_options = gRPCOptions(port=grpc_port, grpc_servicer_functions=[SERVICER])
    serve.start(http_options=HTTPOptions(host=LOCALHOST, port=port), grpc_options=grpc_options)
    try:  # serve.run returns once HAProxy has a healthy replica for the app
        app_args = with_api_key(_app_config(model_dir, "gemma3"), API_KEY)
        serve.run(build_openai_app(app_args), name=APP, route_prefix="/")
        yield KeyedRouted(f"http://{LOCALHOST}:{port}", model_dir, "gemma3", grpc_port)
    finally:
        shutdown_serve()


def _listeners(port: int) -> set[str]:
    """Names of this user's processes listening on `port`."""
    names = set()
    for process in psutil.process_iter(["name", "uids"]):
        try:
            if process.info["uids"].real != os.getuid():
                continue
            if any(
                c.laddr.port == port and c.status == psutil.CONN_LISTEN
                for c in process.net_connections("tcp")
            ):
                names.add(str(process.info["name"]))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return names


def test_haproxy_holds_the_http_port(routed: KeyedRouted) -> None:
    port = int(routed.base_url.rsplit(":", 1)[1])
    assert _listeners(port) == {"haproxy"}
    assert httpx.get(f"{routed.base_url}/-/routes", timeout=10).json() == {"/": APP}


def test_grpc_goes_through_haproxy(routed: KeyedRouted) -> None:
    assert _listeners(routed.grpc_port) == {"haproxy"}
    with grpc.insecure_channel(f"{LOCALHOST}:{routed.grpc_port}") as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        metadata = (("application", APP), ("authorization", f"Bearer {API_KEY}"))
        models = stub.ListModels(llm_pb2.ListModelsRequest(), metadata=metadata, timeout=60)
        assert [model.id for model in models.models] == [MODEL]
        request = llm_pb2.CompletionRequest(model=MODEL, prompt="t1 t2 t3", max_tokens=2)
        chunks = list(stub.CompletionStream(request, metadata=metadata, timeout=60))
        assert chunks


def test_a_request_without_the_api_key_is_refused(routed: KeyedRouted) -> None:
    body = {"model": MODEL, "prompt": "t1", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        url = f"{routed.base_url}/v1/completions"
        response = httpx.post(url, json=body, headers=headers, timeout=60)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_later_turns_return_to_the_replica_holding_the_session(routed: KeyedRouted) -> None:
    sessions = _play_sessions(routed)
    for turns in sessions:
        for previous, later in itertools.pairwise(turns):
            cached = later["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= previous["usage"]["prompt_tokens"] - 16, (previous, later)
    handle = serve.get_deployment_handle(deployment_name(MODEL), app_name=APP)
    replicas = list(local_router(handle).curr_replicas)
    assert len(replicas) == 2
    for replica in replicas:  # each one cached blocks: the sessions were spread over both
        assert replica_routing_stats(replica)[KV_EVENTS_STAT].next_seq > 0, replica
