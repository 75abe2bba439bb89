"""The Serve app's pieces that need no Ray cluster: deployment options, request mapping, CLI."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from cluster.cli.serve import add_parser, applications
from cluster.config import LLMConfig, LLMServingArgs
from cluster.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from cluster.openai_api.sampling import UnsupportedFieldError, to_sampling_params
from cluster.serve import build_openai_app, deployment_name
from cluster.serve.builder import (
    ingress_deployment_options,
    llm_deployment_options,
    resource_summary,
)
from cluster.serve.llm_server import serving_engine_args
from cluster.serve.one_hop import OpenAiServer
from cluster.serve.routing import resolve_request_router
from scheduler.request import SamplingParams


def _config(**extra: object) -> LLMConfig:
    return LLMConfig.model_validate(
        {"model_loading_config": {"model_id": "org/model.v1", "model_source": "/m"}, **extra}
    )


def test_deployment_name_follows_ray_serve_llm() -> None:
    assert deployment_name("org/model.v1") == "LLMServer:org--model_v1"


def test_replica_resources_go_into_bundle_zero() -> None:
    config = _config(
        engine_kwargs={"tensor_parallel_size": 2},
        placement_group_config={"bundles": [{"GPU": 1}, {"GPU": 1}], "strategy": "STRICT_PACK"},
        deployment_config={"ray_actor_options": {"num_cpus": 2, "resources": {"head": 0.5}}},
    )
    options = llm_deployment_options(config)
    assert options["name"] == "LLMServer:org--model_v1"
    assert options["placement_group_bundles"] == [{"GPU": 1, "CPU": 2, "head": 0.5}, {"GPU": 1}]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"]["num_cpus"] == 0


def test_defaults_fit_a_two_cpu_node() -> None:
    """A CPU rank (1 CPU) + the replica (0.1) + the ingress (0.1) leave room on 2 CPUs."""
    options = llm_deployment_options(_config(engine_kwargs={"device": "cpu"}))
    assert options["placement_group_bundles"] == [{"CPU": pytest.approx(1.1)}]
    ingress = ingress_deployment_options({})
    assert ingress["ray_actor_options"] == {"num_cpus": 0.1}
    keyed = ingress_deployment_options({"ray_actor_options": {"runtime_env": {"env_vars": {}}}})
    assert keyed["ray_actor_options"]["num_cpus"] == 0.1
    assert ingress_deployment_options({"ray_actor_options": {"num_cpus": 2}})[
        "ray_actor_options"
    ] == {"num_cpus": 2}
    cpu_model = [_config(engine_kwargs={"device": "cpu"})]
    lines = resource_summary({"llm_configs": cpu_model, "topology": "two_hop"})
    assert lines == [
        "LLMServer:org--model_v1: each replica reserves a placement group [{CPU: 1.1}] (PACK)",
        "OpenAiIngress: each replica asks for {CPU: 0.1}",
    ]
    assert resource_summary({"llm_configs": cpu_model, "topology": "one_hop"}) == [
        "LLMServer:org--model_v1: each replica reserves a placement group [{CPU: 1.1}] (PACK);"
        " it serves the OpenAI routes itself (one hop)"
    ]


def test_deployment_config_passes_through() -> None:
    router = {
        "request_router_class": "ray.serve.llm.request_router.PrefixCacheAffinityRouter",
        "request_router_kwargs": {"imbalanced_threshold": 3},
    }
    config = _config(
        deployment_config={
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 3},
            "max_ongoing_requests": 7,
            "request_router_config": router,
        }
    )
    options = llm_deployment_options(config)
    # Ray Serve LLM's unlimited target_ongoing_requests stays under the user's settings
    want = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 1_000_000_000}
    assert options["autoscaling_config"] == want
    assert options["max_ongoing_requests"] == 7
    resolved = options["request_router_config"]
    assert resolved["request_router_kwargs"] == {"imbalanced_threshold": 3}
    module, _, name = resolved["request_router_class"].rpartition(".")
    assert name == "PrefixCacheAffinityRouter"
    router_cls = getattr(importlib.import_module(module), name)  # vLLM is not installed here
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )

    assert issubclass(router_cls, PrefixCacheAffinityRouter)


def test_other_routers_are_left_alone() -> None:
    config = {"request_router_class": "my.Router"}
    assert resolve_request_router(config) == config


def test_build_openai_app_validates_its_args() -> None:
    with pytest.raises(ValueError, match="llm_configs"):
        build_openai_app({"llm_configs": []})
    model = {"model_loading_config": {"model_id": "a", "model_source": "/m"}}
    with pytest.raises(ValueError, match="duplicate"):
        build_openai_app({"llm_configs": [model, model]})
    assert build_openai_app({"llm_configs": [model]}) is not None


def test_replica_defaults_to_the_ray_executor() -> None:
    assert serving_engine_args(_config()).distributed_executor_backend == "ray"
    uni = _config(engine_kwargs={"distributed_executor_backend": "uni"})
    assert serving_engine_args(uni).distributed_executor_backend == "uni"
    with pytest.raises(ValidationError, match="distributed_executor_backend"):
        _config(engine_kwargs={"distributed_executor_backend": "uni", "tensor_parallel_size": 2})


def test_openai_fields_map_to_sampling_params() -> None:
    request = CompletionRequest.model_validate(
        {"prompt": "x", "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "n": 2,
         "seed": 3, "logprobs": 2, "ignore_eos": True, "min_tokens": 1, "stop_token_ids": [4]}
    )  # fmt: skip
    assert to_sampling_params(request, max_tokens=9) == SamplingParams(
        n=2, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, max_tokens=9, min_tokens=1,
        logprobs=2, stop_token_ids=(4,), seed=3, ignore_eos=True,
    )  # fmt: skip
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3}
    )
    assert to_sampling_params(chat, max_tokens=2).logprobs == 3


def test_fields_the_engine_lacks_are_rejected_by_name() -> None:
    import dataclasses

    names = {f.name for f in dataclasses.fields(SamplingParams)}
    for field, value in (("presence_penalty", 0.5), ("stop", ["x"]), ("logit_bias", {"1": 2})):
        request = CompletionRequest.model_validate({"prompt": "x", field: value})
        if field in names:
            assert getattr(to_sampling_params(request, 4), field) is not None
        else:
            with pytest.raises(UnsupportedFieldError, match=field):
                to_sampling_params(request, 4)


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_command_builds_an_llm_config_from_flags() -> None:
    apps, options = applications(
        _serve_args(
            "--model", "/models/tiny", "--max-model-len", "64", "--no-enable-prefix-caching"
        )
    )
    assert options == {}
    config = apps[0]["args"]["llm_configs"][0]
    assert config["model_loading_config"] == {"model_id": "tiny", "model_source": "/models/tiny"}
    assert config["engine_kwargs"] == {"max_model_len": 64, "enable_prefix_caching": False}
    LLMConfig.model_validate(config)


def test_serve_command_reads_each_kind_of_config_file(tmp_path: Path) -> None:
    llm = {"model_loading_config": {"model_id": "m", "model_source": "/m"}}
    serve_config = {
        "http_options": {"host": "0.0.0.0", "port": 9999},
        "applications": [{"name": "x", "import_path": "cluster.serve:build_openai_app",
                          "args": {"llm_configs": [llm]}}],
    }  # fmt: skip
    for data, name in ((llm, "llm"), ({"llm_configs": [llm]}, "llm"), (serve_config, "x")):
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(data))
        apps, _ = applications(_serve_args("--config", str(path)))
        assert apps[0]["name"] == name
        assert apps[0]["args"]["llm_configs"] == [llm]


def test_one_hop_app_is_the_model_deployment_with_the_ingress_environment() -> None:
    model = {"model_loading_config": {"model_id": "a", "model_source": "/m"}}
    ingress = {"ray_actor_options": {"runtime_env": {"env_vars": {"KEY": "secret"}}}}
    args = {"llm_configs": [model], "ingress_deployment_config": ingress, "topology": "one_hop"}
    app = build_openai_app(args)
    deployment = app._bound_deployment  # type: ignore[attr-defined]
    assert deployment.name == deployment_name("a")
    assert issubclass(deployment.func_or_class, OpenAiServer)
    env = deployment.ray_actor_options["runtime_env"]["env_vars"]
    assert env == {"KEY": "secret"}
    two_hop = build_openai_app({**args, "topology": "two_hop"})
    assert two_hop._bound_deployment.name == "OpenAiIngress"  # type: ignore[attr-defined]


@pytest.mark.parametrize(("topology", "num_models", "one_hop"), [
    ("auto", 1, True), ("auto", 2, False), ("two_hop", 1, False), ("one_hop", 1, True),
])  # fmt: skip
def test_topology_choice(topology: str, num_models: int, one_hop: bool) -> None:
    models = [
        {"model_loading_config": {"model_id": f"m{i}", "model_source": "/m"}}
        for i in range(num_models)
    ]
    args = LLMServingArgs.model_validate({"llm_configs": models, "topology": topology})
    assert args.uses_one_hop is one_hop


def test_auto_keeps_two_hops_for_a_request_router() -> None:
    router = {"request_router_class": "ray.serve.llm.request_router.PrefixCacheAffinityRouter"}
    model = {
        "model_loading_config": {"model_id": "a", "model_source": "/m"},
        "deployment_config": {"request_router_config": router},
    }
    assert not LLMServingArgs.model_validate({"llm_configs": [model]}).uses_one_hop


@pytest.mark.parametrize(
    ("options", "one_hop"),
    [
        ({"num_replicas": 1}, True),
        ({"num_replicas": 2}, False),
        ({"num_replicas": "auto"}, False),
        ({"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}, False),
    ],
)
def test_auto_keeps_two_hops_for_several_replicas(options: dict, one_hop: bool) -> None:
    """Serve's proxy prefers replicas on its own node: only the ingress spreads requests."""
    model = {
        "model_loading_config": {"model_id": "a", "model_source": "/m"},
        "deployment_config": options,
    }
    assert LLMServingArgs.model_validate({"llm_configs": [model]}).uses_one_hop is one_hop


def test_one_hop_refuses_several_models() -> None:
    models = [{"model_loading_config": {"model_id": m, "model_source": "/m"}} for m in "ab"]
    with pytest.raises(ValueError, match="one_hop serves one model"):
        build_openai_app({"llm_configs": models, "topology": "one_hop"})
