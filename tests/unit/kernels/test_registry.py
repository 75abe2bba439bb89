"""Backend selection: what `select_backend` picks, and why it refuses."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import AttentionBackend, batched_attention, reference, select_backend
from kernels import flash_attn as flash_attn_adapter

CPU_LAYOUT = {"device": "cpu", "block_size": 16, "head_size": 128}
REPO_ROOT = Path(__file__).resolve().parents[3]


def test_auto_on_cpu_selects_the_batched_torch_kernel_and_logs_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="kernels.registry"):
        backend = select_backend("auto", **CPU_LAYOUT)
    want = AttentionBackend("torch", reference.store_kv_cache, batched_attention.paged_attention)
    assert backend == want
    assert "device is cpu" in caplog.text


def test_torch_backend_is_the_batched_kernel() -> None:
    backend = select_backend("torch", device=torch.device("cpu"), block_size=1, head_size=16)
    assert backend.paged_attention is batched_attention.paged_attention


def test_explicit_torch_is_always_available() -> None:
    backend = select_backend("torch", device=torch.device("cpu"), block_size=1, head_size=16)
    assert backend.name == "torch"


@pytest.mark.skipif(not kernels.HAS_TRITON, reason="triton is not installed")
def test_auto_on_cuda_falls_back_to_triton_when_flash_attn_cannot_page_the_blocks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Selection only imports modules, so this runs without a GPU.
    with caplog.at_level(logging.INFO, logger="kernels.registry"):
        backend = select_backend("auto", device="cuda", block_size=16, head_size=128)
    assert backend.name == "triton"
    assert "flash_attn skipped" in caplog.text


def test_explicit_flash_attn_on_cpu_raises_with_reason() -> None:
    with pytest.raises(ValueError, match=r"flash_attn.*CUDA device"):
        select_backend("flash_attn", **CPU_LAYOUT)


@pytest.mark.skipif(not kernels.HAS_TRITON, reason="triton is not installed")
def test_explicit_triton_on_cpu_without_interpreter_raises_with_reason() -> None:
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", **CPU_LAYOUT)


def test_unknown_backend_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        select_backend("cuda", **CPU_LAYOUT)


@pytest.mark.parametrize(
    ("block_size", "head_size", "dtype", "expected"),
    [
        (16, 128, torch.float16, "block_size % 256 == 0, got 16"),
        (256, 100, torch.float16, "head_size % 8 == 0"),
        (256, 128, torch.float32, "float16 and bfloat16 only"),
    ],
)
def test_flash_attn_reports_unsupported_layouts(
    block_size: int, head_size: int, dtype: torch.dtype, expected: str
) -> None:
    reason = flash_attn_adapter.unsupported_reason(
        torch.device("cuda"), block_size, head_size, dtype
    )
    assert reason is not None
    assert expected in reason


def test_flash_attn_cannot_serve_sinks_and_auto_picks_another_backend(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reason = flash_attn_adapter.unsupported_reason(
        torch.device("cuda"), 256, 64, torch.bfloat16, has_sinks=True
    )
    assert reason is not None
    assert "attention sinks" in reason
    with pytest.raises(ValueError, match=r"'flash_attn' is unavailable: .*attention sinks"):
        select_backend("flash_attn", device="cuda", block_size=256, head_size=64, has_sinks=True)
    with caplog.at_level(logging.INFO, logger="kernels.registry"):
        backend = select_backend(
            "auto", device="cuda", block_size=256, head_size=64, has_sinks=True
        )
    assert backend.name in ("triton", "torch")
    assert "flash_attn skipped: flash-attn 2 has no attention sinks" in caplog.text


def test_flash_attn_cannot_derive_keys_from_values_and_auto_picks_another_backend(
    caplog: pytest.LogCaptureFixture,
) -> None:
    layout = {"device": "cuda", "block_size": 256, "head_size": 128, "keys_from_values": True}
    with pytest.raises(ValueError, match=r"'flash_attn' is unavailable: .*derive them"):
        select_backend("flash_attn", **layout)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="kernels.registry"):
        backend = select_backend("auto", **layout)  # type: ignore[arg-type]
    assert backend.name in ("triton", "torch")
    assert "flash_attn skipped: flash-attn reads stored keys" in caplog.text


@pytest.mark.skipif(kernels.HAS_FLASH_ATTN, reason="flash-attn is installed")
def test_flash_attn_without_the_package_says_so_for_a_supported_layout() -> None:
    reason = flash_attn_adapter.unsupported_reason(torch.device("cuda"), 256, 128, torch.bfloat16)
    assert reason is not None
    assert reason.startswith("flash-attn does not import (")
    with pytest.raises(ValueError, match=r"'flash_attn' is unavailable: flash-attn does not"):
        select_backend("flash_attn", device="cuda", block_size=256, head_size=128)


def test_availability_flags_say_whether_each_package_imports() -> None:
    assert kernels.HAS_TRITON is (importlib.util.find_spec("triton") is not None)
    assert kernels.HAS_TRITON  # a core dependency on Linux: the project pins it
    assert kernels.HAS_FLASH_ATTN is (flash_attn_adapter.import_error() is None)


def test_importing_kernels_loads_neither_triton_nor_flash_attn() -> None:
    code = (
        "import sys, kernels\n"
        "assert 'triton' not in sys.modules and 'flash_attn' not in sys.modules\n"
        "kernels.select_backend('auto', device='cpu', block_size=16, head_size=64)\n"
        "assert 'triton' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)
