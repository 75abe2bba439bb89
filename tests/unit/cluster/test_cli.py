"""The `hybridserve` console command: replay and in-process generation."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster.cli import build_parser, main
from cluster.config.engine_args import EngineArgs
from cluster.config.engine_flags import engine_kwargs_from_args as engine_kwargs
from cluster.model_download import resolve_model_folder
from tests.helpers.tiny_models import save_tiny_model
from tests.helpers.word_tokenizer import save_word_tokenizer

TRACES = Path(__file__).resolve().parents[1] / "scheduler" / "replay_traces"
REPO = Path(__file__).resolve().parents[3]


def test_replay_command_prints_one_line_per_trace(capsys: pytest.CaptureFixture[str]) -> None:
    files = sorted(str(p) for p in TRACES.glob("*.json"))
    assert main(["replay", *files]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(files)
    expected = json.loads(Path(files[0]).read_text())["meta"]["hand_expected"]
    first = json.loads(lines[0])["results"]
    assert {k: first[int(k)]["hit_tokens"] for k in expected if "hit_tokens" in expected[k]} == {
        k: v["hit_tokens"] for k, v in expected.items() if "hit_tokens" in v
    }


def test_generate_command_prints_the_greedy_continuation(tmp_path: Path) -> None:
    hf_model = save_tiny_model("llama", tmp_path)
    tokenizer = save_word_tokenizer(tmp_path, hf_model.config.vocab_size)
    prompt = "t5 t17 t33 t2 t9"
    prompt_ids = tokenizer(prompt).input_ids
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=4, do_sample=False)
    # The continuation's text is the whole sequence's text after the prompt's (vLLM's rule).
    whole = tokenizer.decode(out[0].tolist(), skip_special_tokens=True)
    expected = whole[len(tokenizer.decode(prompt_ids, skip_special_tokens=True)) :]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "generate",
            "--model",
            str(tmp_path),
            "--prompt",
            prompt,
            "--max-tokens",
            "4",
            "--block-size",
            "4",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    assert run.stdout == f"{prompt}{expected}\n"


def test_bad_sampling_argument_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "hi", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert err == "hybridserve generate: error: temperature must be >= 0 and finite, got -1.0\n"


def test_usage_errors_are_one_line_without_the_usage_block(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "hi", "--tensor-parallel-size", "two"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "usage:" not in err
    assert "--tensor-parallel-size: invalid int value" in err


def test_unknown_log_level_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--log-level", "chatty", "replay", "x.json"])
    assert exit_info.value.code == 2
    assert "--log-level" in capsys.readouterr().err


def test_log_level_is_accepted_before_or_after_the_subcommand() -> None:
    parser = build_parser()
    assert parser.parse_args(["--log-level", "info", "replay", "t.json"]).log_level == "INFO"
    assert parser.parse_args(["replay", "t.json", "--log-level", "debug"]).log_level == "DEBUG"
    assert parser.parse_args(["replay", "t.json"]).log_level == "WARNING"


def test_every_engine_argument_is_a_flag_with_its_documentation() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["generate", "--prompt", "x", "--max-num-seqs", "3", "--no-enable-prefix-caching"]
    )
    assert engine_kwargs(args) == {"max_num_seqs": 3, "enable_prefix_caching": False}
    generate = parser._subparsers._group_actions[0].choices["generate"]  # type: ignore[union-attr]
    helps = {action.dest: action.help for action in generate._actions}
    for name, field in EngineArgs.model_fields.items():
        if name != "model":
            assert field.description
            expected = " ".join(field.description.split()) + f" (default: {field.default!r})"
            assert helps["engine_arg__" + name] == expected
    assert helps["engine_arg__block_size"] == "Tokens per KV cache block. (default: 16)"
    choices = {action.dest: action.choices for action in generate._actions}
    assert choices["engine_arg__scheduling_policy"] == ["fcfs", "priority"]


def test_malformed_config_json_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text("{not json")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{tmp_path / 'config.json'} cannot be read" in err


def test_corrupt_checkpoint_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_tiny_model("llama", tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{tmp_path / 'model.safetensors'} is not a readable safetensors file" in err


@pytest.fixture(scope="module")
def word_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("word-model")
    hf_model = save_tiny_model("llama", path)
    template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}t1 {% endif %}"
    )
    save_word_tokenizer(path, hf_model.config.vocab_size, template)
    return path


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "cluster.cli", *args]


def test_generate_streams_text_before_the_end(word_model: Path) -> None:
    """Read the output pipe as it arrives: the continuation comes in several pieces, the
    first of them while the process still runs."""
    proc = subprocess.Popen(
        _command("generate", "--model", str(word_model), "--prompt", "t5 t7", "--max-tokens", "48"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    assert proc.stdout is not None
    chunks: list[tuple[bytes, bool]] = []
    while chunk := os.read(proc.stdout.fileno(), 1 << 16):
        chunks.append((chunk, proc.poll() is None))
    assert proc.wait() == 0
    text = b"".join(chunk for chunk, _ in chunks).decode()
    assert text.startswith("t5 t7")
    assert len(re.findall(r"t\d+", text)) == 2 + 48
    assert len(chunks) > 2
    assert chunks[1][1]  # a continuation piece arrived while the process was running


def test_sigint_exits_130_without_a_traceback(word_model: Path) -> None:
    proc = subprocess.Popen(
        _command("chat", "--model", str(word_model), "--max-tokens", "4"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        text=True,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write("t3 t4\n")
    proc.stdin.flush()
    reply = proc.stdout.readline()  # the model is loaded and waits for the next turn
    assert len(re.findall(r"t\d+", reply)) == 4
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in err


def test_chat_message_answers_one_turn(word_model: Path) -> None:
    run = subprocess.run(
        _command("chat", "--model", str(word_model), "--message", "t3 t4", "--max-tokens", "3"),
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    assert len(re.findall(r"t\d+", run.stdout)) == 3


def test_a_cached_hub_model_id_resolves_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 at start-up
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc123")
    assert resolve_model_folder("org/tiny", cache_dir=str(tmp_path)) == snapshot
    with pytest.raises(ValueError, match="nothing is downloaded"):
        resolve_model_folder("org/absent", cache_dir=str(tmp_path))
