"""Serving config: LLMConfig / LLMServingArgs loading, error messages, `hybridserve config`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from cluster.cli import main
from cluster.config import (
    API_KEY_ENV,
    PVC_MOUNT_ROOT,
    LLMConfig,
    LLMServingArgs,
    api_key_from_env,
    format_validation_error,
    validate_engine_kwargs,
)
from cluster.config.engine_args import EngineArgs

ROOT = Path(__file__).resolve().parents[3]


def _llm(model_id: str = "qwen", **fields: Any) -> dict[str, Any]:
    return {"model_loading_config": {"model_id": model_id}, **fields}


def _error(model: type[BaseModel], data: Any) -> str:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    return format_validation_error(info.value)


def _write(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


FULL = {
    "model_loading_config": {"model_id": "qwen-0.5b", "model_source": "hf://Qwen/Qwen2.5-0.5B"},
    "accelerator_type": "H100",
    "engine_kwargs": {"tensor_parallel_size": 2, "max_model_len": 4096,
                      "enable_prefix_caching": True, "gpu_memory_utilization": 0.85,
                      "distributed_executor_backend": "ray"},
    "placement_group_config": {"bundles": [{"GPU": 1, "CPU": 2}, {"GPU": 1}],
                               "strategy": "STRICT_PACK"},
    "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4},
                          "max_ongoing_requests": 64, "graceful_shutdown_timeout_s": 300,
                          "request_router_config": {"request_router_class": "x.Router"}},
    "runtime_env": {"env_vars": {"HF_HOME": "/models"}},
    "experimental_configs": {"stream_batching_interval_ms": 50},
    "log_engine_metrics": False,
}  # fmt: skip


def test_full_config_loads_and_builds_engine_args() -> None:
    config = LLMConfig.model_validate(FULL)
    assert config.model_id == "qwen-0.5b"
    args = config.engine_args()
    assert isinstance(args, EngineArgs)
    assert (args.model, args.tensor_parallel_size, args.max_model_len) == (
        "Qwen/Qwen2.5-0.5B",
        2,
        4096,
    )
    assert args.gpu_memory_utilization == 0.85
    assert config.deployment_config["max_ongoing_requests"] == 64
    assert config.placement_strategy == "STRICT_PACK"
    accel = {"accelerator_type:H100": 0.001}
    assert config.placement_bundles(use_gpu=True) == [
        {"GPU": 1, "CPU": 2, **accel},
        {"GPU": 1, **accel},
    ]


def test_defaults_source_bundles_and_strategy() -> None:
    config = LLMConfig.model_validate(_llm(engine_kwargs={"tensor_parallel_size": 3}))
    assert config.model_loading_config.source == "qwen"
    assert config.engine_args().model == "qwen"
    assert config.log_engine_metrics is True
    assert config.placement_strategy == "PACK"
    assert config.placement_bundles(use_gpu=True) == [{"GPU": 1}] * 3
    assert config.placement_bundles(use_gpu=False) == [{"CPU": 1}] * 3


@pytest.mark.parametrize(
    ("source", "model"),
    [
        ("hf://org/name", "org/name"),
        ("org/name", "org/name"),
        ("pvc://weights/llama/8b", f"{PVC_MOUNT_ROOT}/weights/llama/8b"),
        ("/models/llama", "/models/llama"),
    ],
)
def test_model_source_resolves_to_what_the_engine_loads(source: str, model: str) -> None:
    config = LLMConfig.model_validate(
        _llm(model_loading_config={"model_id": "m", "model_source": source})
    )
    assert config.engine_args().model == model


def test_serving_args_accept_dict_object_and_yaml_path(tmp_path: Path) -> None:
    third = _write(tmp_path / "third.yaml", _llm("third"))
    fourth = _write(tmp_path / "fourth.yaml", _llm("fourth"))
    configs = [_llm("first"), LLMConfig.model_validate(_llm("second")), str(third), fourth]
    args = LLMServingArgs.model_validate({"llm_configs": configs})
    assert args.model_ids == ["first", "second", "third", "fourth"]
    assert LLMConfig.from_file(third).model_id == "third"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (_llm(engine_kwargs={"tensor_paralel_size": 2}),
         "unknown engine argument 'tensor_paralel_size' (did you mean 'tensor_parallel_size'?)"),
        (_llm(engine_kwargs={"max_model_len": "4k"}),
         "engine_kwargs: engine argument 'max_model_len' must be int | None, got str '4k'"),
        (_llm(engine_kwargs={"enable_prefix_caching": 1}),
         "engine argument 'enable_prefix_caching' must be bool, got int 1"),
        (_llm(engine_kwargs={"tensor_parallel_size": 0}),
         "tensor_parallel_size must be >= 1, got 0"),
        (_llm(engine_kwargs={"model": "x"}), "'model' is not allowed in engine_kwargs"),
        (_llm(engine_kwargs={"served_model_name": "x"}), "'served_model_name' is not allowed"),
        (_llm(engine_kwargs={"distributed_executor_backend": "mp"}),
         "distributed_executor_backend must be 'ray' (or absent) when serving, got 'mp'"),
        ({"model_loading_config": {"modle_id": "x"}},
         "model_loading_config: unknown key 'modle_id' (did you mean 'model_id'?)"),
        (_llm(engine_kwarg={}), "unknown key 'engine_kwarg' (did you mean 'engine_kwargs'?)"),
        (_llm(deployment_config={"placement_group_bundles": [{"GPU": 1}]}),
         "placement_group_bundles is not a deployment_config option: "
         "set placement_group_config.bundles instead"),
        (_llm(deployment_config={"placement_group_strategy": "PACK"}),
         "set placement_group_config.strategy instead"),
        (_llm(deployment_config={"max_ongoing_request": 4}),
         "deployment_config: unknown key 'max_ongoing_request' "
         "(did you mean 'max_ongoing_requests'?)"),
        (_llm(deployment_config={"num_replicas": "x"}),
         "deployment_config: `num_replicas` must be an int or \"auto\", but got: x"),
        (_llm(deployment_config={"max_ongoing_requests": "many"}),
         "max_ongoing_requests: Input should be a valid integer, got 'many'"),
        (_llm(placement_group_config={"bundles": [{"GPU": 1}], "strategy": "TIGHT"}),
         "placement_group_config.strategy: Input should be 'PACK', 'SPREAD', 'STRICT_PACK' or "
         "'STRICT_SPREAD', got 'TIGHT'"),
        (_llm(placement_group_config={"bundles": [{"GPU": 1}]},
              engine_kwargs={"tensor_parallel_size": 2}),
         "placement_group_config has 1 bundle(s) but tensor_parallel_size is 2"),
        (_llm(placement_group_config={"bundles": [{}]}), "bundle 0 is empty"),
        (_llm(model_loading_config={"model_id": "m", "model_source": "s3://bucket/m"}),
         "model_loading_config.model_source: model source scheme 's3://' is not supported"),
        (_llm(log_engine_metrics="yes"),
         "log_engine_metrics: Input should be a valid boolean, got 'yes'"),
        ({"engine_kwargs": {}}, "model_loading_config: Field required"),
    ],
)  # fmt: skip
def test_bad_llm_config_gives_one_line_naming_the_key(data: dict[str, Any], expected: str) -> None:
    message = _error(LLMConfig, data)
    assert expected in message
    assert "\n" not in message


def test_serving_args_reject_empty_and_duplicate_ids() -> None:
    assert _error(LLMServingArgs, {"llm_configs": []}) == (
        "llm_configs: empty list: give at least one model"
    )
    message = _error(LLMServingArgs, {"llm_configs": [_llm("a"), _llm("b"), _llm("a")]})
    assert message == "llm_configs: duplicate model_id 'a': each model needs its own id"
    message = _error(LLMServingArgs, {"llm_configs": [_llm("a", foo=1)]})
    assert message.startswith("llm_configs.0: unknown key 'foo'")
    message = _error(
        LLMServingArgs, {"llm_configs": [_llm()], "ingress_deployment_config": {"x": 1}}
    )
    assert message.startswith("ingress_deployment_config: unknown key 'x'")


def test_validate_engine_kwargs_is_the_shared_check() -> None:
    args = validate_engine_kwargs(
        {"model": "/m", "tensor_parallel_size": 2, "gpu_memory_utilization": 1}
    )
    assert (args.model, args.tensor_parallel_size, args.gpu_memory_utilization) == ("/m", 2, 1)
    with pytest.raises(
        ValueError, match=r"unknown engine argument 'max_num_seq' \(did you mean 'max_num_seqs'\?\)"
    ):
        validate_engine_kwargs({"max_num_seq": 4})
    with pytest.raises(ValueError, match=r"'block_size' must be int, got float 16\.5"):
        validate_engine_kwargs({"block_size": 16.5})
    with pytest.raises(ValueError, match="'tensor_parallel_size' must be int, got bool True"):
        validate_engine_kwargs({"tensor_parallel_size": True})


def _serve_config(*apps: dict[str, Any]) -> dict[str, Any]:
    return {"http_options": {"port": 8000}, "applications": [
        {"name": f"app{i}", "import_path": "cluster.serve:build_openai_app",
         "route_prefix": "/", "args": app}
        for i, app in enumerate(apps)
    ]}  # fmt: skip


@pytest.mark.parametrize(
    ("data", "out"),
    [
        (FULL, "ok: 1 model(s): qwen-0.5b\n"),
        ({"llm_configs": [_llm("a"), _llm("b")]}, "ok: 2 model(s): a, b\n"),
        (
            _serve_config({"llm_configs": [_llm("a")]}, {"llm_configs": [_llm("b")]}),
            "ok: 2 model(s): a, b\n",
        ),
    ],
)
def test_config_validate_command_accepts_the_three_kinds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: dict[str, Any], out: str
) -> None:
    assert main(["config", "validate", str(_write(tmp_path / "c.yaml", data))]) == 0
    assert capsys.readouterr().out == out


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_llm(engine_kwargs={"max_modle_len": 1}), "did you mean 'max_model_len'?"),
        ({"llm_configs": []}, "llm_configs: empty list"),
        (_serve_config({"llm_configs": [_llm("a"), _llm("a")]}),
         "applications.0.args.llm_configs: duplicate model_id 'a'"),
        ({"applications": []}, "applications must be a non-empty list"),
        (["a list"], "must hold a YAML mapping, got list"),
    ],
)  # fmt: skip
def test_config_validate_command_fails_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: Any, message: str
) -> None:
    path = _write(tmp_path / "c.yaml", data)
    assert main(["config", "validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"hybridserve config: error: {path}: ")
    assert message in captured.err
    assert captured.err.count("\n") == 1


def test_config_validate_reports_unreadable_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "validate", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    assert main(["config", "validate", str(tmp_path / "bad.yaml")]) == 2
    assert "is not valid YAML" in capsys.readouterr().err


def test_config_validate_starts_no_ray(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.yaml", FULL)
    code = (
        "import sys; from cluster.cli import main; rc = main(['config', 'validate', sys.argv[1]]); "
        "ray = sys.modules.get('ray'); "
        "assert ray is None or not ray.is_initialized(), 'ray started'; sys.exit(rc)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok: 1 model(s): qwen-0.5b\n"


def test_every_config_field_has_a_description() -> None:
    from cluster.config import ModelLoadingConfig, PlacementGroupConfig

    for model in (
        LLMConfig,
        LLMServingArgs,
        ModelLoadingConfig,
        PlacementGroupConfig,
        EngineArgs,
    ):
        missing = [name for name, field in model.model_fields.items() if not field.description]
        assert not missing, f"{model.__name__}: {missing}"


def test_api_key_comes_from_its_environment_variable() -> None:
    assert api_key_from_env({API_KEY_ENV: " secret\n"}) == "secret"
    assert api_key_from_env({API_KEY_ENV: ""}) is None
    assert api_key_from_env({}) is None
