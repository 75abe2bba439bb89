"""`build_pd_openai_app` and its config forms: Ray Serve LLM's argument shape, the `hybridserve
serve` config file with prefill_config / decode_config, and the checks on both sides."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.cli.serve import add_parser, applications
from cluster.cli.serve_apps import PD_IMPORT_PATH, builder
from cluster.config import LLMConfig
from cluster.config.serving_args import validate_config_file
from cluster.serve import build_pd_openai_app
from cluster.serve.ingress import OpenAiIngress
from cluster.serve.pd_server import PDDecodeServer, PDPrefillServer

SIDE = {"model_loading_config": {"model_id": "m", "model_source": "/m"}}


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def _bound(app: Any) -> Any:
    """The deployment an application binds, with its constructor arguments."""
    return app._bound_deployment


def test_build_pd_openai_app_takes_ray_serve_llm_arguments() -> None:
    """The ingress routes the decode config's model_id to the decode deployment, which is bound
    to the prefill deployment and the timeout; each side runs its own config and options."""
    prefill_side = {**SIDE, "engine_kwargs": {"max_num_seqs": 8},
                    "deployment_config": {"num_replicas": 2}}  # fmt: skip
    decode_side = {**SIDE, "engine_kwargs": {"max_num_seqs": 32}}
    app = build_pd_openai_app(
        {"prefill_config": prefill_side, "decode_config": decode_side, "kv_transfer_timeout_s": 12}
    )
    ingress = _bound(app)
    assert issubclass(ingress.func_or_class, OpenAiIngress)
    (servers,) = ingress.init_args
    assert list(servers) == ["m"]
    decode = _bound(servers["m"])
    assert (decode.name, decode.func_or_class) == ("Decode:LLMServer:m", PDDecodeServer)
    decode_config, prefill_app, timeout_s = decode.init_args
    assert timeout_s == 12
    prefill = _bound(prefill_app)
    assert (prefill.name, prefill.func_or_class) == ("Prefill:LLMServer:m", PDPrefillServer)
    (prefill_config,) = prefill.init_args
    assert LLMConfig.model_validate(prefill_config).engine_kwargs["max_num_seqs"] == 8
    assert LLMConfig.model_validate(decode_config).engine_kwargs["max_num_seqs"] == 32
    assert (prefill.num_replicas, decode.num_replicas) == (2, 1)
    assert builder(PD_IMPORT_PATH) is build_pd_openai_app


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"decode_config": SIDE}, "prefill_config"),
        (
            {"prefill_config": SIDE, "decode_config": SIDE, "kv_transfer_timeout_s": 0},
            "kv_transfer_timeout_s",
        ),
        (
            {
                "prefill_config": SIDE,
                "decode_config": {"model_loading_config": {"model_id": "m", "model_source": "/x"}},
            },
            "same model",
        ),
        (
            {
                "prefill_config": {**SIDE, "engine_kwargs": {"enable_prefix_caching": False}},
                "decode_config": SIDE,
            },
            "enable_prefix_caching",
        ),
        ({"prefill_config": SIDE, "decode_config": SIDE, "proxy": {}}, "proxy"),
    ],
)
def test_bad_pd_arguments_name_the_key(args: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_pd_openai_app(args)


def test_serve_command_deploys_a_pd_config_file(tmp_path: Path) -> None:
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump({"prefill_config": SIDE, "decode_config": SIDE}))
    (app,), _ = applications(_serve_args("--config", str(path)))
    assert app["import_path"] == PD_IMPORT_PATH
    assert app["args"]["decode_config"] == SIDE
    assert validate_config_file(path) == ["m"]
