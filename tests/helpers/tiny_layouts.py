"""Every served text family as a tiny random checkpoint, saved by one name (one per layout the
tests cover: sliding window, chunked local, sinks, K = V, KV sharing, Mamba-2, gated DeltaNet,
short conv, MoE)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.tiny_gemma3n import save_tiny_gemma3n
from tests.helpers.tiny_gemma4_gpt_oss import GEMMA4, GPT_OSS, save_gemma4_or_gpt_oss
from tests.helpers.tiny_hybrid import HYBRID_FAMILIES, save_tiny_hybrid
from tests.helpers.tiny_linear_hybrid import LINEAR_FAMILIES, save_tiny_linear_hybrid
from tests.helpers.tiny_models import CHUNKED_FAMILIES, FAMILIES, save_tiny_model

TEXT_FAMILIES = (
    *FAMILIES,  # llama, mistral, qwen2, gemma2 (softcap), gemma3 (sliding window + full)
    *CHUNKED_FAMILIES,  # llama4: chunked local, NoPE, MoE
    "gemma3n",  # KV sharing
    "gemma4",  # K = V global layers, KV sharing, MoE
    "gpt_oss",  # sliding window, sinks, MoE
    *HYBRID_FAMILIES,  # bamba, granitemoehybrid (MoE), nemotron_h: Mamba-2
    *LINEAR_FAMILIES,  # qwen3_next, qwen3_5, qwen3_5_moe: gated DeltaNet; lfm2: short conv
)
"""Every text family the registry serves, by the tiny helpers' names."""


def save_family(family: str, path: Path) -> None:
    """Write the tiny checkpoint of `family` (one of `TEXT_FAMILIES`) to `path`."""
    if family in FAMILIES or family in CHUNKED_FAMILIES:
        save_tiny_model(family, path)
    elif family in HYBRID_FAMILIES:
        save_tiny_hybrid(family, path)
    elif family in LINEAR_FAMILIES:
        save_tiny_linear_hybrid(family, path)
    elif family == "gpt_oss":
        save_gemma4_or_gpt_oss("GptOssConfig", "GptOssForCausalLM", GPT_OSS, path)
    elif family == "gemma4":
        save_gemma4_or_gpt_oss("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4, path)
    elif family == "gemma3n":
        save_tiny_gemma3n(path)
    else:
        raise ValueError(f"unknown family {family!r}")
