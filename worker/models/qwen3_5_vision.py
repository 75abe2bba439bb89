"""Qwen3.5 with images (dense and MoE): the vision tower ahead of the text model, and the M-RoPE
positions of prompts that hold images.

The vision tower is transformers' own Qwen3.5 vision module (patch embedding, learned positions
resampled to each image's grid, 2D rotary attention within each image, a 2 x 2 patch merger into
the text width; Qwen3.5 injects no deepstack features into text layers), loaded from the
checkpoint's `model.visual.` tensors and replicated on every tensor-parallel rank.

Positions (transformers' `get_rope_index`): text tokens count on from the previous token on
every axis; an image's tokens, laid out as its merged grid [t, h, w], sit at (start + t,
start + h, start + w), and the text after it starts at start + max(h, w). So a prompt's positions
are computed once, from its images' offsets and grids; every later token (decode, drafts) sits
at its index plus `delta` (the prompt's last position + 1 - its length) on all three axes.

    prompt   t0 t1 <vs> [img img img img img img] <ve> t9
    index     0  1   2    3   4   5   6   7   8     9  10
    t axis    0  1   2    3   3   3   3   3   3     6   7    (grid 1 x 2 x 3: h in 0..1, w in 0..2)
    h axis    0  1   2    3   3   3   4   4   4     6   7
    w axis    0  1   2    3   4   5   3   4   5     6   7    delta = 8 - 11 = -3
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn
from transformers import AutoModel, PretrainedConfig

from scheduler.multimodal import MultiModalFeature
from worker.attention.attention import ForwardContext
from worker.config import ModelConfig, ParallelConfig, checkpoint_config
from worker.layers.loading import WeightSource, copy_checked, read_full
from worker.models.mamba_hybrid import HybridModel
from worker.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from worker.multimodal.mrope import PromptPositions

VISION_PREFIX = "model.visual."
"""Checkpoint names of the vision tower (ours: `visual.`)."""


def image_grid(feature: MultiModalFeature) -> tuple[int, int, int]:
    """The image's patch grid (t, h, w) from its processed inputs' `image_grid_thw`."""
    grid = feature.data["image_grid_thw"].reshape(-1, 3)
    if grid.shape[0] != 1:
        raise ValueError(f"image {feature.identifier[:12]} holds {grid.shape[0]} grids, not one")
    t, h, w = (int(n) for n in grid[0])
    return t, h, w


def merged_grid(feature: MultiModalFeature, merge_size: int) -> tuple[int, int, int]:
    """The image's grid of merged patches (t, h, w): one placeholder token each, row-major.

    Raises ValueError unless it fills the image's placeholder run exactly.
    """
    t, h, w = image_grid(feature)
    merged = (t, h // merge_size, w // merge_size)
    if merged[0] * merged[1] * merged[2] != feature.length:
        raise ValueError(
            f"image {feature.identifier[:12]}: a {t} x {h} x {w} patch grid merged "
            f"{merge_size} x {merge_size} fills {merged[0] * merged[1] * merged[2]} positions, "
            f"its placeholder run {feature.length}"
        )
    return merged


def mrope_prompt_positions(
    prompt_len: int, features: Sequence[MultiModalFeature], merge_size: int
) -> PromptPositions:
    """Positions of a `prompt_len`-token prompt holding `features` (images, in prompt order)."""
    axes = np.zeros((3, prompt_len), dtype=np.int64)
    next_position, cursor = 0, 0
    for feature in features:
        axes[:, cursor : feature.offset] = next_position + np.arange(feature.offset - cursor)
        next_position += feature.offset - cursor
        t_grid, h_grid, w_grid = merged_grid(feature, merge_size)
        grid = np.meshgrid(np.arange(t_grid), np.arange(h_grid), np.arange(w_grid), indexing="ij")
        axes[:, feature.offset : feature.end] = next_position + np.stack(grid).reshape(3, -1)
        next_position += max(h_grid, w_grid)
        cursor = feature.end
    axes[:, cursor:] = next_position + np.arange(prompt_len - cursor)
    last = int(axes.max()) if prompt_len else -1
    return PromptPositions(axes, last + 1 - prompt_len)


def build_vision_tower(vision_config: PretrainedConfig) -> nn.Module:
    """transformers' vision module of `vision_config`, in the default dtype and device."""
    tower: nn.Module = AutoModel.from_config(  # type: ignore[no-untyped-call]
        vision_config, attn_implementation="sdpa", dtype=torch.get_default_dtype()
    )
    return tower


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """transformers' `Qwen3_5ForConditionalGeneration`: the dense text model with images."""

    takes_images = True
    skipped_prefixes = ("mtp.",)
    default_mrope_section = (11, 11, 10)
    """transformers' sections when the config names none."""

    def __init__(self, model_config: ModelConfig, parallel: ParallelConfig) -> None:
        super().__init__(model_config, parallel)
        vision_config = checkpoint_config(model_config).vision_config
        self.visual = build_vision_tower(vision_config)
        self.merge_size = int(vision_config.spatial_merge_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden_size] token embeddings (image rows are overwritten after)."""
        assert isinstance(self.model, HybridModel)
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T] ids and positions -> final hidden states [T, hidden]; `inputs_embeds` [T, hidden]
        has the images merged in, `rope_positions` [3, T] (M-RoPE) replace the positions."""
        rotated = positions if rope_positions is None else rope_positions
        hidden: torch.Tensor = self.model(input_ids, rotated, ctx, inputs_embeds)
        return hidden

    @torch.inference_mode()
    def embed_images(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """One [feature.length, hidden_size] tensor per image: vision tower, then merger."""
        for feature in features:
            merged_grid(feature, self.merge_size)  # the tower's rows fill its placeholder run
        weight = next(self.visual.parameters())
        pixels = torch.cat([feature.data["pixel_values"] for feature in features])
        grids = torch.tensor([image_grid(feature) for feature in features], device=weight.device)
        pixels = pixels.to(device=weight.device, dtype=weight.dtype)
        merged: torch.Tensor = self.visual(pixels, grid_thw=grids).pooler_output
        return list(torch.split(merged, [feature.length for feature in features]))

    def mrope_positions(
        self, prompt_len: int, features: Sequence[MultiModalFeature]
    ) -> PromptPositions:
        """M-RoPE positions of a prompt holding `features`, and the delta of later tokens."""
        return mrope_prompt_positions(prompt_len, features, self.merge_size)

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> set[str]:
        """The vision tower's tensors replicated into `visual.`, the rest to the text model."""
        tower = dict(self.visual.named_parameters())
        loaded: set[str] = set()

        def text_weights() -> Iterator[tuple[str, WeightSource]]:
            for name, source in weights:
                if not name.startswith(VISION_PREFIX):
                    yield name, source
                    continue
                local = name.removeprefix(VISION_PREFIX)
                if local not in tower:
                    raise ValueError(f"checkpoint tensor {name} matches no vision parameter")
                copy_checked(tower[local].data, read_full(source))
                loaded.add(f"visual.{local}")

        loaded |= super().load_weights(text_weights())
        return loaded


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    """transformers' `Qwen3_5MoeForConditionalGeneration`: the MoE text model with images."""

    is_moe_layer = Qwen3_5MoeForCausalLM.is_moe_layer
    norm_topk_prob = Qwen3_5MoeForCausalLM.norm_topk_prob
