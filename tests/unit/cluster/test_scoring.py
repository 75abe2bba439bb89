"""Scoring through the OpenAI API, on the Serve replica's own class in-process (no Ray):
`echo` with `logprobs` in OpenAI's legacy format, vLLM's `prompt_logprobs`, batched prompts,
`max_tokens=0`, and the exact request an evaluation harness (lm-evaluation-harness's
`local-completions`) sends, against transformers' log-softmax over the same weights."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.batch.rows import parse_line
from cluster.openai_api.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from cluster.serve.llm_server import LLMServer
from tests.helpers.serve_app import llm_config, save_tiny_served_model

ENGINE = {"distributed_executor_backend": "uni", "block_size": 4, "max_model_len": 128}
PROMPT = "t5 t17 t33 t2 t9 t40 t41"
IDS = [5, 17, 33, 2, 9, 40, 41]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_served_model(tmp_path_factory.mktemp("tiny"))


LOOP = asyncio.new_event_loop()
"""One event loop for every call: the replica's engine binds its events to the first it runs on."""


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[LLMServer]:
    server = LLMServer(llm_config(model_dir, **ENGINE))
    yield server
    server.engine.core.shutdown()


@pytest.fixture(scope="module")
def transformers_model(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _log_softmax(model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax over `ids`: row i scores token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture(scope="module")
def reference_logprobs(transformers_model: Any) -> torch.Tensor:
    return _log_softmax(transformers_model, IDS)


def _items(server: LLMServer, body: dict[str, Any]) -> list[Any]:
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    request = model.model_validate({"model": "tiny", **body})

    async def collect() -> list[Any]:
        return [item async for item in server.generate(request, "r", as_sse=False)]

    return LOOP.run_until_complete(collect())


def _one(server: LLMServer, body: dict[str, Any]) -> Any:
    (item,) = _items(server, body)
    assert not isinstance(item, ErrorResponse), item
    return item.model_dump()


def _expected(reference: torch.Tensor) -> list[float]:
    return [float(reference[i, IDS[i + 1]]) for i in range(len(IDS) - 1)]


@pytest.mark.parametrize("prompt", [PROMPT, IDS])
def test_echo_with_logprobs_scores_the_prompt_like_transformers(
    server: LLMServer, reference_logprobs: torch.Tensor, prompt: Any
) -> None:
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0}
    choice = _one(server, body)["choices"][0]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"][: len(IDS)] == PROMPT.split()
    assert len(logprobs["tokens"]) == len(IDS) + 3
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    scored = logprobs["token_logprobs"][1 : len(IDS)]
    assert scored == pytest.approx(_expected(reference_logprobs), abs=1e-4)
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"][1:])
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert logprobs["text_offset"][0] == 0
    assert choice["text"].startswith(PROMPT)


def test_the_harness_request_shape(server: LLMServer, reference_logprobs: torch.Tensor) -> None:
    """lm-evaluation-harness's loglikelihood request: token IDs in a one-element batch, one
    token generated; it sums `token_logprobs[ctxlen:-1]` and checks greediness against the
    top logprob at each position."""
    body = {"prompt": [IDS], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}  # fmt: skip
    (choice,) = _one(server, body)["choices"]
    ctxlen = 4
    continuation = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    want = _expected(reference_logprobs)[ctxlen - 1 :]
    assert sum(continuation) == pytest.approx(sum(want), abs=1e-4)
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    greedy = [max(top.values()) for top in tops]
    best = [float(reference_logprobs[i].max()) for i in range(ctxlen - 1, len(IDS) - 1)]
    assert greedy == pytest.approx(best, abs=1e-4)


def test_max_tokens_zero_echoes_only_the_scored_prompt(server: LLMServer) -> None:
    body = {"prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 0}
    response = _one(server, body)
    (choice,) = response["choices"]
    assert choice["text"] == PROMPT
    assert choice["logprobs"]["tokens"] == PROMPT.split()
    assert response["usage"]["completion_tokens"] == 0
    with pytest.raises(ValidationError, match="max_tokens must be at least 1"):
        CompletionRequest.model_validate({"prompt": PROMPT, "max_tokens": 0})


def test_a_batch_of_prompts_answers_one_choice_per_prompt(server: LLMServer) -> None:
    prompts = [PROMPT, "t100 t3 t4", "t7 t7 t8"]
    body = {"echo": True, "logprobs": 1, "max_tokens": 2, "temperature": 0}
    singles = [_one(server, {**body, "prompt": prompt})["choices"][0] for prompt in prompts]
    batch = _one(server, {**body, "prompt": prompts, "n": 2})
    assert [choice["index"] for choice in batch["choices"]] == list(range(6))
    for index, single in enumerate(singles):
        for choice in batch["choices"][2 * index : 2 * index + 2]:
            assert choice["text"] == single["text"]
            got, want = choice["logprobs"]["token_logprobs"], single["logprobs"]["token_logprobs"]
            assert got[0] is want[0] is None
            assert got[1:] == pytest.approx(want[1:], abs=1e-5)  # batched with other prompts
    assert batch["usage"]["prompt_tokens"] == 7 + 3 + 3
    assert batch["usage"]["completion_tokens"] == 3 * 2 * 2


def test_a_streamed_batch_with_echo_matches_the_whole_response(server: LLMServer) -> None:
    prompts = [PROMPT, "t100 t3 t4"]
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0}
    whole = _one(server, body)
    chunks = _items(server, {**body, "stream": True, "stream_options": {"include_usage": True}})
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
    for choice in whole["choices"]:
        assert texts[choice["index"]] == choice["text"]
        assert tokens[choice["index"]] == choice["logprobs"]["tokens"]
    assert chunks[-1].usage.completion_tokens == whole["usage"]["completion_tokens"]


def test_prompt_logprobs_field_on_completions_and_chat(
    server: LLMServer, model_dir: Path, reference_logprobs: torch.Tensor, transformers_model: Any
) -> None:
    choice = _one(server, {"prompt": PROMPT, "prompt_logprobs": 1, "max_tokens": 1})["choices"][0]
    positions = choice["prompt_logprobs"]
    assert positions[0] is None
    assert len(positions) == len(IDS)
    got = [positions[i + 1][str(IDS[i + 1])]["logprob"] for i in range(len(IDS) - 1)]
    assert got == pytest.approx(_expected(reference_logprobs), abs=1e-4)
    messages = [{"role": "user", "content": "t9 t10"}]
    chat = _one(server, {"messages": messages, "prompt_logprobs": 0, "max_tokens": 1})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)  # the chat template, rendered by HF
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer(text, add_special_tokens=False).input_ids
    want = _log_softmax(transformers_model, chat_ids)
    positions = chat["prompt_logprobs"]
    assert len(positions) == len(chat_ids)
    assert positions[0] is None
    for index, position in enumerate(positions[1:]):
        token_id = chat_ids[index + 1]
        assert list(position) == [str(token_id)]  # 0 alternatives: the prompt's token only
        expected = float(want[index, token_id])
        assert position[str(token_id)]["logprob"] == pytest.approx(expected, abs=1e-4)


