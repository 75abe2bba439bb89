"""`LLM`, the Serve replica (`LLMServer`) and the batch replica (`EngineReplica`) process inputs
through one input processor: the same bad input gets the same message from each, and a batch
OpenAI line accepts what the HTTP API accepts (stop strings, penalties) with the same tokens.

All three run in-process here (the replica classes are plain classes; Ray only hosts them).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster import LLM, SamplingParams
from cluster.batch.replica import EngineReplica
from cluster.batch.rows import parse_line
from cluster.openai_api.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from cluster.serve.llm_server import LLMServer
from tests.helpers.serve_app import llm_config, save_tiny_served_model

ENGINE = {"distributed_executor_backend": "uni", "block_size": 4, "max_model_len": 64}
TOO_LONG = " ".join(["t5"] * 80)


@pytest.fixture(scope="module")
def fronts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LLM, LLMServer, Any]]:
    model = save_tiny_served_model(tmp_path_factory.mktemp("tiny"))
    llm = LLM(str(model), **ENGINE)
    server = LLMServer(llm_config(model, **ENGINE))
    replica = EngineReplica(_engine_args(model))
    yield llm, server, replica
    llm.shutdown()
    server.engine.core.shutdown()
    replica.client.shutdown()


def _engine_args(model: Path) -> Any:
    from cluster.config.engine_args import validate_engine_kwargs

    return validate_engine_kwargs({"model": str(model), **ENGINE})


def _first_item(server: LLMServer, body: dict[str, Any]) -> Any:
    """The first body `LLMServer.generate` yields for an OpenAI request body."""
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    request = model.model_validate({"model": "tiny", **body})

    async def first() -> Any:
        async for item in server.generate(request, "r1"):
            return item
        return None

    return asyncio.run(first())


def _server_error(server: LLMServer, body: dict[str, Any]) -> str:
    item = _first_item(server, body)
    assert isinstance(item, ErrorResponse), item
    return item.error.message


def _batch_row(replica: Any, line: dict[str, Any]) -> dict[str, Any]:
    record = parse_line(0, json.dumps(line)).to_record()["item"]
    rows = replica({"item": np.array([record], dtype=object)})["row"]
    return dict(json.loads(rows[0]))


def _llm_error(call: Any) -> str:
    with pytest.raises((ValueError, TypeError)) as caught:
        call()
    return str(caught.value).removeprefix("prompt 0: ")


@pytest.mark.parametrize(
    ("llm_input", "body"),
    [
        ({"prompt_token_ids": [1, 9999]}, {"prompt": [1, 9999]}),
        ({"prompt": TOO_LONG}, {"prompt": TOO_LONG, "max_tokens": 1}),
        ([{"role": "user", "content": [{"type": "image_url"}]}], None),
    ],
)
def test_the_same_bad_input_gets_the_same_message_everywhere(
    fronts: tuple[LLM, LLMServer, Any], llm_input: Any, body: dict[str, Any] | None
) -> None:
    llm, server, replica = fronts
    if isinstance(llm_input, list):  # a conversation
        body = {"messages": llm_input, "max_tokens": 1}
        llm_message = _llm_error(lambda: llm.chat(llm_input, SamplingParams(max_tokens=1)))
        row = {"custom_id": 1, "url": "/v1/chat/completions", "body": body}
    else:
        llm_message = _llm_error(lambda: llm.generate(llm_input, SamplingParams(max_tokens=1)))
        row = {"custom_id": 1, "url": "/v1/completions", "body": body}
    assert body is not None
    server_message = _server_error(server, body)
    batch_message = _batch_row(replica, row)["error"]
    assert server_message.removeprefix("prompt 0: ") == batch_message.removeprefix("prompt 0: ")
    if "too large" not in server_message and "context length" not in server_message:
        assert llm_message in server_message


def test_a_batch_openai_line_runs_as_the_http_api_would(fronts: tuple[LLM, LLMServer, Any]) -> None:
    _, server, replica = fronts
    body = {
        "prompt": "t5 t6 t7",
        "max_tokens": 12,
        "temperature": 0,
        "stop": ["t9"],
        "presence_penalty": 1.5,
        "frequency_penalty": 0.5,
    }
    row = _batch_row(replica, {"custom_id": "a", "url": "/v1/completions", "body": body})
    assert "error" not in row, row
    response = _first_item(server, body)
    assert row["generated_text"] == response.choices[0].text
    assert row["finish_reason"] == response.choices[0].finish_reason
