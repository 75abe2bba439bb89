"""Map Hugging Face `architectures` names to our model classes."""

from __future__ import annotations

from worker.models.bamba import BambaForCausalLM
from worker.models.decoder import DecoderForCausalLM
from worker.models.gemma2 import Gemma2ForCausalLM
from worker.models.gemma3 import Gemma3ForCausalLM
from worker.models.gemma3_vision import Gemma3ForConditionalGeneration
from worker.models.gemma3n import Gemma3nForCausalLM
from worker.models.gemma4 import Gemma4ForCausalLM
from worker.models.gemma4_vision import Gemma4ForConditionalGeneration
from worker.models.gpt_oss import GptOssForCausalLM
from worker.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from worker.models.lfm2 import Lfm2ForCausalLM
from worker.models.llama import LlamaForCausalLM, MistralForCausalLM
from worker.models.llama4 import Llama4ForCausalLM
from worker.models.llama4_vision import Llama4ForConditionalGeneration
from worker.models.nemotron_h import NemotronHForCausalLM
from worker.models.qwen2 import Qwen2ForCausalLM
from worker.models.qwen3_5_vision import (
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
)
from worker.models.qwen3_next import (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3NextForCausalLM,
)

_MODELS: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Gemma3nForCausalLM": Gemma3nForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "Llama4ForConditionalGeneration": Llama4ForConditionalGeneration,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,
    "GptOssForCausalLM": GptOssForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
}


def supported_architectures() -> list[str]:
    """Architecture names that `get_model_class` accepts."""
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[DecoderForCausalLM]:
    """The class serving `architecture`, e.g. "LlamaForCausalLM"."""
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
    return _MODELS[architecture]
