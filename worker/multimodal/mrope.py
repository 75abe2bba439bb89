"""M-RoPE positions of a step (Qwen3.5): [3, T] (temporal, height, width) when a scheduled
request holds images; steps without such requests keep the batch's [T] positions alone.

A model with M-RoPE implements `mrope_positions(prompt_len, features) -> PromptPositions` and
takes the step's [3, T] positions as the forward's `rope_positions` (rotary only: slots and
every other use of positions stay [T]). `MropeSteps` asks the model once per request with images
(the first step that schedules it), keeps the answer while the request lives, and gives each of
the request's tokens its prompt position, or, past the prompt (decode, drafts), its index +
delta on every axis. The other requests of such a step get their plain position on every axis,
which rotates exactly as [T].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from scheduler.multimodal import MultiModalFeature
from worker.input_batch import InputBatch, RequestStates


class PromptPositions(NamedTuple):
    """M-RoPE positions of one prompt."""

    positions: np.ndarray
    """[3, prompt_len] int64: temporal, height and width position of each prompt token."""
    delta: int
    """Token index + delta is the position (on every axis) of each token after the prompt."""


PositionsOfPrompt = Callable[[int, Sequence[MultiModalFeature]], PromptPositions]
"""A model's `mrope_positions(prompt_len, features)`."""


class MropeSteps:
    """Per-request prompt positions of an M-RoPE model, and each step's positions from them."""

    def __init__(self, positions_of_prompt: PositionsOfPrompt | None) -> None:
        """`positions_of_prompt`: the model's `mrope_positions` (None: a model without)."""
        self.positions_of_prompt = positions_of_prompt
        self.prompts: dict[str, PromptPositions] = {}
        """Request -> its prompt's positions (requests with images only)."""

    @classmethod
    def of_model(cls, model: object) -> MropeSteps:
        return cls(getattr(model, "mrope_positions", None))

    def step_inputs(self, batch: InputBatch, states: RequestStates) -> dict[str, torch.Tensor]:
        """`{"rope_positions": [3, T]}` when a request of the step holds images, else {}."""
        if self.positions_of_prompt is None:
            return {}
        for req_id in [req_id for req_id in self.prompts if req_id not in states.requests]:
            del self.prompts[req_id]  # finished
        with_images = [
            idx for idx, req_id in enumerate(batch.req_ids) if states.requests[req_id].mm_features
        ]
        if not with_images:
            return {}
        starts = batch.query_start_loc_np
        indices = np.concatenate(
            [np.zeros(0, dtype=np.int64)]
            + [
                batch.num_computed_np[i] + np.arange(starts[i + 1] - starts[i], dtype=np.int64)
                for i in range(len(batch.req_ids))
            ]
        )  # [T]: each row's token index (its [T] position)
        axes = np.repeat(indices[None, :], 3, axis=0)  # [3, T]
        for idx in with_images:
            rows = slice(int(starts[idx]), int(starts[idx + 1]))
            axes[:, rows] = self._request_positions(batch.req_ids[idx], states, indices[rows])
        return {"rope_positions": torch.from_numpy(axes).to(batch.positions.device)}

    def _request_positions(
        self, req_id: str, states: RequestStates, token_indices: np.ndarray
    ) -> np.ndarray:
        """[3, n] positions of one request's tokens at `token_indices`."""
        prompt = self.prompts.get(req_id)
        if prompt is None:
            assert self.positions_of_prompt is not None
            state = states.requests[req_id]
            num_prompt = len(state.prompt_token_ids)
            prompt = self.positions_of_prompt(num_prompt, state.mm_features)
            self.prompts[req_id] = prompt
        prompt_len = prompt.positions.shape[1]
        in_prompt = token_indices < prompt_len
        from_prompt = prompt.positions[:, np.minimum(token_indices, prompt_len - 1)]
        positions: np.ndarray = np.where(in_prompt, from_prompt, token_indices + prompt.delta)
        return positions
