"""The runner's image side over chunked prefills and prefix hits: each chunk takes the encoder rows
of the image positions it covers, an image is encoded once while requests still need it, and a
model whose image tokens attend both ways gets per-row key ends (and a clear error when an
image is split across steps). The encoder is a stand-in whose rows name image and row."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scheduler.multimodal import MultiModalFeature
from scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.request import SamplingParams
from worker.attention.block_table import MultiGroupBlockTable
from worker.input_batch import RequestStates, build_input_batch
from worker.multimodal import ImageStep

HIDDEN = 3
IMAGE = MultiModalFeature("image", "cat", offset=2, length=6)
PROMPT = [1, 2, 9, 9, 9, 9, 9, 9, 3, 4, 5, 6]  # the image fills positions [2, 8)


class RowNamingEncoder(nn.Module):
    """embed_images: row r of image `identifier` is 1000 * len(identifier) + r; text: -token."""

    def __init__(self, bidirectional: bool) -> None:
        super().__init__()
        self.takes_images = True
        self.bidirectional_images = bidirectional
        self.calls: list[list[str]] = []

    def embed_images(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        self.calls.append([feature.identifier for feature in features])
        return [
            (1000.0 * len(f.identifier) + torch.arange(f.length))[:, None].expand(-1, HIDDEN)
            for f in features
        ]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (-input_ids.float())[:, None].expand(-1, HIDDEN).clone()


def _states() -> RequestStates:
    tables = MultiGroupBlockTable((4,), (4,), max_num_reqs=4, max_model_len=32)
    return RequestStates(tables, torch.device("cpu"))


def _new(req_id: str, num_computed: int = 0) -> NewRequestData:
    return NewRequestData(
        req_id,
        PROMPT,
        SamplingParams(temperature=0),
        ([0, 1, 2],),
        num_computed,
        mm_features=(IMAGE,),
    )


def _step(states, step, new=(), cached=(), scheduled=None):  # type: ignore[no-untyped-def]
    out = SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=list(cached),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        num_common_prefix_blocks=(0,),
        finished_req_ids=frozenset(),
    )
    states.update(out)
    batch = build_input_batch(list(scheduled), states, scheduled)
    return step.prepare(batch, states)


def _first_column(inputs: dict[str, torch.Tensor]) -> list[int]:
    return inputs["inputs_embeds"][:, 0].long().tolist()


def test_chunks_take_their_rows_of_one_encoding_and_a_prefix_hit_the_rest() -> None:
    model, states = RowNamingEncoder(bidirectional=False), _states()
    step = ImageStep(model, torch.device("cpu"))
    _, inputs = _step(states, step, new=[_new("a")], scheduled={"a": 5})
    assert _first_column(inputs) == [-1, -2, 3000, 3001, 3002]
    # a's second chunk and b, a prefix hit to position 4 (inside the image), in one step
    _, inputs = _step(
        states, step, new=[_new("b", 4)], cached=[CachedRequestData("a", 5, [], None)],
        scheduled={"a": 4, "b": 5},
    )  # fmt: skip
    assert _first_column(inputs) == [3003, 3004, 3005, -3, 3002, 3003, 3004, 3005, -3]
    assert model.calls == [["cat"]]  # encoded once for both requests and both chunks
    assert len(step.cache) == 1
    past = [CachedRequestData("a", 9, [], None), CachedRequestData("b", 9, [], None)]
    _, inputs = _step(states, step, cached=past, scheduled={"a": 1, "b": 1})
    assert inputs == {}
    assert len(step.cache) == 0  # both past the image: dropped


def test_images_attending_both_ways_get_key_ends_and_are_never_split() -> None:
    model, states = RowNamingEncoder(bidirectional=True), _states()
    step = ImageStep(model, torch.device("cpu"))
    batch, _ = _step(states, step, new=[_new("a")], scheduled={"a": 9})
    assert batch.key_ends is not None
    assert batch.key_ends.tolist() == [1, 2, 8, 8, 8, 8, 8, 8, 9]
    with pytest.raises(RuntimeError, match=r"rows \[0, 3\) of the image at \[2, 8\)"):
        _step(states, step, new=[_new("b")], scheduled={"b": 5})
