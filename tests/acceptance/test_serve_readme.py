"""The README's first path: `make serve` (= `hybridserve serve`), its `curl` and `openai`
examples (also the JSON-schema and scoring ones, and the tool-calling script of the structured
outputs page), and Ctrl-C, with either HTTP ingress (HAProxy, Serve's Python proxy); on this
machine's own CPU count, with no Ray cluster started beforehand.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import jsonschema
import pytest

from tests.acceptance.conftest import serve_command, serve_port
from tests.helpers.cli_process import CliProcess, session_processes
from tests.helpers.readme import README, code_block

pytestmark = pytest.mark.ray

STRUCTURED_OUTPUTS_PAGE = "docs/structured-outputs.md"

READY_TIMEOUT_S = 240.0
"""The first start on a fresh machine converts the embedded model (about half a minute)."""


def _curl_example(port: int) -> str:
    block = code_block("curl http://127.0.0.1:8000/v1/chat/completions", "bash", README)
    return block.replace("127.0.0.1:8000", f"127.0.0.1:{port}")


def _json_schema_example(port: int) -> str:
    block = code_block('"response_format"', "bash", README)
    return block.replace("127.0.0.1:8000", f"127.0.0.1:{port}")


def _tool_call_example(port: int) -> str:
    block = code_block("tool_choice=", "python", STRUCTURED_OUTPUTS_PAGE)
    return block.replace("127.0.0.1:8000", f"127.0.0.1:{port}")


def _check_structured_examples(port: int) -> None:
    """The README's JSON-schema `curl` gives JSON valid for its schema; the structured outputs
    page's tool-calling script prints calls whose arguments are valid for the function's
    parameters."""
    example = _json_schema_example(port)
    reply = subprocess.run(["bash", "-c", example], capture_output=True, text=True, timeout=120)
    body = json.loads(reply.stdout)
    request = json.loads(example.split("-d '", 1)[1].rsplit("'", 1)[0])
    schema = request["response_format"]["json_schema"]["schema"]
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)

    calls: list[tuple[object, ...]] = []
    script = _tool_call_example(port)
    exec(compile(script, "readme_tools.py", "exec"), {"print": lambda *a: calls.append(a)})
    assert calls, "the tool-calling example printed no call"
    for name, arguments in calls:
        assert name == "get_weather"
        assert isinstance(arguments, dict)
        assert set(arguments) == {"city", "unit"}, arguments
        assert isinstance(arguments["city"], str)
        assert arguments["unit"] in ("celsius", "fahrenheit")


def _check_scoring_example(port: int) -> None:
    """The README's scoring `curl` echoes the scored prompt: its tokens, the first one's logprob
    null, every later one's a log probability, and nothing generated."""
    block = code_block('"echo": true', "bash", README)
    block = block.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    reply = subprocess.run(["bash", "-c", block], capture_output=True, text=True, timeout=60)
    (choice,) = json.loads(reply.stdout)["choices"]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]).strip() == choice["text"] == "The capital of France is Paris"
    assert logprobs["token_logprobs"][0] is None
    assert all(value <= 0 for value in logprobs["token_logprobs"][1:])


def _streaming_example(port: int) -> str:
    block = code_block("stream=True", "python", README)
    return block.replace("127.0.0.1:8000", f"127.0.0.1:{port}")


def _run_streaming_example(port: int) -> list[tuple[float, str]]:
    """Run the README's streaming example; (time, text) of every `print` it makes."""
    printed: list[tuple[float, str]] = []

    def record(*parts: object, **_: object) -> None:
        printed.append((time.monotonic(), "".join(str(part) for part in parts)))

    exec(compile(_streaming_example(port), "readme_streaming.py", "exec"), {"print": record})
    return printed


def _runs_haproxy(cli: CliProcess) -> bool:
    """Whether an HAProxy process serves for the command (its Ray instance's processes are in
    the command's session)."""
    return any(name.startswith("haproxy[") for name in session_processes(cli.sid))


@pytest.mark.parametrize("ingress", ["haproxy", pytest.param("proxy", marks=pytest.mark.slow)])
def test_make_serve_answers_the_readme_examples_and_stops_on_ctrl_c(
    user_env: dict[str, str], ingress: str
) -> None:
    port = serve_port()
    cli = CliProcess(serve_command("--port", str(port), "--ingress", ingress), user_env)
    try:
        cli.wait_for_line("hybridserve: ready", READY_TIMEOUT_S)
        assert f"http://127.0.0.1:{port}/v1" in cli.output()
        assert f"hybridserve: HTTP ingress: {ingress}" in cli.output()
        assert _runs_haproxy(cli) == (ingress == "haproxy"), cli.output()

        reply = subprocess.run(
            ["bash", "-c", _curl_example(port)], capture_output=True, text=True, timeout=60
        )
        body = json.loads(reply.stdout)
        assert "Paris" in body["choices"][0]["message"]["content"], body

        printed = _run_streaming_example(port)
        pieces = [text for _, text in printed if text]
        assert len(pieces) >= 3, printed  # several chunks, each printed as it came
        assert printed[-1][0] > printed[0][0]

        _check_structured_examples(port)
        _check_scoring_example(port)

        cli.ctrl_c()
        code, seconds = cli.wait_exit(30)
        assert code == 0, cli.output()
        assert seconds < 30
        assert cli.alive_processes() == [], cli.output()
    finally:
        cli.close()


@pytest.mark.parametrize(
    ("moment", "stop"),
    [
        ("at once", "ctrl_c"),
        ("hybridserve: connecting to Ray", "ctrl_c"),  # while Ray starts its processes
        ("hybridserve: Ray:", "terminate"),
        ("hybridserve: deploying", "ctrl_c"),
    ],
)
def test_start_up_stops_within_10_s_at_any_moment(
    user_env: dict[str, str], moment: str, stop: str
) -> None:
    cli = CliProcess(serve_command("--port", str(serve_port())), user_env)
    try:
        if moment != "at once":
            cli.wait_for_line(moment, READY_TIMEOUT_S)
        if moment == "at once":
            time.sleep(1.0)
        elif moment == "hybridserve: connecting to Ray":
            time.sleep(0.5)
        getattr(cli, stop)()
        code, seconds = cli.wait_exit(10)
        stopped = (0, 130, -signal.SIGINT, -signal.SIGTERM)  # before Python's handlers: killed
        assert code in stopped, f"exit {code} after {seconds:.1f} s:\n{cli.output()}"
        assert cli.alive_processes() == [], cli.output()
    finally:
        cli.close()
