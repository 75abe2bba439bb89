"""Images in prompts, as the scheduler handles them: prefix-cache keys carry each image's
identity, a step encodes at most its encoder budget of image positions, and a model whose image
tokens attend both ways never gets a chunk that ends inside an image."""

from __future__ import annotations

import pytest
from kv_cache_helpers import full, make_config, window
from scheduler_drive import make_request, make_scheduler, run_step
from scheduler_fake_runner import FakeModelRunner

from scheduler.image_chunks import limit_chunk
from scheduler.multimodal import MultiModalFeature
from scheduler.request import Request
from scheduler.scheduler import Scheduler

BLOCK = 4
IMAGE_TOKEN = 9


def _image(identifier: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature("image", identifier, offset, length)


def _prompt_with(features: list[MultiModalFeature], num_tokens: int) -> list[int]:
    prompt = [(3 * i + 1) % 50 + 10 for i in range(num_tokens)]
    for feature in features:
        prompt[feature.offset : feature.end] = [IMAGE_TOKEN] * feature.length
    return prompt


def _request(
    scheduler: Scheduler, req_id: str, features: list[MultiModalFeature], num_tokens: int
) -> Request:
    base = make_request(scheduler, req_id, _prompt_with(features, num_tokens), max_tokens=2)
    return Request(
        base.req_id,
        base.prompt_token_ids,
        base.sampling_params,
        base.hash_block_size,
        eos_token_id=base.eos_token_id,
        mm_features=tuple(features),
    )


def _scheduler(**config: object) -> Scheduler:
    kv = make_config(64, full(BLOCK), window(BLOCK, 8))
    return make_scheduler(kv, max_model_len=256, **config)


def _chunks(scheduler: Scheduler, request: Request) -> list[int]:
    """The chunk ends of `request`'s prefill, step by step."""
    runner = FakeModelRunner(scheduler.kv_cache_config)
    scheduler.add_request(request)
    ends, computed = [], 0
    while computed < request.num_prompt_tokens:
        scheduled, _ = run_step(scheduler, runner)
        computed += scheduled.get(request.req_id, 0)
        ends.append(computed)
    return ends


def test_the_same_image_hits_past_it_and_another_image_stops_the_hit_at_its_start() -> None:
    scheduler = _scheduler()
    runner = FakeModelRunner(scheduler.kv_cache_config)
    first = _request(scheduler, "a", [_image("cat", 6, 8)], 26)
    scheduler.add_request(first)
    while scheduler.has_unfinished_requests():
        run_step(scheduler, runner)
    same = _request(scheduler, "b", [_image("cat", 6, 8)], 26)
    other = _request(scheduler, "c", [_image("dog", 6, 8)], 26)
    assert same.prompt_token_ids == other.prompt_token_ids  # only the image differs
    assert scheduler.kv_cache_manager.get_computed_blocks(same).num_tokens == 24
    assert scheduler.kv_cache_manager.get_computed_blocks(other).num_tokens == 4


def test_whole_images_keep_every_chunk_end_out_of_an_image() -> None:
    images = [_image("cat", 5, 7), _image("dog", 14, 3)]
    whole = _chunks(
        _scheduler(whole_images=True, max_num_batched_tokens=8),
        _request(_scheduler(), "a", images, 30),
    )
    assert not any(5 < end < 12 or 14 < end < 17 for end in whole), whole
    split = _chunks(_scheduler(max_num_batched_tokens=8), _request(_scheduler(), "a", images, 30))
    assert any(5 < end < 12 or 14 < end < 17 for end in split), split


def test_a_step_encodes_at_most_its_encoder_budget() -> None:
    scheduler = _scheduler(encoder_budget=10, max_num_batched_tokens=64)
    runner = FakeModelRunner(scheduler.kv_cache_config)
    requests = [_request(scheduler, f"r{i}", [_image(f"img{i}", 2, 6)], 12) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    scheduled, _ = run_step(scheduler, runner)
    # one image of 6 positions fits the budget of 10; the others' chunks stop before theirs
    assert scheduled == {"r0": 12, "r1": 2, "r2": 2}
    scheduled, _ = run_step(scheduler, runner)
    assert scheduled["r1"] == 10  # its image encoded now; r2's waits for the next step
    assert "r2" not in scheduled


def test_a_chunk_starting_inside_an_image_after_a_hit_encodes_it() -> None:
    image = _image("cat", 2, 10)
    assert limit_chunk([image], 8, 8, first_chunk=True, whole_images=False, encoder_budget=9) == (
        0,
        0,
    )
    assert limit_chunk([image], 8, 8, first_chunk=False, whole_images=False, encoder_budget=9) == (
        8,
        0,
    )
    assert limit_chunk([image], 8, 2, first_chunk=False, whole_images=True, encoder_budget=9) == (
        0,
        0,
    )
    assert limit_chunk([image], 8, 4, first_chunk=False, whole_images=True, encoder_budget=9) == (
        4,
        0,
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"encoder_budget": 5}, "more than the encoder budget of 5"),
        (
            {"whole_images": True, "max_num_batched_tokens": 6, "encoder_budget": 64},
            "in one chunk of at most 6",
        ),
    ],
)
def test_an_image_no_step_could_take_is_refused_at_admission(config, message) -> None:
    scheduler = _scheduler(**config)
    with pytest.raises(ValueError, match=message):
        scheduler.add_request(_request(scheduler, "a", [_image("cat", 2, 8)], 16))
