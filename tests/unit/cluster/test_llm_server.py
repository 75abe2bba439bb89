"""The replica's parts that need no Ray cluster: the KV group kinds its metrics are labelled by,
and what it does once its engine is shut down."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.serve.llm_server import LLMServer, group_kinds
from scheduler.kv_cache.spec import KVCacheSpec, UniformTypeKVCacheSpecs
from scheduler.kv_cache.spec_factory import AttentionShape, make_spec, one_layer_groups_config


def _engine(*specs: KVCacheSpec) -> Any:
    config = one_layer_groups_config(8, list(specs))
    return SimpleNamespace(core=SimpleNamespace(scheduler=SimpleNamespace(kv_cache_config=config)))


def test_group_kinds_are_the_spec_kinds() -> None:
    engine = _engine(
        make_spec("full_attention", 16),
        make_spec("sliding_window", 16, 64),
        make_spec("chunked_local_attention", 16, 64),
        make_spec("mamba", 16),
    )
    assert group_kinds(engine) == [
        "full_attention",
        "sliding_window",
        "chunked_local_attention",
        "mamba",
    ]


def test_a_group_of_differently_shaped_layers_is_labelled_by_their_kind() -> None:
    members = {
        "a": make_spec("full_attention", 16, shape=AttentionShape(head_size=64)),
        "b": make_spec("full_attention", 16, shape=AttentionShape(head_size=128)),
    }
    engine = _engine(UniformTypeKVCacheSpecs.from_layers(members))
    assert group_kinds(engine) == ["full_attention"]


def test_a_replica_whose_constructor_failed_is_deleted_quietly() -> None:
    """Serve deletes a replica whose `__init__` raised; `__del__` must not raise then."""
    server = LLMServer.__new__(LLMServer)
    server.__del__()
    assert server.draining


def test_a_replica_whose_engine_is_shut_down_refuses_exports_at_once() -> None:
    """After Serve's drain (`__del__` stops the engine) a pull gets an error, not a wait: the
    puller recomputes at once."""
    server = LLMServer.__new__(LLMServer)
    server.__del__()
    with pytest.raises(RuntimeError, match="shut its engine down"):
        asyncio.run(server.kv_export([1, 2, 3], held=None))  # type: ignore[arg-type]
