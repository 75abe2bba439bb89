"""`dtype="auto"` on CPU: bf16 where the CPU has native bf16 (cpuinfo flags), fp32 elsewhere;
explicit dtypes stay as given; the log names the choice and the reason."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from worker.config import resolve_dtype
from worker.cpu_dtype import CPUINFO, auto_cpu_dtype, cpu_flags

X86_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n\nprocessor\t: 1\n"
X86_PLAIN = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_cpu_flags_are_read_from_x86_and_arm_cpuinfo() -> None:
    assert "avx512_bf16" in cpu_flags(X86_BF16)
    assert "bf16" in cpu_flags(ARM_BF16)
    assert cpu_flags("") == set()


def test_auto_picks_bf16_only_with_a_native_bf16_flag() -> None:
    for text in (X86_BF16, ARM_BF16):
        choice = auto_cpu_dtype(text)
        assert choice.dtype == "bfloat16"
        assert "native bf16" in choice.reason
    assert "avx512_bf16" in auto_cpu_dtype(X86_BF16).reason
    plain = auto_cpu_dtype(X86_PLAIN)
    assert plain.dtype == "float32"
    assert "no native bf16" in plain.reason


def test_auto_on_this_cpu_follows_its_flags_and_says_why(
    real_cpu_dtype: None, caplog: pytest.LogCaptureFixture
) -> None:
    native = bool(cpu_flags(Path(CPUINFO).read_text()) & {"avx512_bf16", "amx_bf16", "bf16"})
    with caplog.at_level(logging.INFO, logger="worker.config"):
        dtype = resolve_dtype("auto", torch.float32, "cpu")
    assert dtype == (torch.bfloat16 if native else torch.float32)
    assert "dtype auto: " + ("bfloat16" if native else "float32") in caplog.text
    assert "native bf16" in caplog.text


def test_explicit_dtypes_stay_as_given(real_cpu_dtype: None) -> None:
    assert resolve_dtype("float32", None, "cpu") == torch.float32
    assert resolve_dtype("bf16", None, "cpu") == torch.bfloat16
    assert resolve_dtype("auto", torch.float16, "cuda") == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8", None, "cpu")


def test_the_suite_pins_auto_to_fp32_in_its_process() -> None:
    assert resolve_dtype("auto", None, "cpu") == torch.float32
