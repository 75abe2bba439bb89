"""Structured outputs and tool calls through the replica's OpenAI layer (`LLMServer` with an
in-process engine, no Ray), on the tiny byte-level model: response_format, vLLM's
structured_outputs body, tool_choice required / named / auto, streamed tool calls, and the 400s."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from cluster.engine.structured import manager as structured_manager
from cluster.openai_api.protocol import ChatCompletionRequest, ErrorResponse
from cluster.serve.llm_server import LLMServer
from tests.helpers.byte_model import save_byte_model

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather?"}]
HERMES_CALL = (
    r'Sure\. <tool_call>\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Rome)", "days": [1-9]\}\}</tool_call>'
)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for the module: the replica's engine loop is bound to it."""
    event_loop = asyncio.new_event_loop()
    yield event_loop
    event_loop.close()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, loop: asyncio.AbstractEventLoop
) -> Iterator[LLMServer]:
    model = save_byte_model(tmp_path_factory.mktemp("byte-model"))
    config = {
        "model_loading_config": {"model_id": "byte", "model_source": str(model)},
        "engine_kwargs": {
            "block_size": 16,
            "kv_cache_memory_bytes": 16 << 20,
            "distributed_executor_backend": "uni",
        },
        "log_engine_metrics": False,
    }
    replica = LLMServer(config)
    replica.loop = loop  # type: ignore[attr-defined]
    yield replica
    loop.run_until_complete(replica.engine.shutdown())


def ask(server: LLMServer, **body: Any) -> list[Any]:
    request = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "max_tokens": 120, "temperature": 0, **body}
    )

    async def collect() -> list[Any]:
        return [item async for item in server.generate(request, "r", as_sse=False)]

    return server.loop.run_until_complete(asyncio.wait_for(collect(), 60))  # type: ignore[attr-defined]


def reply(server: LLMServer, **body: Any) -> Any:
    (response,) = ask(server, **body)
    assert not isinstance(response, ErrorResponse), response
    return response.choices[0]


def test_response_format_json_schema_and_json_object(server: LLMServer) -> None:
    schema_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    choice = reply(server, response_format=schema_format)
    jsonschema.validate(json.loads(choice.message.content), WEATHER)
    choice = reply(server, response_format={"type": "json_object"}, max_tokens=300, seed=1)
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content, strict=False), dict)


def test_the_structured_outputs_extra_body(server: LLMServer) -> None:
    assert reply(server, structured_outputs={"choice": ["red", "blue"]}).message.content in (
        "red",
        "blue",
    )
    text = reply(server, structured_outputs={"regex": "[a-f]{4}"}).message.content
    assert len(text) == 4
    assert set(text) <= set("abcdef")


def test_required_tool_choice_gives_valid_calls(server: LLMServer) -> None:
    sampled = [{"temperature": 1.0, "seed": seed, "parallel_tool_calls": False} for seed in (1, 2)]
    for options in [{"max_tokens": 400}, *sampled]:
        choice = reply(server, tools=TOOLS, tool_choice="required", **options)
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_tool_choice_calls_that_function(server: LLMServer) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = reply(server, tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), TIME)
    assert choice.message.content is None


def test_tool_choice_none_leaves_the_reply_as_text(server: LLMServer) -> None:
    forced = {"regex": HERMES_CALL}
    choice = reply(server, tools=TOOLS, tool_choice="none", structured_outputs=forced)
    assert choice.message.tool_calls == []
    assert choice.message.content.startswith("Sure. <tool_call>")
    assert choice.finish_reason == "stop"


