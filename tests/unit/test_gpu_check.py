"""The GPU check's CPU dry run: `benchmarks/gpu_check.sh OUT --device cpu --tiny` runs every
section on tiny shapes (the gpu tests only collected) and writes the JSON and Markdown report,
so the script cannot rot while no GPU is at hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


SECTIONS_WITHOUT_RAY = [
    "tests", "attention", "recurrent", "lora", "quant", "e2e", "quant_e2e", "images", "layer_ops",
    "graphs",
]  # fmt: skip
"""Every section but `kv_pull`, which starts Ray (its dry run is a `ray` test below)."""


def _dry_run(out: Path, sections: list[str], tmp_path: Path) -> dict:
    """`gpu_check.sh OUT --device cpu --tiny` of these sections: the report."""
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(tmp_path / "none")}
    command = ["sh", "benchmarks/gpu_check.sh", str(out), "--device", "cpu", "--tiny",
               "--commit", "c0", "--sections", ",".join(sections)]  # fmt: skip
    proc = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=480, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu-check.json").read_text())


@pytest.mark.ray
def test_dry_run_of_the_kv_pull_section(tmp_path: Path) -> None:
    sections = _dry_run(tmp_path / "out", ["kv_pull"], tmp_path)["sections"]
    assert list(sections) == ["kv_pull"]
    _check_kv_pull(sections["kv_pull"])


def test_dry_run_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "out"
    report = _dry_run(out, SECTIONS_WITHOUT_RAY, tmp_path)
    assert report["commit"] == "c0"
    sections = report["sections"]
    assert list(sections) == SECTIONS_WITHOUT_RAY
    assert sections["layer_ops"]["rows"][0]["ops_per_layer_per_decode_step"] > 0
    assert {row["kernel"] for row in sections["lora"]["rows"]} == {"torch"}
    quant = sections["quant"]
    assert quant["all_within_tolerance"] is True
    assert {row["kernel"].split()[0] for row in quant["rows"]} == {
        "fp8_block", "fp8_channel", "int4", "mxfp4_moe", "int4_moe"}  # fmt: skip
    assert all(row["ratio_to_bf16"] > 0 for row in quant["rows"])
    assert not [name for name, section in sections.items() if "error" in section]
    assert sections["tests"]["collected"] >= 100
    decode, prefill, paged64 = sections["attention"]["rows"]
    assert decode["fraction_of_copy_bw"] > 0
    assert prefill["ratio_to_sdpa_flash"] > 0
    assert paged64["workload"] == "prefill 1x256 block 64"
    assert paged64["ratio_to_sdpa_flash"] > 0
    assert {row["kernel"] for row in sections["recurrent"]["mamba2"]} == {"torch"}
    assert all(row["conv1d_vs_torch"] > 0 for row in sections["recurrent"]["mamba2"])
    e2e = sections["e2e"]
    assert e2e["ours_tok_s"] > 0
    assert e2e["sdpa_tok_s"] > 0
    assert 0 < e2e["ours_fraction_of_roofline"] < 1
    quant_e2e = sections["quant_e2e"]["rows"]
    assert [row["checkpoint"].split()[0] for row in quant_e2e] == ["fp8-block", "mxfp4"]
    assert all(
        row["kernel_ms_per_step"] > 0 and row["dequantized_ms_per_step"] > 0 for row in quant_e2e
    )
    assert all(0 <= row["greedy_agreement"] <= 1 for row in quant_e2e)
    assert all("dequantized at load" in row["kernel_path"] for row in quant_e2e)  # CPU: auto
    _check_images(sections["images"])
    _check_graphs(sections["graphs"])
    markdown = (out / "gpu-check.md").read_text()
    assert "commit c0" in markdown
    assert "## e2e" in markdown
    assert "| decode 4x1024 |" in markdown
    assert "| mxfp4_moe | tiny |" in markdown
    assert "## images" in markdown


def _check_kv_pull(kv_pull: dict) -> None:
    """Both ways timed at every length through the engine actors (a pull that moved no block
    fails the section); the crossover is a token count or None."""
    assert [row["tokens"] for row in kv_pull["rows"]] == [32, 128]
    for row in kv_pull["rows"]:
        assert row["recompute_ms"] > 0
        assert row["pull_ms"] > 0
    assert kv_pull["crossover_tokens"] is None or kv_pull["crossover_tokens"] > 0


def _check_images(images: dict) -> None:
    """Every setting measured; a step's images in one encoder call, or one per call."""
    rows = {(row["images/request"], row["mode"]): row for row in images["rows"]}
    assert set(rows) == {(k, mode) for k in (1, 8) for mode in ("batched", "one per call", "alone")}
    for row in rows.values():
        assert row["median_images_per_s"] > 0
        assert row["median_ttft_ms"] > 0
        assert 0 < row["encoder_share_of_image_steps"] < 1
    assert rows[(8, "batched")]["images/encoder call"] > 8  # both requests' images in one call
    assert rows[(8, "alone")]["images/encoder call"] == 8
    assert rows[(8, "one per call")]["images/encoder call"] == 1
    assert [ratio["images/request"] for ratio in images["batching"]] == [1, 8]


def test_a_failing_section_is_reported_and_fails_the_run(tmp_path: Path) -> None:
    """A section that raises keeps its error in the report, and the exit code is 1."""
    out = tmp_path / "out"
    code = (
        "import sys; sys.argv[0] = 'gpu_check'; sys.path.insert(0, 'benchmarks');"
        "import gpu_check;"
        "gpu_check.run_recurrent = lambda args, device: 1 / 0;"
        f"sys.exit(gpu_check.main(['--out', {str(out)!r}, '--device', 'cpu', '--tiny',"
        "'--sections', 'recurrent,attention']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    sections = json.loads((out / "gpu-check.json").read_text())["sections"]
    assert sections["recurrent"]["error"].startswith("ZeroDivisionError")
    assert "rows" in sections["attention"]


def _check_graphs(graphs: dict) -> None:
    """Each shape's row with the three modes measured (on CPU graphs are off: the graph and
    eager columns run the same path, so only their presence is checked)."""
    rows = graphs["rows"]
    assert [row["model"] for row in rows] == ["Llama-8B-shaped", "Qwen3.5-shaped", "Gemma-3-shaped"]
    for row in rows:
        assert row["roofline_tok_s"] > 0
        assert all(f"{mode}_fraction" in row for mode in ("graphs", "eager", "transformers"))
