"""The Files and Batch APIs on a real Serve app, through the official `openai` client.

One app (one model, one replica: one hop, as `make serve` runs, so the model replica also serves
the routes; the tiny model's engine in its process, the scheduling policy left to the app's
default) serves every test: a batch end to end with its output and error files read
with the client's own types, malformed lines and a file that is not JSONL, cancel, a batch whose
engine replica is killed mid-run (a real SIGKILL), a chat's time to first token beside a large
batch, and last the batch service ending with the app.

The engine runs at most `MAX_NUM_SEQS` requests while the batch keeps `WINDOW` lines in flight,
so batch lines wait in the engine's queue: a chat's first token then comes early only because the
priority policy puts it before them.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import ray
from openai.types import Batch, Completion
from openai.types.chat import ChatCompletion
from ray import serve

from cluster.serve import build_openai_app
from cluster.serve.batch_service import SERVICE_NAMESPACE, WINDOW_ENV, service_name
from tests.helpers.serve_app import deployed, llm_config, save_tiny_served_model

pytestmark = pytest.mark.ray

APP = "batches"
MAX_NUM_SEQS = 4
WINDOW = 64
"""Batch lines in flight: many more than the engine runs at once, so most wait in its queue."""
INGRESS_OPTIONS = {"num_cpus": 0.1, "runtime_env": {"env_vars": {WINDOW_ENV: str(WINDOW)}}}
TTFT_BOUND_S = 1.0
"""A chat's first token beside a running batch comes within this of an idle server's."""


@pytest.fixture(scope="module")
def client(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    model_dir = save_tiny_served_model(tmp_path_factory.mktemp("batch-served"))
    config = llm_config(model_dir, distributed_executor_backend="uni", max_num_seqs=MAX_NUM_SEQS)
    config["deployment_config"]["ray_actor_options"]["num_cpus"] = 0.25
    config["placement_group_config"] = {"bundles": [{"CPU": 0.25}]}  # no rank actor to hold
    args = {
        "llm_configs": [config],
        "ingress_deployment_config": {"ray_actor_options": INGRESS_OPTIONS},
    }
    with deployed(build_openai_app(args), APP) as address:
        client = openai.OpenAI(
            base_url=f"{address.base_url}/v1", api_key="unused", max_retries=0, timeout=30
        )
        client.with_options(timeout=180).files.list()  # the first call starts the batch service
        yield client


def completion_line(custom_id: str, prompt: str, max_tokens: int = 6) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def chat_line(custom_id: str, content: str, max_tokens: int = 6) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def upload(client: openai.OpenAI, lines: list[Any], tmp_path: Path) -> str:
    path = tmp_path / "input.jsonl"
    path.write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    )
    with path.open("rb") as file:
        return client.files.create(file=file, purpose="batch").id


RESTARTING = (openai.APITimeoutError, openai.APIConnectionError, openai.InternalServerError)
"""What a poll may meet while the app's only replica (its ingress too) is being replaced."""


