"""Hugging Face model IDs download on first use, against a fake Hub on a loopback address.

Each "start" is a fresh process (as a worker is), resolving the model ID with HF_ENDPOINT
pointing at the fake Hub and HF_HOME in a temporary folder; the Hub records every request.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import random
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants as hub_constants

from tests.helpers.fake_hub import FakeHub, HubState, commit_sha
from tests.helpers.tiny_models import hf_greedy, save_tiny_model
from tests.helpers.word_tokenizer import save_word_tokenizer

REPO = Path(__file__).resolve().parents[3]
MODEL = "org/tiny"
START = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
from cluster.model_download import resolve_model_folder
try:
    print(resolve_model_folder(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
except ValueError as error:
    sys.exit(f"error: {error}")
"""


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """A tiny random Llama with a tokenizer, and transformers' greedy continuation of a prompt."""
    folder = tmp_path_factory.mktemp("tiny-repo")
    hf_model = save_tiny_model("llama", folder)
    save_word_tokenizer(folder, hf_model.config.vocab_size)
    return folder, hf_greedy(hf_model, [5, 7, 9], 4)


@pytest.fixture
def hub(tiny_repo: tuple[Path, list[int]]) -> Iterator[FakeHub]:
    server = FakeHub(HubState(repos={MODEL: tiny_repo[0], "org/gated": tiny_repo[0]}))
    server.state.gated.add("org/gated")
    yield server
    server.close()


