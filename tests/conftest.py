"""Shared test fixtures (markers are declared in pyproject.toml)."""

from __future__ import annotations

from pathlib import Path

import pytest


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