def wait_batch(
    client: openai.OpenAI,
    batch_id: str,
    done: Any = None,
    timeout: float = 120.0,
    restarting: bool = False,
) -> Batch:
    """Poll until the batch is finished (or `done(batch)` holds); `restarting`: polls that fail
    while the replica is replaced are tried again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            batch = client.batches.retrieve(batch_id)
        except RESTARTING:
            if not restarting:
                raise
            time.sleep(1.0)
            continue
        if done(batch) if done else batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} not finished after {timeout} s")


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def run_batch(client: openai.OpenAI, lines: list[Any], tmp_path: Path, endpoint: str) -> Batch:
    file_id = upload(client, lines, tmp_path)
    batch = client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
    assert batch.status == "validating"
    return wait_batch(client, batch.id)


def test_a_chat_batch_through_the_client(client: openai.OpenAI, tmp_path: Path) -> None:
    lines = [chat_line(f"c{i}", f"t{5 + i} t{9 + i} t{11 + 2 * i}") for i in range(6)]
    malformed = [
        "{not json",
        {
            **chat_line("bad-body", "t5"),
            "body": {"model": "tiny", "messages": [], "max_tokens": -1},
        },
        {**chat_line("bad-url", "t5"), "url": "/v1/embeddings"},
    ]
    batch = run_batch(
        client, [*lines[:3], *malformed, *lines[3:]], tmp_path, "/v1/chat/completions"
    )
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (
        batch.request_counts.total,
        batch.request_counts.completed,
        batch.request_counts.failed,
    ) == (9, 6, 3)
    outputs = file_lines(client, batch.output_file_id)
    assert [line["custom_id"] for line in outputs] == [
        line["custom_id"] for line in lines
    ]  # input order
    for line, output in zip(lines, outputs, strict=True):
        assert output["error"] is None
        assert output["response"]["status_code"] == 200
        body = ChatCompletion.model_validate(output["response"]["body"])
        direct = client.chat.completions.create(**line["body"])
        assert body.choices[0].message.content == direct.choices[0].message.content
        assert body.usage is not None
        assert body.usage.completion_tokens == direct.usage.completion_tokens
    failures = file_lines(client, batch.error_file_id)
    assert [(f["custom_id"], f["error"]["line"]) for f in failures] == [
        ("line-4", 4),
        ("bad-body", 5),
        ("bad-url", 6),
    ]
    for failure in failures:
        assert failure["response"]["status_code"] == 400
        assert failure["response"]["body"]["error"]["message"] == failure["error"]["message"]
    assert "max_tokens" in failures[1]["error"]["message"]
    assert "url" in failures[2]["error"]["message"]
    listed = {b.id for b in client.batches.list()}
    assert batch.id in listed
    assert {batch.input_file_id, batch.output_file_id, batch.error_file_id} <= {
        f.id for f in client.files.list()
    }


def test_a_file_that_is_not_jsonl_fails_validation(client: openai.OpenAI, tmp_path: Path) -> None:
    batch = run_batch(client, ["just some words", "and more"], tmp_path, "/v1/completions")
    assert batch.status == "failed"
    assert batch.errors is not None
    assert batch.errors.data
    assert "JSONL" in (batch.errors.data[0].message or "")
    assert batch.output_file_id is None


def _long_lines(count: int, max_tokens: int | list[int], start: int = 0) -> list[dict[str, Any]]:
    """Lines that generate exactly `max_tokens` tokens (an int, or one per line), each its own
    prefix group (prompts differ in their first word), in input order by their prompts."""
    lengths = [max_tokens] * count if isinstance(max_tokens, int) else max_tokens
    lines = [
        completion_line(f"r{i}", f"t{20 + start + i} t{7 + i % 13} t{3 + i % 50}", length)
        for i, length in zip(range(count), lengths, strict=True)
    ]
    for line in lines:
        line["body"]["ignore_eos"] = True
    return lines


def _create(client: openai.OpenAI, lines: list[Any], tmp_path: Path) -> Batch:
    file_id = upload(client, lines, tmp_path)
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
    )


def _completed(count: int) -> Any:
    return lambda b: b.request_counts is not None and b.request_counts.completed >= count


CANCEL_DEADLINE_S = 5.0
"""Cancel stops a batch within this; a line left running would take far longer."""


def test_cancel_stops_within_seconds_and_keeps_finished_lines(
    client: openai.OpenAI, tmp_path: Path
) -> None:
    # Two short lines first (in prompt order), then lines of 600 tokens: at the cancel some of
    # those are half done, the others waiting.
    lines = _long_lines(24, [4, 4, *[600] * 22])
    batch = _create(client, lines, tmp_path)
    wait_batch(client, batch.id, _completed(2))
    cancelling = client.batches.cancel(batch.id)
    asked = time.monotonic()
    assert cancelling.status in ("cancelling", "cancelled")
    assert cancelling.request_counts is not None
    cancelled = wait_batch(client, batch.id, timeout=30)
    assert cancelled.status == "cancelled"
    assert time.monotonic() - asked < CANCEL_DEADLINE_S
    assert cancelled.request_counts is not None
    assert cancelled.request_counts.completed == cancelling.request_counts.completed  # no more
    outputs = file_lines(client, cancelled.output_file_id)
    assert [line["custom_id"] for line in outputs] == ["r0", "r1"]
    assert cancelled.error_file_id is None


def _replica_pid() -> int:
    prefix = f"SERVE_REPLICA::{APP}#LLMServer:tiny"
    (name,) = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    ]
    replica = ray.get_actor(name, namespace="serve")
    return int(ray.get(replica.__ray_call__.remote(lambda _: os.getpid()), timeout=30))


def test_a_killed_replica_resumes_each_line_once(client: openai.OpenAI, tmp_path: Path) -> None:
    lines = _long_lines(12, 40)
    reference = run_batch(client, lines, tmp_path, "/v1/completions")
    assert reference.status == "completed", reference
    batch = client.batches.create(
        input_file_id=reference.input_file_id, endpoint="/v1/completions", completion_window="24h"
    )
    running = wait_batch(client, batch.id, _completed(2))
    assert running.request_counts is not None
    assert running.request_counts.completed < len(lines)
    os.kill(_replica_pid(), signal.SIGKILL)
    finished = wait_batch(client, batch.id, timeout=180, restarting=True)
    assert finished.status == "completed", finished
    assert finished.error_file_id is None
    outputs = file_lines(client, finished.output_file_id)
    assert [line["custom_id"] for line in outputs] == [line["custom_id"] for line in lines]
    expected = file_lines(client, reference.output_file_id)
    for output, want in zip(outputs, expected, strict=True):
        assert Completion.model_validate(output["response"]["body"]).choices[0].text == (
            Completion.model_validate(want["response"]["body"]).choices[0].text
        )


def _ttft(client: openai.OpenAI) -> float:
    start = time.monotonic()
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "t9 t10"}], max_tokens=2, stream=True
    )
    for _ in stream:
        break
    seconds = time.monotonic() - start
    stream.close()
    return seconds


def test_a_chat_beside_a_large_batch_keeps_its_ttft(client: openai.OpenAI, tmp_path: Path) -> None:
    _ttft(client)  # the replica may be new (the test above replaced it)
    idle = statistics.median(_ttft(client) for _ in range(3))
    # Lines of 8 to 64 tokens: a running line finishes every few steps, and the engine's queue
    # holds WINDOW - MAX_NUM_SEQS batch lines: under FCFS a chat would wait for all of them.
    batch = _create(client, _long_lines(400, [8 + (7 * i) % 57 for i in range(400)]), tmp_path)
    wait_batch(client, batch.id, _completed(MAX_NUM_SEQS))
    busy = [_ttft(client) for _ in range(3)]
    progress = client.batches.retrieve(batch.id)
    client.batches.cancel(batch.id)
    assert progress.status == "in_progress"  # the batch was still running beside the chats
    print(f"TTFT idle {idle:.3f} s, beside the batch {busy}")
    assert statistics.median(busy) <= idle + TTFT_BOUND_S, (idle, busy)
    wait_batch(client, batch.id, timeout=30)


def test_the_batch_service_ends_with_its_app(client: openai.OpenAI) -> None:
    """Last: deletes the module's app."""
    name = service_name(APP)
    ray.get_actor(name, namespace=SERVICE_NAMESPACE)  # running now
    serve.delete(APP)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=SERVICE_NAMESPACE)
        except ValueError:
            return
        time.sleep(0.5)
    raise AssertionError(f"{name} still alive 30 s after its app was deleted")
