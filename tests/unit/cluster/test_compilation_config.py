"""`compilation_config` and `enforce_eager`: vLLM's keys, as a dict, JSON text and CLI flags."""

from __future__ import annotations

import argparse

import pytest

from cluster.config.engine_args import validate_engine_kwargs
from cluster.config.engine_flags import add_engine_arg_flags, engine_kwargs_from_args
from worker.graphs.capture_sizes import CudaGraphConfig, CudaGraphMode


def test_default_captures_decode_at_vllm_sizes() -> None:
    assert validate_engine_kwargs({}).cuda_graph_config() == CudaGraphConfig()


def test_dict_and_json_text_give_the_same_config() -> None:
    keys = {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [8, 1, 4]}
    from_dict = validate_engine_kwargs({"compilation_config": keys}).cuda_graph_config()
    text = '{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [8, 1, 4]}'
    from_text = validate_engine_kwargs({"compilation_config": text}).cuda_graph_config()
    assert from_dict == from_text
    assert from_dict.mode is CudaGraphMode.FULL_DECODE_ONLY
    assert from_dict.capture_sizes == (1, 4, 8)


def test_enforce_eager_turns_graphs_off() -> None:
    assert not validate_engine_kwargs({"enforce_eager": True}).cuda_graph_config().is_enabled


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"cudagraph_mode": "ALL"}, "cudagraph_mode"),
        ({"cudagraph_sizes": [1]}, "did you mean 'cudagraph_capture_sizes'"),
        ({"cudagraph_capture_sizes": [0]}, "cudagraph_capture_sizes"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_values_name_the_key(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_engine_kwargs({"compilation_config": value})


def test_cli_flags() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arg_flags(parser)
    args = parser.parse_args(
        ["--compilation-config", '{"max_cudagraph_capture_size": 64}', "--enforce-eager"]
    )
    config = validate_engine_kwargs(engine_kwargs_from_args(args)).cuda_graph_config()
    assert config.max_capture_size == 64
    assert config.enforce_eager