def test_auto_tool_choice_parses_the_family_format(server: LLMServer) -> None:
    forced = {"regex": HERMES_CALL}
    choice = reply(server, tools=TOOLS, structured_outputs=forced)
    assert choice.message.content == "Sure."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_streamed_tool_calls_come_as_delta_tool_calls(server: LLMServer) -> None:
    chunks = ask(server, tools=TOOLS, structured_outputs={"regex": HERMES_CALL}, stream=True)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert content == "Sure. "
    (call,) = calls
    assert call.index == 0
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    chunks = ask(server, tools=TOOLS, tool_choice="required", stream=True)
    calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert calls
    assert all(
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name]) is None
        for c in calls
    )


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"structured_outputs": {"regex": "(ab"}}, "regex"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "grammar"),
        ({"structured_outputs": {"json": {"type": "nonsense"}}}, "nonsense"),
        ({"structured_outputs": {"pattern": "x"}}, "structured_outputs"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "x"),
        ({"tool_choice": "required"}, "tools"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "only one",
        ),
    ],
)
def test_invalid_constraints_are_400s_naming_the_problem(
    server: LLMServer, body: dict[str, Any], needle: str
) -> None:
    (response,) = ask(server, **body)
    assert isinstance(response, ErrorResponse)
    assert response.status == 400
    assert needle in response.error.message
    assert response.error.type == "invalid_request_error"


def test_a_constraint_cut_by_max_tokens_ends_with_length(server: LLMServer) -> None:
    choice = reply(server, structured_outputs={"regex": "z{40}"}, max_tokens=6)
    assert choice.finish_reason == "length"
    assert choice.message.content == "z" * 6


class HeldCompiles:
    """Wraps `manager._parse` so that each compile (in the compile thread) waits for `release`;
    `started` and `done` tell the test where the compile is, so nothing waits on the clock."""

    WAIT_S = 60.0  # a bound for a stuck test, never reached when the code works

    def __init__(self, manager: Any) -> None:
        self.parse = manager._parse
        self.started = threading.Event()
        self.release = threading.Event()
        self.done = threading.Event()

    def __call__(self, name: str, constraint: Any) -> Any:
        compile_now = self.parse(name, constraint)

        def held_compile() -> Any:
            self.started.set()
            self.release.wait(self.WAIT_S)
            try:
                return compile_now()
            finally:
                self.done.set()

        return held_compile


def test_a_compile_slower_than_the_timeout_is_a_400(
    server: LLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = server.engine.core.structured
    held = HeldCompiles(manager)
    monkeypatch.setattr(manager, "_parse", held)
    monkeypatch.setattr(structured_manager, "COMPILE_TIMEOUT_S", 0.3)
    try:
        (response,) = ask(server, structured_outputs={"regex": "[p-q]{7}"})
        assert held.started.is_set()
        assert not held.done.is_set()  # the compile is still held when the request gives up
    finally:
        held.release.set()
        assert held.done.wait(held.WAIT_S)  # the compile thread is free again for the next tests
    assert isinstance(response, ErrorResponse)
    assert response.status == 400
    assert "did not compile within 0.3 s" in response.error.message


def test_a_slow_compile_does_not_stall_other_requests(
    server: LLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The constraint's compile is held (in the compile thread) until a plain request sent after
    it has finished; the constrained one then still gets its grammar."""
    manager = server.engine.core.structured
    held = HeldCompiles(manager)
    monkeypatch.setattr(manager, "_parse", held)
    slow = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "max_tokens": 8, "structured_outputs": {"regex": "[g-k]{5}"}}
    )
    plain = ChatCompletionRequest.model_validate({"messages": MESSAGES, "max_tokens": 8})

    async def run(request: ChatCompletionRequest, name: str) -> Any:
        items = [item async for item in server.generate(request, name, as_sse=False)]
        return items[0]

    async def both() -> list[Any]:
        constrained_task = asyncio.ensure_future(run(slow, "slow"))
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, held.started.wait, held.WAIT_S)
        plain_reply = await run(plain, "plain")
        held_while_plain_ran = not held.done.is_set()
        held.release.set()
        slow_reply = await constrained_task
        assert held_while_plain_ran, "the plain request waited for the compile"
        return [plain_reply, slow_reply]

    try:
        plain_reply, slow_reply = server.loop.run_until_complete(both())  # type: ignore[attr-defined]
    finally:
        held.release.set()
    text = slow_reply.choices[0].message.content
    assert len(text) == 5
    assert set(text) <= set("ghijk")
    assert plain_reply.choices[0].message.content is not None
