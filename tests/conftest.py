"""Shared test fixtures (markers are declared in pyproject.toml).

Tests run torch on one intra-op thread (set before torch is imported, inherited by the rank
and interpreter subprocesses): the tiny test models gain nothing from more, and several busy
OpenMP threads on a shared 2-core machine slow small-op workloads down many times over.

Hypothesis runs the fixed "ci" profile unless HYPOTHESIS_PROFILE names another: derandomized
(examples drawn from each test's own fixed seed, no example database), so two runs of the suite
test the same cases. `HYPOTHESIS_PROFILE=explore` draws fresh examples each run, to hunt bugs.

The parity tests compare token for token with transformers in fp32, while `dtype="auto"` picks
bf16 on a CPU with native bf16: the engines the tests build name `dtype="float32"` (the shared
argument dicts and helpers, and every engine that runs in a Ray actor or a subprocess), and in
this process "auto" resolves as on a CPU without native bf16 (`cpu_dtype_pinned_to_fp32`), so an
engine a test builds without naming a dtype still runs fp32. The bf16 tests name bfloat16, or
restore the detection (`real_cpu_dtype`).

A suite started in the background by a non-interactive shell inherits SIGINT ignored, and so
would every command the tests start; the tests that press Ctrl-C need it to arrive as it does in
a terminal, so Python's own SIGINT handling is restored here (children then start with the
default disposition).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from worker import cpu_dtype
from worker.cpu_dtype import CpuDtypeChoice

REAL_AUTO_CPU_DTYPE = cpu_dtype.auto_cpu_dtype

os.environ.setdefault("OMP_NUM_THREADS", "1")
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model, converted from its GGUF file once per test session into a
    temporary cache (never the user's cache)."""
    from worker.default_model import ensure_default_model

    return ensure_default_model(tmp_path_factory.mktemp("default-model-cache") / "smollm2")


@pytest.fixture(scope="session")
def gguf_reference():  # -> tuple[tokenizer, transformers model]
    """transformers' own reading of the packaged GGUF file: (tokenizer, fp32 model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.default_model import default_gguf_path

    gguf = default_gguf_path()
    source = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **source)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **source)
    return tokenizer, model.eval()


def _fp32_choice() -> CpuDtypeChoice:
    return CpuDtypeChoice("float32", "the test suite pins fp32 (tests/conftest.py)")


@pytest.fixture(scope="session", autouse=True)
def cpu_dtype_pinned_to_fp32() -> Iterator[None]:
    """`dtype="auto"` resolves to fp32 in the test process (see the module docstring)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_dtype, "auto_cpu_dtype", _fp32_choice)
        yield


@pytest.fixture
def real_cpu_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's own choice for `dtype="auto"` on CPU, for the tests of that choice."""
    monkeypatch.setattr(cpu_dtype, "auto_cpu_dtype", REAL_AUTO_CPU_DTYPE)
