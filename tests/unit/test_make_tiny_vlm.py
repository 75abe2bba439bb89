"""The README's tiny vision-language checkpoint: the script writes a folder the engine serves
with an image sent as a data URL in a chat message."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks import make_tiny_vlm
from cluster import LLM, SamplingParams
from tests.helpers.tiny_image_processor import data_url, image_part, random_image


def test_the_script_writes_a_checkpoint_that_answers_a_chat_with_an_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "tiny-vlm"
    monkeypatch.setattr(sys, "argv", ["make_tiny_vlm", str(folder)])
    make_tiny_vlm.main()
    llm = LLM(str(folder), dtype="float32", distributed_executor_backend="uni")
    try:
        content = [{"type": "text", "text": "t5 t6"}, image_part(data_url(random_image(0)))]
        (result,) = llm.chat(
            [{"role": "user", "content": content}], SamplingParams(temperature=0, max_tokens=4)
        )
    finally:
        llm.shutdown()
    assert len(result.outputs[0].token_ids) == 4
    assert result.prompt_token_ids.count(255) == 4  # the image's four placeholder positions