def _env(hub: FakeHub, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    return {
        **env,
        "HF_ENDPOINT": hub.endpoint,
        "HF_HOME": str(home),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "NO_PROXY": "127.0.0.3",
        "no_proxy": "127.0.0.3",
        **extra,
    }


def _start(hub: FakeHub, home: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", START, *args],
        env=_env(hub, home, **env),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run(hub: FakeHub, home: Path, *args: str, **env: str) -> tuple[int, str, str]:
    proc = _start(hub, home, *args, **env)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out.strip(), err


def _assert_is_the_repo(folder: Path, source: Path) -> None:
    assert folder == folder.parent.parent / "snapshots" / commit_sha(MODEL)
    names = {p.name for p in source.iterdir()}
    assert {p.name for p in folder.iterdir()} == names
    for name in names:
        assert (folder / name).read_bytes() == (source / name).read_bytes(), name


def test_first_start_downloads_and_later_starts_read_the_cache(
    hub: FakeHub, tiny_repo: tuple[Path, list[int]], tmp_path: Path
) -> None:
    code, out, err = _run(hub, tmp_path, MODEL)
    assert code == 0, err
    folder = Path(out)
    assert folder.is_relative_to(tmp_path / "hub")  # HF_HOME/hub
    _assert_is_the_repo(folder, tiny_repo[0])
    num_files = len(list(tiny_repo[0].iterdir()))
    assert len(hub.state.file_requests("GET")) == num_files
    # no terminal: a log line, not a progress bar
    assert f"downloading {MODEL} from {hub.endpoint}" in err
    assert "%|" not in err

    hub.state.requests.clear()
    assert _run(hub, tmp_path, MODEL)[:2] == (0, out)
    assert hub.state.file_requests("GET") == []
    assert hub.state.file_requests("HEAD") == []
    assert [r.path for r in hub.state.requests] == [f"/api/models/{MODEL}/revision/main"]

    hub.state.requests.clear()
    assert _run(hub, tmp_path, MODEL, HF_HUB_OFFLINE="1")[:2] == (0, out)
    assert hub.state.requests == []


def test_download_dir_holds_the_weights_instead_of_hf_home(hub: FakeHub, tmp_path: Path) -> None:
    code, out, err = _run(hub, tmp_path / "home", MODEL, str(tmp_path / "weights"))
    assert code == 0, err
    assert Path(out).is_relative_to(tmp_path / "weights" / "models--org--tiny")
    assert not (tmp_path / "home" / "hub").exists()


def test_concurrent_starts_on_one_node_download_once(hub: FakeHub, tmp_path: Path) -> None:
    """The second start comes while the first is fetching files (each GET takes 1.5 s)."""
    hub.state.delay_s = 1.5
    procs = [_start(hub, tmp_path, MODEL)]
    deadline = time.monotonic() + 60
    while not hub.state.file_requests("GET") and time.monotonic() < deadline:
        time.sleep(0.02)
    procs.append(_start(hub, tmp_path, MODEL))
    results = [(proc.communicate(timeout=120), proc.returncode) for proc in procs]
    assert [code for _, code in results] == [0, 0], results
    (out_a, err_a), (out_b, err_b) = (output for output, _ in results)
    assert out_a == out_b
    files = {r.path for r in hub.state.file_requests("GET")}
    assert len(hub.state.file_requests("GET")) == len(files)
    # the process that waited asked nothing about the files: it found them cached
    assert len(hub.state.file_requests("HEAD")) == len(files)
    assert (err_a + err_b).count(f"downloading {MODEL}") == 1


def test_dropped_transfer_resumes_with_a_range_request(hub: FakeHub, tmp_path: Path) -> None:
    """The connection drops mid-file; the client asks for the rest with a Range request from
    the last whole chunk it wrote, and the file it keeps is the served one."""
    chunk = hub_constants.DOWNLOAD_CHUNK_SIZE
    repo = tmp_path / "big"
    repo.mkdir()
    (repo / "weights.bin").write_bytes(random.Random(0).randbytes(chunk + chunk // 2))
    hub.state.repos["org/big"] = repo
    hub.state.drop_once["weights.bin"] = chunk + chunk // 4
    code, out, err = _run(hub, tmp_path, "org/big")
    assert code == 0, err
    assert (Path(out) / "weights.bin").read_bytes() == (repo / "weights.bin").read_bytes()
    assert [r.range for r in hub.state.file_requests("GET")] == [None, f"bytes={chunk}-"]


@pytest.mark.parametrize(
    ("model", "env", "expected"),
    [
        ("org/missing", {}, "model 'org/missing' was not found on the Hugging Face Hub"),
        ("org/gated", {}, "model 'org/gated' is gated on the Hugging Face Hub and no token was"),
        (MODEL, {"HF_HUB_OFFLINE": "1"}, "(HF_HUB_OFFLINE is set: nothing is downloaded)"),
        (
            MODEL,
            {"HF_ENDPOINT": "http://127.0.0.3:9"},
            "and the Hub (http://127.0.0.3:9) cannot be",
        ),
    ],
)
def test_a_model_that_cannot_be_had_fails_with_one_line(
    hub: FakeHub, tmp_path: Path, model: str, env: dict[str, str], expected: str
) -> None:
    code, _, err = _run(hub, tmp_path, model, **env)
    assert code == 1
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert expected in line
    if model == "org/gated":
        assert "set HF_TOKEN" in line
        assert "model.hfToken.secretName" in line


def test_progress_bar_on_a_terminal(hub: FakeHub, tmp_path: Path) -> None:
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # rows, columns
    proc = subprocess.Popen(
        [sys.executable, "-c", START, MODEL],
        env=_env(hub, tmp_path),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=terminal,
    )
    os.close(terminal)
    output = b""
    while chunk := _read(controller):
        output += chunk
    assert proc.wait(timeout=120) == 0
    assert b"%|" in output  # tqdm's bar


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except OSError:  # the terminal closed with the process
        return b""


LLM_RUN = """
import json, sys
from cluster import LLM, SamplingParams
llm = LLM(model=sys.argv[1], download_dir=sys.argv[2], distributed_executor_backend="uni",
          kv_cache_memory_bytes=1 << 22, dtype="float32")
output = llm.generate({"prompt_token_ids": [5, 7, 9]}, SamplingParams(temperature=0, max_tokens=4))
print(json.dumps(list(output[0].outputs[0].token_ids)))
"""


def test_llm_generates_from_a_downloaded_model_id(
    hub: FakeHub, tiny_repo: tuple[Path, list[int]], tmp_path: Path
) -> None:
    run = subprocess.run(
        [sys.executable, "-c", LLM_RUN, MODEL, str(tmp_path / "weights")],
        env=_env(hub, tmp_path),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1]) == tiny_repo[1]


def test_download_dir_is_an_engine_argument_and_a_flag() -> None:
    import argparse

    from cluster.config import validate_engine_kwargs
    from cluster.config.engine_flags import add_engine_arg_flags, engine_kwargs_from_args

    assert validate_engine_kwargs({"download_dir": "/w"}).download_dir == "/w"
    parser = argparse.ArgumentParser()
    add_engine_arg_flags(parser)
    args = parser.parse_args(["--download-dir", "/w"])
    assert engine_kwargs_from_args(args) == {"download_dir": "/w"}
