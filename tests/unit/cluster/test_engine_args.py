"""`EngineArgs`: one pydantic model, its one-line errors, and the one executor-backend rule."""

from __future__ import annotations

import pickle
import re
from typing import Any

import pytest
from pydantic import ValidationError

from cluster import ray_cluster
from cluster.config import EngineArgs, ExecutorSite, resolve_executor_backend
from cluster.config.engine_args import validate_engine_kwargs


def test_defaults_are_vllms_and_the_model_is_frozen() -> None:
    args = EngineArgs()
    assert (args.block_size, args.max_num_seqs, args.scheduling_policy) == (16, 256, "fcfs")
    with pytest.raises(ValidationError, match="frozen"):
        args.block_size = 8  # type: ignore[misc]


def test_every_field_is_documented_by_its_attribute_docstring() -> None:
    for name, field in EngineArgs.model_fields.items():
        assert field.description, name
    assert EngineArgs.model_fields["block_size"].description == "Tokens per KV cache block."


BAD_ARGUMENTS = [
    ({"max_num_seq": 4},
     "unknown engine argument 'max_num_seq' (did you mean 'max_num_seqs'?)"),
    ({"max_model_len": "4k"},
     "engine argument 'max_model_len' must be int | None, got str '4k'"),
    ({"block_size": 16.5}, "engine argument 'block_size' must be int, got float 16.5"),
    ({"tensor_parallel_size": True},
     "engine argument 'tensor_parallel_size' must be int, got bool True"),
    ({"enable_prefix_caching": 1},
     "engine argument 'enable_prefix_caching' must be bool, got int 1"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1, got 0"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1], got 1.5"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization must be in (0, 1], got 0"),
    ({"worker_step_timeout_s": -1}, "worker_step_timeout_s must be > 0, got -1"),
    ({"device": "tpu"}, "device must be 'auto', 'cpu' or 'cuda', got 'tpu'"),
    ({"mamba_cache_mode": "some"},
     "mamba_cache_mode must be 'none', 'align' or 'all', got 'some'"),
    ({"scheduling_policy": "lifo"},
     "scheduling_policy must be 'fcfs' or 'priority', got 'lifo'"),
    ({"distributed_executor_backend": "mpi"},
     "distributed_executor_backend must be 'uni', 'mp' or 'ray', got 'mpi'"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "message"), BAD_ARGUMENTS)
def test_bad_engine_arguments_are_one_line_naming_the_argument(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        validate_engine_kwargs(kwargs)
    assert str(info.value) == message


def test_ints_are_accepted_for_float_arguments() -> None:
    args = validate_engine_kwargs({"gpu_memory_utilization": 1, "worker_step_timeout_s": 5})
    assert (args.gpu_memory_utilization, args.worker_step_timeout_s) == (1, 5)


def test_engine_args_survive_pickling_for_ray_actors() -> None:
    args = EngineArgs(model="/m", tensor_parallel_size=2, scheduling_policy="priority")
    assert pickle.loads(pickle.dumps(args)) == args


def test_copies_and_dumps_replace_dataclass_helpers() -> None:
    args = EngineArgs(model="/m")
    pinned = args.model_copy(update={"distributed_executor_backend": "ray"})
    assert (pinned.model, pinned.distributed_executor_backend) == ("/m", "ray")
    assert validate_engine_kwargs(pinned.model_dump()) == pinned


@pytest.mark.parametrize(
    ("where", "kwargs", "inside_ray", "backend"),
    [
        ("offline", {}, False, "uni"),
        ("offline", {"tensor_parallel_size": 2}, False, "mp"),
        ("offline", {}, True, "ray"),
        ("offline", {"distributed_executor_backend": "mp"}, True, "mp"),
        ("serve_replica", {}, False, "ray"),
        ("serve_replica", {"tensor_parallel_size": 2}, False, "ray"),
        ("serve_replica", {"distributed_executor_backend": "uni"}, False, "uni"),
        ("batch_replica", {}, True, "uni"),
        ("batch_replica", {"tensor_parallel_size": 2}, True, "mp"),
        ("batch_replica", {"distributed_executor_backend": "ray"}, True, "ray"),
    ],
)
def test_executor_backend_defaults_by_where_the_engine_runs(
    monkeypatch: pytest.MonkeyPatch,
    where: ExecutorSite,
    kwargs: dict[str, Any],
    inside_ray: bool,
    backend: str,
) -> None:
    monkeypatch.setattr(ray_cluster, "inside_ray", lambda: inside_ray)
    assert resolve_executor_backend(EngineArgs(**kwargs), where) == backend


@pytest.mark.parametrize(
    "kwargs",
    [
        {"distributed_executor_backend": "mp"},
        {"distributed_executor_backend": "uni", "tensor_parallel_size": 2},
    ],
)
def test_a_serve_replica_runs_its_ranks_on_ray(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be 'ray' \\(or absent\\) when serving"):
        resolve_executor_backend(EngineArgs(**kwargs), "serve_replica")


def test_the_readme_offload_example_and_flags_are_valid_engine_arguments() -> None:
    import ast

    from cluster.config.engine_args import validate_engine_kwargs
    from tests.helpers.readme import code_block

    call = next(
        node
        for node in ast.walk(ast.parse(code_block("kv_offloading_backend", "python")))
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "LLM"
    )
    kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    args = validate_engine_kwargs({"model": "/m", **kwargs})
    assert (args.kv_offloading_size, args.kv_offloading_disk_size) == (64, 500)
    with pytest.raises(ValueError, match="kv_offloading_size"):
        validate_engine_kwargs({"kv_offloading_size": -1})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_offloading_size": 1, "kv_offloading_disk_size": 5}, "needs kv_offloading_dir"),
        ({"kv_offloading_dir": "/kv", "kv_offloading_disk_size": 5}, "set kv_offloading_size"),
    ],
)
def test_a_disk_offload_tier_needs_its_folder_and_a_host_tier(kwargs: dict, message: str) -> None:
    from cluster.config.engine_args import validate_engine_kwargs

    with pytest.raises(ValueError, match=message):
        validate_engine_kwargs(kwargs)
