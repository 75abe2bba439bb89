"""Tool-call parsers per model family: model text -> content and `tool_calls`.

| name | families | format |
|---|---|---|
| `hermes` (`qwen`) | Hermes, Qwen 2.5 / 3 | `<tool_call>{"name", "arguments"}</tool_call>` |
| `llama3_json` | Llama 3.1 / 3.2 / 3.3 | `{"name", "parameters"}` (after `<|python_tag|>`) |
| `mistral` | Mistral | `[TOOL_CALLS][{"name", "arguments"}]` or `[TOOL_CALLS]name[ARGS]{...}` |
| `openai` (`gpt_oss`) | gpt-oss | harmony `commentary to=functions.NAME ... {...}` |
"""

from __future__ import annotations

from collections.abc import Callable

from cluster.openai_api.tool_parsers.base import ParsedOutput, ParsedToolCall, ToolParser
from cluster.openai_api.tool_parsers.gpt_oss import GptOssToolParser
from cluster.openai_api.tool_parsers.hermes import HermesToolParser
from cluster.openai_api.tool_parsers.llama3 import Llama3JsonToolParser
from cluster.openai_api.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "openai": GptOssToolParser,
    "gpt_oss": GptOssToolParser,
}
DEFAULT_TOOL_PARSER = "hermes"


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool_call_parser {name!r}; choose one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


__all__ = [
    "DEFAULT_TOOL_PARSER",
    "TOOL_PARSERS",
    "ParsedOutput",
    "ParsedToolCall",
    "ToolParser",
    "get_tool_parser",
]
