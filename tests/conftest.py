"""Shared test fixtures (markers are declared in pyproject.toml).

Tests run torch on one intra-op thread (set before torch is imported, inherited by the rank
and interpreter subprocesses): the tiny test models gain nothing from more, and several busy
OpenMP threads on a shared 2-core machine slow small-op workloads down many times over.

Hypothesis runs the fixed "ci" profile unless HYPOTHESIS_PROFILE names another: derandomized
(examples drawn from each test's own fixed seed, no example database), so two runs of the suite
test the same cases. `HYPOTHESIS_PROFILE=explore` draws fresh examples each run, to hunt bugs.

A suite started in the background by a non-interactive shell inherits SIGINT ignored, and so
would every command the tests start; the tests that press Ctrl-C need it to arrive as it does in
a terminal, so Python's own SIGINT handling is restored here (children then start with the
default disposition).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from hypothesis import settings

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
