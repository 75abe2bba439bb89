"""`deployment_config.autoscaling_config`: bad settings fail when the app is built, in one line
naming the key; good ones reach Serve with Ray Serve LLM's defaults merged in."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from cluster.config import LLMConfig, LLMServingArgs
from cluster.config.autoscaling import HYBRID_POLICY
from cluster.serve import build_openai_app
from cluster.serve.builder import llm_deployment_options
from tests.helpers.readme import README, code_block

MODEL = {"model_loading_config": {"model_id": "a", "model_source": "/m"}}
WHERE = "llm_configs.0.deployment_config: autoscaling_config"
UNLIMITED = 1_000_000_000


def _hybrid(**kwargs: Any) -> dict[str, Any]:
    return {"policy": {"policy_function": HYBRID_POLICY, "policy_kwargs": kwargs}}


@pytest.mark.parametrize(
    ("autoscaling", "message"),
    [
        (
            {"min_replicas": 3, "max_replicas": 2},
            ": max_replicas (2) must be greater than or equal to min_replicas (3)",
        ),
        (
            {"upscale_delay_s": -1},
            ".upscale_delay_s: Input should be greater than or equal to 0, got -1",
        ),
        (
            {"downscale_delay_s": -5},
            ".downscale_delay_s: Input should be greater than or equal to 0, got -5",
        ),
        (
            _hybrid(metrics=["kv_pressure", "gpu_util"]),
            ".policy.policy_kwargs.metrics: unknown metric 'gpu_util' "
            "(valid: kv_pressure, queue_len, ttft)",
        ),
        (
            _hybrid(metrics=[]),
            ".policy.policy_kwargs.metrics: name at least one signal "
            "(kv_pressure, queue_len, ttft)",
        ),
        (
            _hybrid(target_kv_pressure=1.5),
            ".policy.policy_kwargs.target_kv_pressure: must be in (0, 1] (a fraction of the pool), "
            "got 1.5",
        ),
        (
            _hybrid(target_kv_pressure=0.0),
            ".policy.policy_kwargs.target_kv_pressure: must be in (0, 1] (a fraction of the pool), "
            "got 0.0",
        ),
        (
            _hybrid(target_queue=3),
            ".policy.policy_kwargs: unknown policy setting 'target_queue' "
            "(did you mean 'target_queue_len'?)",
        ),
        (
            _hybrid(target_ttft_s=0),
            ".policy.policy_kwargs.target_ttft_s: Input should be greater than 0, got 0",
        ),
        (
            {"policy": {"policy_function": "cluster.serve.builder:no_such_policy"}},
            ".policy.policy_function: cannot import 'cluster.serve.builder:no_such_policy' "
            "(module 'cluster.serve.builder' has no attribute 'no_such_policy')",
        ),
    ],
)
def test_bad_settings_fail_at_build_in_one_line(autoscaling: dict[str, Any], message: str) -> None:
    config = {**MODEL, "deployment_config": {"autoscaling_config": autoscaling}}
    with pytest.raises(ValueError, match="autoscaling_config") as error:
        build_openai_app({"llm_configs": [config]})
    assert str(error.value) == WHERE + message


def _options(deployment_config: dict[str, Any]) -> dict[str, Any]:
    return llm_deployment_options(
        LLMConfig.model_validate({**MODEL, "deployment_config": deployment_config})
    )


def test_ray_serve_llm_defaults_are_merged_under_the_users_settings() -> None:
    assert _options({})["autoscaling_config"] == {"target_ongoing_requests": UNLIMITED}
    users = {"min_replicas": 1, "initial_replicas": 2, "max_replicas": 4, **_hybrid()}
    options = _options({"autoscaling_config": users})
    assert options["autoscaling_config"] == {"target_ongoing_requests": UNLIMITED, **users}
    assert "num_replicas" not in options


@pytest.mark.parametrize("num_replicas", [2, "auto"])
def test_num_replicas_drops_the_autoscaling_default(num_replicas: int | str) -> None:
    options = _options({"num_replicas": num_replicas})
    assert options["num_replicas"] == num_replicas
    assert "autoscaling_config" not in options


def test_auto_keeps_the_users_autoscaling_settings() -> None:
    options = _options({"num_replicas": "auto", "autoscaling_config": {"max_replicas": 6}})
    assert options["num_replicas"] == "auto"
    assert options["autoscaling_config"] == {"max_replicas": 6}


def test_auto_bounds_are_checked_over_serves_auto_defaults() -> None:
    """Under `auto` Serve's max_replicas is 100, so a minimum of 5 alone is fine."""
    _options({"num_replicas": "auto", "autoscaling_config": {"min_replicas": 5}})
    with pytest.raises(ValueError, match=r"max_replicas \(1\) must be greater"):
        _options({"autoscaling_config": {"min_replicas": 5}})


def test_the_documented_configs_are_valid() -> None:
    """The README's deployment_config and the autoscaling page's config file."""
    readme = yaml.safe_load(code_block("hybrid_autoscaling_policy", "yaml", README))
    _options(readme["deployment_config"])
    page = yaml.safe_load(code_block("hybrid_autoscaling_policy", "yaml", "docs/autoscaling.md"))
    (config,) = LLMServingArgs.model_validate(page).llm_configs
    assert config.deployment_config["autoscaling_config"]["policy"]["policy_function"] == (
        HYBRID_POLICY
    )