def test_an_unknown_field_is_ignored_with_a_warning(
    server: LLMServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        _one(server, {"prompt": PROMPT, "max_tokens": 1, "best_guess": 3})
    assert "best_guess" in caplog.text


@pytest.mark.parametrize(("field", "value"), [("suffix", "t9"), ("best_of", 3)])
def test_a_known_field_the_engine_cannot_honour_is_a_400(
    server: LLMServer, field: str, value: Any
) -> None:
    (item,) = _items(server, {"prompt": PROMPT, "max_tokens": 1, field: value})
    assert isinstance(item, ErrorResponse)
    assert item.error.param == field


@pytest.fixture(scope="module")
def replica(model_dir: Path) -> Iterator[Any]:
    from cluster.batch.replica import EngineReplica
    from cluster.config.engine_args import validate_engine_kwargs

    replica = EngineReplica(validate_engine_kwargs({"model": str(model_dir), **ENGINE}))
    yield replica
    replica.client.shutdown()


def _batch_rows(replica: Any, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    records = [parse_line(i, json.dumps(line)).to_record()["item"] for i, line in enumerate(lines)]
    rows = replica({"item": np.array(records, dtype=object)})["row"]
    return [json.loads(row) for row in rows]


def test_batch_rows_carry_prompt_logprobs(replica: Any, reference_logprobs: torch.Tensor) -> None:
    """A Ray Data LLM row and an OpenAI batch line ask for prompt logprobs and get the column;
    a batch line with several prompts is an error row (one output row per line)."""
    body = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0}
    row, line, several = _batch_rows(replica, [
        {"prompt": PROMPT, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}},
        {"custom_id": "a", "url": "/v1/completions", "body": body},
        {"custom_id": "b", "url": "/v1/completions", "body": {**body, "prompt": [PROMPT, "t9"]}},
    ])  # fmt: skip
    for scored in (row, line):
        positions = scored["prompt_logprobs"]
        assert positions[0] is None
        got = [positions[i + 1][str(IDS[i + 1])]["logprob"] for i in range(len(IDS) - 1)]
        assert got == pytest.approx(_expected(reference_logprobs), abs=1e-4)
    assert "one prompt" in several["error"]


def test_a_chat_stream_carries_the_prompt_logprobs_once(server: LLMServer) -> None:
    body = {"messages": [{"role": "user", "content": "t9 t10"}], "prompt_logprobs": 0,
            "max_tokens": 3, "stream": True}  # fmt: skip
    chunks = _items(server, body)
    carrying = [chunk for chunk in chunks if chunk.prompt_logprobs is not None]
    assert len(carrying) == 1
    whole = _one(server, {**body, "stream": False})
    assert [position is None for position in carrying[0].prompt_logprobs] == [
        position is None for position in whole["prompt_logprobs"]
    ]
