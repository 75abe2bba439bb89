"""LoRA adapters through the fronts: the Serve replica (`model="<base>:<adapter>"`, adapter cards,
400s naming a bad adapter) and the batch replica (a `lora_request` column). In-process."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoModelForCausalLM

from cluster.batch.replica import EngineReplica
from cluster.batch.rows import parse_line
from cluster.config.engine_args import validate_engine_kwargs
from cluster.config.lora import LoraConfig
from cluster.openai_api.protocol import CompletionRequest, ErrorResponse
from cluster.serve.llm_server import LLMServer
from scheduler.lora import LoRARequest
from tests.helpers.serve_app import llm_config, save_tiny_served_model
from tests.helpers.tiny_lora import save_random_adapter

ENGINE = {"distributed_executor_backend": "uni", "block_size": 4, "max_model_len": 64}
PROMPT = "t5 t9 t33 t7 t100 t42"
LOOP = asyncio.new_event_loop()
"""One loop for every call: a replica's engine task lives on the loop that first used it."""


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora_fronts")
    model = save_tiny_served_model(root / "base")
    hf_model = AutoModelForCausalLM.from_pretrained(model)
    for seed, name in enumerate(("one", "two"), start=1):
        save_random_adapter(hf_model, root / "adapters" / name, seed=seed)
    return model, root / "adapters"


@pytest.fixture(scope="module")
def server(adapters: tuple[Path, Path]) -> Iterator[LLMServer]:
    model, folder = adapters
    config = llm_config(model, **ENGINE, max_loras=2)
    config["lora_config"] = {"dynamic_lora_loading_path": str(folder)}
    server = LLMServer(config)
    yield server
    server.engine.core.shutdown()


def _first(server: LLMServer, model: str) -> Any:
    request = CompletionRequest.model_validate(
        {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    )

    async def first() -> Any:
        async for item in server.generate(request, f"r-{model}", as_sse=False):
            return item
        return None

    return LOOP.run_until_complete(first())


def test_base_and_adapters_answer_under_their_model_names(server: LLMServer) -> None:
    texts = {}
    for model in ("tiny", "tiny:one", "tiny:two"):
        item = _first(server, model)
        assert not isinstance(item, ErrorResponse), item
        assert item.model == "tiny"
        texts[model] = item.choices[0].text
    assert len(set(texts.values())) == 3  # each adapter changes the answer


def test_a_missing_adapter_is_a_400_naming_it_and_nothing_else_breaks(server: LLMServer) -> None:
    error = _first(server, "tiny:missing")
    assert isinstance(error, ErrorResponse)
    assert error.status == 400
    assert "'missing'" in error.error.message
    assert not isinstance(_first(server, "tiny:one"), ErrorResponse)


def test_model_cards_list_the_adapters(server: LLMServer) -> None:
    cards = LOOP.run_until_complete(server.model_cards())
    assert [card.id for card in cards] == ["tiny", "tiny:one", "tiny:two"]
    assert {card.parent for card in cards[1:]} == {"tiny"}


def test_batch_rows_take_a_lora_request_column_and_a_bad_one_fails_only_its_row(
    adapters: tuple[Path, Path], server: LLMServer
) -> None:
    model, folder = adapters
    replica = EngineReplica(
        validate_engine_kwargs({"model": str(model), **ENGINE, "enable_lora": True})
    )
    params = {"max_tokens": 6, "temperature": 0}
    lines = [
        {"id": 0, "prompt": PROMPT, "sampling_params": params},
        {
            "id": 1,
            "prompt": PROMPT,
            "sampling_params": params,
            "lora_request": {"lora_name": "one", "lora_path": str(folder / "one")},
        },
        {
            "id": 2,
            "prompt": PROMPT,
            "sampling_params": params,
            "lora_request": {"lora_name": "gone", "lora_path": str(folder / "gone")},
        },
    ]
    records = [parse_line(i, json.dumps(line)).to_record()["item"] for i, line in enumerate(lines)]
    rows = [json.loads(row) for row in replica({"item": np.array(records, dtype=object)})["row"]]
    replica.client.shutdown()
    assert rows[0]["generated_text"] == _first(server, "tiny").choices[0].text
    assert rows[1]["generated_text"] == _first(server, "tiny:one").choices[0].text
    assert "'gone'" in rows[2]["error"]


def test_a_model_without_lora_config_refuses_adapter_names(adapters: tuple[Path, Path]) -> None:
    server = LLMServer(llm_config(adapters[0], **ENGINE))
    try:
        error = _first(server, "tiny:one")
        assert isinstance(error, ErrorResponse)
        assert "serves no LoRA adapters" in error.error.message
    finally:
        server.engine.core.shutdown()


def test_a_hub_adapter_already_loaded_is_not_fetched_again_per_request(
    server: LLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    fetched: list[str] = []

    def hub_snapshot(repo_id: str, cache_dir: str | None = None) -> Path:
        fetched.append(repo_id)
        raise ValueError(f"{repo_id} is not on the Hub")

    monkeypatch.setattr("cluster.model_download.hub_snapshot", hub_snapshot)
    hub = LoraConfig(dynamic_lora_loading_path="hf://owner")
    monkeypatch.setattr(server, "config", server.config.model_copy(update={"lora_config": hub}))
    loaded = LoRARequest("one", 0, "/cache/owner--one")
    monkeypatch.setitem(server.engine.core.loras, "one", loaded)
    assert server._lora_request("tiny:one") is loaded
    assert fetched == []
    with pytest.raises(ValueError, match="owner/other"):
        server._lora_request("tiny:other")
    assert fetched == ["owner/other"]
