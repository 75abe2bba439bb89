"""gpt-oss (the harmony format): a call is a `commentary` message addressed to
`functions.<name>`, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
<|call|>`; the text the user reads is the `final` channel's message.

The reply's special tokens must be kept in the text (`skip_special_tokens=False`); when they
were skipped, the bare words (`commentary to=functions.NAME json{...}`) parse the same.
"""

from __future__ import annotations

import json
import re

from cluster.openai_api.tool_parsers.base import ParsedOutput, ParsedToolCall, json_values

_CALL = re.compile(r"to=functions\.([A-Za-z0-9_\-]+)")
_FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|end\|>|<\|return\|>|$)", re.DOTALL)


class GptOssToolParser:
    start_markers: tuple[str, ...] = ("to=functions.",)

    def parse(self, text: str) -> ParsedOutput:
        calls = []
        for match in _CALL.finditer(text):
            brace = text.find("{", match.end())
            values = json_values(text[brace:]) if brace >= 0 else []
            if values:
                calls.append(ParsedToolCall(match.group(1), json.dumps(values[0])))
        final = _FINAL.search(text)
        content = final.group(1).strip() if final else None
        if not calls:
            return ParsedOutput(text if final is None else content)
        return ParsedOutput(content or None, calls)
