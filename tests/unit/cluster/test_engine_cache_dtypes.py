"""Engines whose pages encode elements differently share nothing: the offload tier's model id
and the KV transfer fingerprint name the KV and state dtypes, and a transfer between two real
engines that differ only in their state dtype (bfloat16 and float16: same bytes, same layout) is
refused on both sides with a message naming both encodings; an fp8 engine's transfer carries
half the bytes per block of a bf16 engine's, and the bf16 engine refuses it."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import LLM
from cluster.config.engine_args import EngineArgs
from cluster.engine.configs import engine_configs
from cluster.engine.kv_transfer import kv_export, kv_held_keys, kv_import
from scheduler.kv_cache.transfer import HeldKeys
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_models import save_tiny_model

PROMPT = [(7 * i + 3) % 250 + 1 for i in range(41)]
ENGINE = {"dtype": "bfloat16", "block_size": 4, "kv_cache_memory_bytes": 1 << 21}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bamba")
    save_tiny_hybrid("bamba", path)
    return path


def _offload_model_id(path: Path, tmp_path: Path, **cache: object) -> str:
    args = EngineArgs(
        model=str(path),
        dtype="bfloat16",
        kv_offloading_size=0.01,
        kv_offloading_disk_size=0.01,
        kv_offloading_dir=str(tmp_path),
        **cache,  # type: ignore[arg-type]
    )
    offload = engine_configs(args).scheduler.kv_offloading
    assert offload is not None
    return offload.model_id


def test_the_offload_tier_model_id_names_the_cache_dtypes(model_path: Path, tmp_path) -> None:
    variants = [
        {},
        {"kv_cache_dtype": "fp8"},
        {"kv_cache_dtype": "fp8_e5m2"},
        {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
        {"mamba_ssm_cache_dtype": "float16"},
        {"mamba_ssm_cache_dtype": "float32"},
    ]
    ids = [_offload_model_id(model_path, tmp_path, **variant) for variant in variants]
    assert len(set(ids)) == len(ids)
    # spelled alike, encoded alike: one id
    assert _offload_model_id(model_path, tmp_path, kv_cache_dtype="fp8") == _offload_model_id(
        model_path, tmp_path, kv_cache_dtype="fp8_e4m3"
    )
    assert _offload_model_id(model_path, tmp_path) == _offload_model_id(
        model_path, tmp_path, mamba_ssm_cache_dtype="bfloat16"
    )
    # scales calculated from each engine's own first batch: no two engines (or starts) alike
    calculated = {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}
    assert _offload_model_id(model_path, tmp_path, **calculated) != _offload_model_id(
        model_path, tmp_path, **calculated
    )


def test_a_transfer_between_state_dtypes_is_refused_on_both_sides(model_path: Path) -> None:
    sender = LLM(str(model_path), **ENGINE, mamba_ssm_cache_dtype="float16")
    receiver = LLM(str(model_path), **ENGINE)
    try:
        sender_core, receiver_core = sender.client.core, receiver.client.core
        assert sender_core.scheduler.kv_cache_config == receiver_core.scheduler.kv_cache_config
        sender.generate([PROMPT[:-1]])
        held = kv_held_keys(receiver_core, PROMPT)
        with pytest.raises(ValueError, match="state float16") as refused:
            kv_export(sender_core, PROMPT, held)
        assert "state bfloat16" in str(refused.value)
        # a sender that took no notice: the receiver refuses the pages themselves
        nothing_held = HeldKeys(sender_core.kv_transfer_fingerprint, held.groups)
        transfer = kv_export(sender_core, PROMPT, nothing_held)
        assert transfer.keys.num_blocks > 0
        with pytest.raises(ValueError, match="not imported") as refused:
            kv_import(receiver_core, transfer)
        assert "state float16" in str(refused.value)
        assert "state bfloat16" in str(refused.value)
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_an_fp8_engine_moves_half_the_bytes_and_a_bf16_engine_refuses_them(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Attention only (tiny Llama): fp8 pages are half the bytes per block in a transfer, the
    pool holds twice the blocks, and a bf16 engine refuses an fp8 engine's pages."""
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", path)
    engines = {dtype: LLM(str(path), **ENGINE, kv_cache_dtype=dtype) for dtype in ("auto", "fp8")}
    try:
        cores = {dtype: llm.client.core for dtype, llm in engines.items()}
        sent = {}
        for dtype, llm in engines.items():
            llm.generate([PROMPT[:-1]])
            held = kv_held_keys(cores[dtype], PROMPT)
            nothing_held = HeldKeys(held.fingerprint, tuple(frozenset() for _ in held.groups))
            sent[dtype] = kv_export(cores[dtype], PROMPT, nothing_held)
        assert sent["fp8"].keys.num_blocks == sent["auto"].keys.num_blocks > 0
        assert 2 * sent["fp8"].nbytes == sent["auto"].nbytes
        pools = {dtype: core.scheduler.kv_cache_config.num_blocks for dtype, core in cores.items()}
        assert pools["fp8"] == 2 * pools["auto"]
        with pytest.raises(ValueError, match="kv fp8_e4m3") as refused:
            kv_import(cores["auto"], sent["fp8"])
        assert "kv bfloat16" in str(refused.value)
    finally:
        for llm in engines.values():
            llm.shutdown()
