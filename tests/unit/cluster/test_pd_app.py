"""`build_pd_openai_app` and its config forms: Ray Serve LLM's argument shape, the `hybridserve
serve` config file with prefill_config / decode_config, and the checks on both sides."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from cluster.cli.serve import add_parser, applications
from cluster.cli.serve_apps import PD_IMPORT_PATH, builder
from cluster.config.serving_args import validate_config_file
from cluster.serve import build_pd_openai_app

SIDE = {"model_loading_config": {"model_id": "m", "model_source": "/m"}}


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_build_pd_openai_app_takes_ray_serve_llm_arguments() -> None:
    app = build_pd_openai_app({"prefill_config": SIDE, "decode_config": SIDE})
    assert app is not None
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
