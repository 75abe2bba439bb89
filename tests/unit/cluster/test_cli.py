"""The `hybridserve` console command: replay and in-process generation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from cluster.cli import main
from tests.helpers.tiny_models import save_tiny_model

TRACES = Path(__file__).resolve().parents[1] / "scheduler" / "replay_traces"


def test_replay_command_prints_one_line_per_trace(capsys: pytest.CaptureFixture[str]) -> None:
    files = sorted(str(p) for p in TRACES.glob("*.json"))
    assert main(["replay", *files]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(files)
    expected = json.loads(Path(files[0]).read_text())["hand_expected"]
    first = json.loads(lines[0])["results"]
    assert {k: first[int(k)]["hit_tokens"] for k in expected if "hit_tokens" in expected[k]} == {
        k: v["hit_tokens"] for k, v in expected.items() if "hit_tokens" in v
    }


def _save_word_tokenizer(path: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over the words t0..t{n-1}, built offline."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")
    tokenizer.save_pretrained(path)
    return tokenizer


def test_generate_command_prints_the_greedy_continuation(tmp_path: Path) -> None:
    hf_model = save_tiny_model("llama", tmp_path)
    tokenizer = _save_word_tokenizer(tmp_path, hf_model.config.vocab_size)
    prompt = "t5 t17 t33 t2 t9"
    prompt_ids = tokenizer(prompt).input_ids
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=4, do_sample=False)
    expected = tokenizer.decode(out[0, len(prompt_ids) :].tolist(), skip_special_tokens=True)
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
        cwd=Path(__file__).resolve().parents[3],
    )
    assert run.stdout == f"{prompt}{expected}\n"


def test_bad_sampling_argument_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "hi", "--temperature", "-1"])
    assert exit_info.value.code == 2
    assert "temperature must be >= 0" in capsys.readouterr().err


def test_generate_error_shows_the_generate_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "hi", "--top-p", "0"])
    assert "usage: hybridserve generate" in capsys.readouterr().err


def test_unknown_log_level_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--log-level", "chatty", "replay", "x.json"])
    assert exit_info.value.code == 2
    assert "--log-level" in capsys.readouterr().err
