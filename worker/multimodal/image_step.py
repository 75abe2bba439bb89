"""One step's image inputs: the encoder rows each scheduled chunk needs, merged into the input
embeddings, and (for images attending both ways) each query row's key end.

    request's tokens:   [ text | image (offset .. end) | text ... ]
    chunk this step:          [chunk_start ......... chunk_end)
    rows it takes:      encoder rows [max(offset, chunk_start) - offset,
                                      min(end, chunk_end) - offset)
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Protocol

import numpy as np
import torch
from torch import nn

from scheduler.multimodal import MultiModalFeature
from worker.input_batch import InputBatch, RequestStates
from worker.multimodal.encoder_cache import EncoderCache
from worker.multimodal.mrope import MropeSteps


class ImageModel(Protocol):
    """What the step needs of a model that takes images (see the package docstring)."""

    def embed_images(self, features: list[MultiModalFeature]) -> list[torch.Tensor]: ...

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor: ...


class ImageSlice(NamedTuple):
    """The rows of one image's encoder output that one chunk of the step takes."""

    req_id: str
    feature: MultiModalFeature
    batch_row: int
    """First row of the step's flat batch the slice fills."""
    start: int
    """First row of the encoder output, from the image's first position."""
    end: int
    """One past the last row of the encoder output."""


def takes_images(model: nn.Module) -> bool:
    """Whether the model has a vision encoder the runner feeds (`embed_images`)."""
    return bool(getattr(model, "takes_images", False))


def scheduled_slices(batch: InputBatch, states: RequestStates) -> list[ImageSlice]:
    """Every image row the step's chunks cover, per request in batch order."""
    slices: list[ImageSlice] = []
    starts = batch.query_start_loc_np
    for idx, req_id in enumerate(batch.req_ids):
        features = states.requests[req_id].mm_features
        chunk_start = int(batch.num_computed_np[idx])
        chunk_end = chunk_start + int(starts[idx + 1] - starts[idx])
        for feature in features:
            if feature.overlaps(chunk_start, chunk_end):
                first, last = max(feature.offset, chunk_start), min(feature.end, chunk_end)
                row = int(starts[idx]) + first - chunk_start
                slices.append(
                    ImageSlice(req_id, feature, row, first - feature.offset, last - feature.offset)
                )
    return slices


def needed_images(states: RequestStates) -> set[str]:
    """Identifiers of the images some request has not computed to the end yet."""
    return {
        feature.identifier
        for req in states.requests.values()
        for feature in req.mm_features
        if feature.end > req.num_computed_tokens
    }


def merged_embeddings(
    model: ImageModel, input_ids: torch.Tensor, slices: list[ImageSlice], cache: EncoderCache
) -> torch.Tensor:
    """[T, hidden] token embeddings with each slice's rows replaced by its encoder rows."""
    rows = torch.cat([torch.arange(s.batch_row, s.batch_row + s.end - s.start) for s in slices]).to(
        input_ids.device
    )
    ids = input_ids.clone()
    ids[rows] = 0  # placeholder ids may lie outside the vocabulary; their rows are replaced
    embeds = model.embed_input_ids(ids)
    image_rows = torch.cat([cache[s.feature.identifier][s.start : s.end] for s in slices])
    embeds[rows] = image_rows.to(device=embeds.device, dtype=embeds.dtype)
    return embeds


def bidirectional_key_ends(batch: InputBatch, slices: list[ImageSlice]) -> np.ndarray:
    """[num_tokens] int32: a row's position + 1, an image row's image end. RuntimeError when an
    image is not whole in this step's chunk (its later keys would not be in the cache)."""
    starts = batch.query_start_loc_np
    req_of_row = np.repeat(np.arange(batch.num_reqs), np.diff(starts))
    rows = np.arange(batch.num_tokens)
    ends = batch.num_computed_np[req_of_row] + rows - starts[req_of_row] + 1
    for piece in slices:
        feature = piece.feature
        if piece.start != 0 or piece.end != feature.length:
            raise RuntimeError(
                f"request {piece.req_id}: this step computes rows [{piece.start}, {piece.end}) "
                f"of the image at [{feature.offset}, {feature.end}), whose tokens attend to each "
                "other both ways; the scheduler must keep such an image in one chunk "
                "(whole_images)"
            )
        ends[piece.batch_row : piece.batch_row + feature.length] = feature.end
    key_ends: np.ndarray = ends.astype(np.int32)
    return key_ends


class ImageStep:
    """The model runner's image side: the encoder cache and the step's image inputs."""

    def __init__(self, model: ImageModel, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.bidirectional = bool(getattr(model, "bidirectional_images", False))
        """The model's image tokens attend to each other both ways (Gemma 3)."""
        self.cache = EncoderCache()
        self.mrope = MropeSteps.of_model(model)
        """The step's M-RoPE positions (models that have them: Qwen3.5)."""

    def prepare(
        self, batch: InputBatch, states: RequestStates
    ) -> tuple[InputBatch, dict[str, torch.Tensor]]:
        """The batch (with `key_ends` when the step has images attending both ways) and the
        forward's extra arguments (`inputs_embeds` when the step has image rows,
        `rope_positions` when an M-RoPE model's step holds a request with images)."""
        self.cache.retain(needed_images(states))
        positions = self.mrope.step_inputs(batch, states)
        slices = scheduled_slices(batch, states)
        if not slices:
            return batch, positions
        self.cache.ensure([piece.feature for piece in slices], self.model.embed_images)
        embeds = merged_embeddings(self.model, batch.input_ids, slices, self.cache)
        if self.bidirectional:
            ends = torch.from_numpy(bidirectional_key_ends(batch, slices)).to(self.device)
            batch = replace(batch, key_ends=ends)
        return batch, {"inputs_embeds": embeds, **positions}
