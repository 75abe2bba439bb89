"""`python -m scheduler.replay`: the five hand-checked traces and the error path."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.workloads.pressure_traces import ALL_REACHABLE, LAYOUTS, hit_tokens, pressure_trace
from scheduler.replay import replay_trace

ROOT = Path(__file__).resolve().parents[3]
TRACES = sorted((Path(__file__).parent / "replay_traces").glob("H*.json"))
"""The five hand-checked traces H1-H5 (expected values under meta.hand_expected)."""


def run_replay(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scheduler.replay", *map(str, paths)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )


def test_every_hand_expected_field_of_the_five_traces_matches(tmp_path: Path) -> None:
    """The hand-checked values are vLLM's, which registers every full block: replayed with
    that policy, every field matches."""
    assert len(TRACES) == 5
    vllm_policy = []
    for path in TRACES:
        trace = json.loads(path.read_text())
        trace["cache_unreachable_blocks"] = True
        trace["prefix_cache_eviction"] = "lru"
        vllm_policy.append(tmp_path / path.name)
        vllm_policy[-1].write_text(json.dumps(trace))
    result = run_replay(*vllm_policy)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(TRACES)
    for path, line in zip(TRACES, lines, strict=True):
        records = json.loads(line)["results"]
        trace = json.loads(path.read_text())
        assert [record["op_index"] for record in records] == list(range(len(trace["ops"])))
        for index, fields in trace["meta"]["hand_expected"].items():
            record = records[int(index)]
            for name, value in fields.items():
                assert record[name] == value, (path.name, index, name)


def test_bad_config_prints_an_error_line_exits_2_and_runs_the_other_files(
    tmp_path: Path,
) -> None:
    good = {
        "groups": [{"type": "full", "block_size": 4}],
        "num_blocks": 5,
        "max_model_len": 64,
        "ops": [
            {"op": "prefill", "id": "a", "tokens": [1, 2, 3, 4, 5]},
            {"op": "decode", "id": "a", "tokens": [6, 7, 8, 9]},
            {"op": "prefill", "id": "b", "tokens": list(range(20))},
            {"op": "decode", "id": "b", "tokens": [1]},
            {"op": "free", "id": "a"},
            {"op": "free", "id": "b"},
        ],
    }
    bad_cla = {
        **good,
        "groups": [
            {"type": "full", "block_size": 8},
            {"type": "chunked_local", "block_size": 4, "attention_chunk_size": 8},
        ],
    }
    bad_type = {**good, "groups": [{"type": "cross", "block_size": 4}]}
    paths = []
    for name, trace in [("bad_cla", bad_cla), ("good", good), ("bad_type", bad_type)]:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(trace))
        paths.append(path)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    result = run_replay(*paths, broken, tmp_path / "missing.json")
    assert result.returncode == 2
    outputs = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(outputs) == 5
    assert "chunked local" in outputs[0]["error"]
    assert "cross" in outputs[2]["error"]
    assert all("error" in output for output in outputs[3:])
    records = outputs[1]["results"]
    assert [r["free_blocks"] for r in records] == [2, 1, 1, 1, 4, 4]
    assert records[0]["block_ids"] == [[1, 2]]
    assert records[1]["block_ids"] == [[1, 2, 3]]
    assert (records[2]["allocated"], records[2]["block_ids"]) == (False, [[]])
    assert (records[3]["allocated"], records[3]["skipped"]) == (False, True)


def test_caching_off_replays_mamba_with_one_state_block(tmp_path: Path) -> None:
    trace = {
        "groups": [{"type": "full", "block_size": 4}, {"type": "mamba", "block_size": 4}],
        "num_blocks": 20,
        "max_model_len": 64,
        "enable_caching": False,
        "ops": [
            {"op": "prefill", "id": "a", "tokens": list(range(10))},
            {"op": "prefill", "id": "b", "tokens": list(range(10))},
        ],
    }
    path = tmp_path / "off.json"
    path.write_text(json.dumps(trace))
    result = run_replay(path)
    records = json.loads(result.stdout)["results"]
    assert [r["hit_tokens"] for r in records] == [0, 0]
    assert records[0]["block_ids"] == [[1, 2, 3], [4]]
    assert records[1]["chunks"] == [10]


def test_request_longer_than_max_model_len_is_an_error(tmp_path: Path) -> None:
    trace = {
        "groups": [{"type": "full", "block_size": 4}],
        "num_blocks": 20,
        "max_model_len": 8,
        "ops": [{"op": "prefill", "id": "a", "tokens": list(range(9))}],
    }
    path = tmp_path / "long.json"
    path.write_text(json.dumps(trace))
    result = run_replay(path)
    assert result.returncode == 2
    assert "max_model_len" in json.loads(result.stdout)["error"]


def _trace(groups: list[dict[str, object]], ops: list[dict[str, object]], **top: object) -> dict:
    return {"groups": groups, "num_blocks": 20, "max_model_len": 32, "ops": ops, **top}


def test_records_carry_chunks_boundary_evictions_and_skips() -> None:
    full4 = {"type": "full", "block_size": 4}
    ops = [
        {"op": "prefill", "id": 1, "tokens": list(range(10))},
        {"op": "free", "id": 1},
        {"op": "prefill", "id": "b", "tokens": list(range(100, 132))},
        {"op": "decode", "id": "never", "tokens": [1]},
    ]
    groups = [full4, {"type": "mamba", "block_size": 4}]
    records = replay_trace(_trace(groups, ops, num_blocks=12, prefix_cache_eviction="lru"))[
        "results"
    ]
    assert (records[0]["id"], records[0]["chunks"], records[0]["shared_prefix_boundary"]) == (
        "1",
        [8, 2],
        0,
    )
    # Queue after the free: a's unhashed 4, 5 first, never used 6-11, a's hashed 2, 1, 3 last.
    # b's second step takes 2 and 1 from the prefix cache: two evictions.
    assert [r["evicted"] for r in records] == [0, 0, 2, 0]
    assert records[2]["chunks"] == [28, 4]
    assert records[2]["block_ids"] == [[4, 5, 6, 7, 8, 9, 10, 2], [-1] * 6 + [11, 1]]
    assert records[3] == {
        "op_index": 3,
        "op": "decode",
        "id": "never",
        "allocated": False,
        "skipped": True,
        "block_ids": [[], []],
        "free_blocks": 1,
        "evicted": 0,
    }


def test_a_failed_decode_step_keeps_the_request_and_retries_its_token() -> None:
    ops = [
        {"op": "prefill", "id": "a", "tokens": [1, 2, 3, 4]},
        {"op": "prefill", "id": "b", "tokens": [5, 6, 7, 8]},
        {"op": "decode", "id": "a", "tokens": [9, 10]},  # token 9 needs a third block: none
        {"op": "free", "id": "b"},
        {"op": "decode", "id": "a", "tokens": [11]},  # 9 and 11 are allocated together
    ]
    trace = _trace([{"type": "full", "block_size": 4}], ops, num_blocks=3)
    records = replay_trace(trace)["results"]
    assert (records[2]["allocated"], records[2]["block_ids"]) == (False, [[1]])
    assert (records[4]["allocated"], records[4]["block_ids"]) == (True, [[1, 2]])


@pytest.mark.parametrize(
    ("op", "message"),
    [
        ({"op": "evict", "id": "a"}, "op 1: unknown op 'evict'"),
        ({"op": "prefill", "id": "a", "tokens": [1]}, "op 1: prefill of 'a', which is still"),
        ({"op": "prefill", "id": "b", "tokens": [1.5]}, "op 1: 'tokens' must be a list of int"),
        ({"op": "prefill", "id": "b", "tokens": []}, "op 1: request 'b' has an empty prompt"),
        ({"op": "decode", "id": "a", "tokens": [0] * 30}, "op 1: request 'a' would hold 33"),
        ({"op": "free"}, "op 1: 'id' is missing"),
        ({"op": "decode", "id": "never"}, "op 1: 'tokens' must be a list of int"),
    ],
)
def test_an_invalid_op_fails_its_file_with_the_op_index(op: dict, message: str) -> None:
    trace = _trace(
        [{"type": "full", "block_size": 4}], [{"op": "prefill", "id": "a", "tokens": [1, 2, 3]}, op]
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        replay_trace(trace)


@pytest.mark.parametrize(
    ("trace", "message"),
    [
        ({"groups": [], "num_blocks": 20, "max_model_len": 32, "ops": []}, "at least one"),
        (
            {"groups": [{"type": "full", "block_size": 4}], "num_blocks": 20, "ops": []},
            "'max_model_len' is missing",
        ),
    ],
)
def test_an_invalid_configuration_names_the_problem(trace: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        replay_trace(trace)


def _replay_both(trace: dict) -> tuple[list[dict], list[dict]]:
    """(our policy's records, vLLM's policy's records) of one trace."""
    ours = replay_trace(trace)["results"]
    theirs = replay_trace({**trace, "cache_unreachable_blocks": True})["results"]
    return ours, theirs


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_hand_traces_hit_as_long_with_only_reachable_blocks_cached(path: Path) -> None:
    ours, theirs = _replay_both(json.loads(path.read_text()))
    assert hit_tokens(ours) == hit_tokens(theirs)
    assert [r["free_blocks"] for r in ours] == [r["free_blocks"] for r in theirs]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_under_pressure_the_trace_set_hits_longer(layout: str) -> None:
    """Over a set of pressure traces the hit tokens grow. (Single requests can go either way:
    the two policies evict in different LRU orders, so one request's prefix may survive in one
    run and not in the other.)"""
    ours_total = theirs_total = 0
    for seed in range(6):
        ours, theirs = _replay_both(pressure_trace(LAYOUTS[layout], seed))
        ours_total += sum(hit_tokens(ours))
        theirs_total += sum(hit_tokens(theirs))
    assert ours_total > theirs_total


@pytest.mark.parametrize("layout", sorted(ALL_REACHABLE))
def test_results_are_unchanged_when_every_block_is_reachable(layout: str) -> None:
    for seed in range(4):
        ours, theirs = _replay_both(pressure_trace(ALL_REACHABLE[layout], seed))
        assert ours == theirs


@pytest.mark.parametrize("tier_blocks", [0, 64])
def test_an_offload_tier_serves_what_the_pool_evicted(tier_blocks: int) -> None:
    """Two prompts taking turns in a pool that holds one: with a tier, the third prefill hits
    every block of the first prompt's full group and the window tail of its sliding group."""
    groups = [
        {"type": "full", "block_size": 4},
        {"type": "sliding_window", "block_size": 4, "sliding_window": 8},
    ]
    first, second = list(range(33)), list(range(100, 133))
    ops = [
        {"op": "prefill", "id": "a", "tokens": first},
        {"op": "free", "id": "a"},
        {"op": "prefill", "id": "b", "tokens": second},
        {"op": "free", "id": "b"},
        {"op": "prefill", "id": "a2", "tokens": first},
    ]
    trace = _trace(groups, ops, num_blocks=20, max_model_len=64, kv_offloading_blocks=tier_blocks)
    records = replay_trace(trace)["results"]
    assert "warnings" not in replay_trace(trace)
    if tier_blocks:
        assert (records[4]["hit_tokens"], records[4]["offloaded_blocks"]) == (32, 8 + 2)
    else:
        assert (records[4]["hit_tokens"], records[4]["offloaded_blocks"]) == (0, 0)


def test_num_speculative_tokens_holds_lookahead_blocks_and_k_states() -> None:
    """k = 3: a decode at 11 tokens holds the blocks of 3 draft positions (up to 14 tokens: one
    more block in each group, mode all keeps a state block per block) and 3 draft states."""
    trace: dict = {
        "groups": [{"type": "full", "block_size": 4}, {"type": "mamba", "block_size": 4}],
        "num_blocks": 40,
        "max_model_len": 64,
        "mamba_cache_mode": "all",
        "ops": [
            {"op": "prefill", "id": "a", "tokens": list(range(10))},
            {"op": "decode", "id": "a", "tokens": [10]},
        ],
    }
    plain = replay_trace(trace)["results"]
    speculative = replay_trace({**trace, "num_speculative_tokens": 3})["results"]
    assert "warnings" not in replay_trace({**trace, "num_speculative_tokens": 3})
    assert plain[0]["free_blocks"] == speculative[0]["free_blocks"]
    assert plain[1]["free_blocks"] - speculative[1]["free_blocks"] == 3 + 2
