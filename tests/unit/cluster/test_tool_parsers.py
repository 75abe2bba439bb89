"""Tool-call parsers on each family's format, and the stream that holds tool calls back."""

from __future__ import annotations

import json

import pytest

from cluster.openai_api.tool_output import ToolCallStream
from cluster.openai_api.tool_parsers import ParsedToolCall, get_tool_parser
from cluster.openai_api.tools import ToolCallPlan

WEATHER = ParsedToolCall("get_weather", json.dumps({"city": "Paris"}))
TIME = ParsedToolCall("get_time", json.dumps({"zone": "UTC"}))


@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [
        (
            "hermes",
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}'
            "</tool_call>",
            "Let me check.",
        ),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "parameters": {"zone": "UTC"}}',
            None,
        ),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
            None,
        ),
        (
            "mistral",
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
            '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}',
            None,
        ),
        (
            "openai",
            "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
            'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
            "<|call|><|start|>assistant<|channel|>commentary to=functions.get_time "
            '<|constrain|>json<|message|>{"zone": "UTC"}<|call|>',
            None,
        ),
    ],
)
def test_each_family_format_parses_into_calls(parser: str, text: str, content: str | None) -> None:
    parsed = get_tool_parser(parser).parse(text)
    assert parsed.calls == [WEATHER, TIME]
    assert parsed.content == content


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral", "openai"])
def test_plain_text_is_content(parser: str) -> None:
    parsed = get_tool_parser(parser).parse("The weather is fine.")
    assert parsed.calls == []
    assert parsed.content == "The weather is fine."


def test_gpt_oss_final_channel_is_the_content() -> None:
    text = (
        "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    )
    assert get_tool_parser("openai").parse(text).content == "Hi!"


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


def test_a_stream_shows_content_and_holds_the_call_back() -> None:
    stream = ToolCallStream(ToolCallPlan("auto", parser=get_tool_parser("hermes")))
    text = 'Checking <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    shown = [stream.feed(text[i : i + 3])[0] for i in range(0, len(text), 3)]
    assert "".join(shown) == "Checking "
    assert all("<" not in piece for piece in shown)  # a partial "<tool_call>" is held too
    rest, calls = stream.finish()
    assert rest == ""
    assert [(c.index, c.function.name, c.function.arguments) for c in calls if c.function] == [
        (0, "get_weather", WEATHER.arguments)
    ]


def test_a_stream_without_a_call_shows_everything() -> None:
    stream = ToolCallStream(ToolCallPlan("auto", parser=get_tool_parser("hermes")))
    shown = stream.feed("a <b")[0] + stream.feed("c> <tool")[0]
    rest, calls = stream.finish()
    assert shown + rest == "a <bc> <tool"
    assert calls == []


def test_a_named_call_streams_its_arguments_as_they_come() -> None:
    stream = ToolCallStream(ToolCallPlan("named", function="get_weather"))
    pieces = [stream.feed(piece) for piece in ['{"city"', ': "Par', 'is"}']]
    assert all(content == "" for content, _ in pieces)
    first, *rest = [call for _, calls in pieces for call in calls]
    assert first.id is not None
    assert first.function is not None
    assert first.function.name == "get_weather"
    assert [c.id for c in rest] == [None, None]
    arguments = "".join(c.function.arguments or "" for c in [first, *rest] if c.function)
    assert arguments == WEATHER.arguments
    assert stream.finish() == ("", [])
    assert stream.made_calls
