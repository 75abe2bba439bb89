"""Stream batching through Ray Serve: under a fixed `stream_batching_interval_ms` the streamed
completion's chunks carry several tokens, while the first token and the final chunk are sent
as soon as they are made (an interval far longer than the request shows that neither waits)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cluster.serve import build_openai_app
from tests.helpers.serve_app import deployed, llm_config, save_tiny_served_model

pytestmark = pytest.mark.ray

INTERVAL_MS = 30_000
BODY = {"model": "tiny", "prompt": "t5 t17 t33", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def base_url(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir: Path = save_tiny_served_model(tmp_path_factory.mktemp("batched-model"))
    config = llm_config(model_dir)
    config["experimental_configs"] = {"stream_batching_interval_ms": INTERVAL_MS}
    app = build_openai_app({"llm_configs": [config], "topology": "one_hop"})
    with deployed(app, "batched") as address:
        yield address.base_url


def test_chunks_carry_several_tokens_and_the_first_and_final_are_not_held(base_url: str) -> None:
    body = {**BODY, "ignore_eos": True}
    whole = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()
    chunks = []
    start = time.monotonic()
    with httpx.stream(
        "POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: "))["choices"][0])
    elapsed = time.monotonic() - start
    texts = [chunk["text"] for chunk in chunks if chunk["text"]]
    assert [len(text.split()) for text in texts] == [1, 11]  # the first token alone, then all
    assert chunks[-1]["finish_reason"] == "length"
    assert "".join(texts) == whole["choices"][0]["text"]
    assert elapsed < INTERVAL_MS / 1000 / 2  # the final chunk did not wait for the interval
