"""The replay tool warns about configuration keys it does not read, naming the closest one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.replay import replay_trace
from scheduler.replay_keys import unknown_key_warnings

ROOT = Path(__file__).resolve().parents[3]
TRACES = sorted((Path(__file__).parent / "replay_traces").glob("H*.json"))

SMALL = {
    "groups": [{"type": "full", "block_size": 4}],
    "num_blocks": 9,
    "max_model_len": 64,
    "ops": [{"op": "prefill", "id": "a", "tokens": [1, 2, 3, 4, 5]}],
}


def test_a_misspelt_top_level_key_is_named_with_the_closest_known_one() -> None:
    (warning,) = unknown_key_warnings({**SMALL, "enable_cachng": False})
    assert "'enable_cachng'" in warning
    assert "did you mean 'enable_caching'" in warning


def test_a_misspelt_group_key_names_its_group() -> None:
    trace = {**SMALL, "groups": [{"type": "sliding_window", "block_size": 4, "slidng_window": 8}]}
    (warning,) = unknown_key_warnings(trace)
    assert "groups[0]" in warning
    assert "did you mean 'sliding_window'" in warning


def test_notes_under_meta_and_every_known_key_are_silent() -> None:
    trace = {
        **SMALL,
        "enable_caching": True,
        "cache_unreachable_blocks": False,
        "prefix_cache_eviction": "lru",
        "meta": {"name": "x", "anything": [1, 2]},
    }
    assert unknown_key_warnings(trace) == []
    assert "warnings" not in replay_trace(trace)


def test_the_hand_traces_carry_no_unknown_key() -> None:
    for path in TRACES:
        assert unknown_key_warnings(json.loads(path.read_text())) == [], path.name


def test_the_command_warns_on_stderr_and_in_the_output_but_still_runs(tmp_path: Path) -> None:
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({**SMALL, "enable_cachng": False, "zzzz": 1}))
    result = subprocess.run(
        [sys.executable, "-m", "scheduler.replay", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    assert len(output["warnings"]) == 2
    assert output["results"][0]["allocated"] is True
    assert "did you mean 'enable_caching'" in result.stderr
    assert "'zzzz'" in result.stderr


def _mamba_trace(mode: str) -> dict:
    a = list(range(20))
    return {
        "groups": [{"type": "full", "block_size": 4}, {"type": "mamba", "block_size": 4}],
        "num_blocks": 40,
        "max_model_len": 64,
        "mamba_cache_mode": mode,
        "ops": [
            {"op": "prefill", "id": "a", "tokens": a},
            {"op": "free", "id": "a"},
            {"op": "prefill", "id": "b", "tokens": a[:12] + [99] * 5},
        ],
    }


def test_mamba_cache_mode_all_keeps_a_state_at_every_block_end() -> None:
    """`align` keeps a's state only where its prefill chunks end (16); `all` at 4, 8, 12, 16."""
    assert replay_trace(_mamba_trace("align"))["results"][2]["hit_tokens"] == 0
    assert replay_trace(_mamba_trace("all"))["results"][2]["hit_tokens"] == 12


def test_an_unknown_mamba_cache_mode_is_an_error() -> None:
    with pytest.raises(ValueError, match="'mamba_cache_mode' must be one of"):
        replay_trace(_mamba_trace("sometimes"))
