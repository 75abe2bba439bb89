"""The GPU check: the gpu tests, then kernel and end-to-end figures, into one output folder.

Sections, in order (`--sections` picks some):
- `tests`: the `gpu`-marked tests under tests/gpu (Triton paged attention for every spec, the
  store-KV kernel, Triton Mamba-2, fla-core's gated delta rule, served hybrids, and bf16 greedy
  parity with transformers per layout), through pytest with a JUnit report. On the CPU they
  are only collected (they need CUDA), which still proves they import.
- `attention`: decode as a fraction of the copy bandwidth, prefill against SDPA's flash backend
  (blocks of 16 and of 64 tokens: a key tile per block-table lookup or one lookup per tile).
- `recurrent`: Mamba-2 (conv1d and SSD scan, prefill and decode) and gated delta rule kernels
  against the torch reference.
- `lora`: the adapter matmuls of one layer (Triton on CUDA) against the torch reference.
- `quant`: quantized-weight GEMMs (FP8 block and per-channel, int4, MXFP4 / int4 MoE) against
  their dequantized references, timed against the dequantized bf16 path.
- `kv_pull`: KV transfer between two engine actors against recomputing, by prompt length, on
  the Llama-8B shape: the crossover in tokens that `pull_threshold_tokens` should be set near.
- `e2e`: batch-64 decode of a Llama-8B-shaped random model against transformers + SDPA, as
  fractions of the memory-bandwidth roofline.
- `quant_e2e`: block-FP8 and MXFP4 (gpt-oss) checkpoints written on the fly, served with their
  weights kept quantized on the kernels and dequantized at load: decode step times and greedy
  agreement.
- `images`: a Gemma-3-shaped image model (SigLIP-So400m at 896 px, Gemma-3-4B text, random
  weights) through `LLM`: images/s and time to first token with 1 and 8 images per request, the
  encoder's share of the step time, a step's images in one encoder call against one per call.
- `layer_ops`: operations per decoder layer and kernel launches per decode step (8 requests)
  with the fused layer kernels, tiny Llama, Gemma 3 and Qwen3.5 models.
- `graphs`: decode with CUDA graphs against `enforce_eager=True` and transformers, tokens/s as
  fractions of the bandwidth roofline at batch 1, 8 and 64, on Llama-8B-, Qwen3.5- and
  Gemma-3-shaped random models; kernel launches per decode step. (Graphs on against eager,
  token for token, for every layout: the `tests` section, tests/gpu/test_cuda_graphs.py.)

Every section's figures (or its error) land in OUT/gpu-check.json and OUT/gpu-check.md, with
device, date and commit, rewritten after each section so that a run cut short keeps what it
measured. `--device cpu --tiny` is the dry run the default test suite runs.

    python benchmarks/gpu_check.py --out OUT [--device cuda] [--tiny] [--sections tests,e2e]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from bench_images import SHAPES as IMAGE_SHAPES  # noqa: E402
from bench_images import image_figures  # noqa: E402
from gpu_check_e2e import decode_run, e2e_figures, profile_decode  # noqa: E402
from gpu_check_graphs import graphs_figures  # noqa: E402
from gpu_check_kernels import (  # noqa: E402
    attention_figures,
    gated_delta_figures,
    mamba_figures,
    measure_copy_bandwidth,
    prefill_tile_sweep,
    quant_figures,
)
from gpu_check_kv_pull import kv_pull_figures  # noqa: E402
from gpu_check_layer_ops import layer_ops_figures  # noqa: E402
from gpu_check_lora import lora_figures  # noqa: E402
from gpu_check_quant_e2e import quant_e2e_figures, quant_e2e_run  # noqa: E402

SECTIONS = (
    "tests", "attention", "recurrent", "lora", "quant", "kv_pull", "e2e", "quant_e2e", "images",
    "layer_ops", "graphs",
)  # fmt: skip
Report = dict[str, object]


def run_tests(args: argparse.Namespace, out: Path) -> Report:
    """pytest over tests/gpu; on CUDA in parallel workers (Triton compiles dominate)."""
    junit = out / "gpu-tests.xml"
    command = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q", "-p",
               "no:cacheprovider", f"--junitxml={junit}"]  # fmt: skip
    if args.device == "cpu":
        command.append("--collect-only")
    elif args.workers > 1:
        command += ["-n", str(args.workers)]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=False,
                          timeout=args.tests_timeout)  # fmt: skip
    (out / "gpu-tests.log").write_text(proc.stdout + proc.stderr)
    report: Report = {"exit_code": proc.returncode, "seconds": round(time.perf_counter() - started)}
    if args.device == "cpu":
        report["collected"] = sum(1 for line in proc.stdout.splitlines() if "::" in line)
        return report
    return report | junit_counts(junit)


def junit_counts(junit: Path) -> Report:
    """Tests, failures, errors and skips of a JUnit report, and the failed tests' names."""
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root[0]
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return {**counts, "failed": failed}


def run_attention(args: argparse.Namespace, device: torch.device) -> Report:
    copy_gbs = measure_copy_bandwidth(device, args.tiny)
    rows = attention_figures(device, _dtype(device), args.tiny, copy_gbs)
    sweep = prefill_tile_sweep(device, _dtype(device), args.tiny)
    return {"copy_bandwidth_gbs": round(copy_gbs, 1), "rows": rows, "prefill_tiles": sweep}


def run_recurrent(args: argparse.Namespace, device: torch.device) -> Report:
    dtype = _dtype(device)
    return {
        "mamba2": mamba_figures(device, dtype, args.tiny),
        "gated_delta": gated_delta_figures(device, dtype, args.tiny),
    }


def run_quant(args: argparse.Namespace, device: torch.device) -> Report:
    rows = quant_figures(device, _dtype(device), args.tiny)
    return {"all_within_tolerance": all(row["within_tolerance"] for row in rows), "rows": rows}


def run_e2e(args: argparse.Namespace, device: torch.device) -> Report:
    copy_gbs = measure_copy_bandwidth(device, args.tiny)
    run = decode_run(args.tiny, device)
    figures = e2e_figures(run, copy_gbs)
    (args.out / "e2e-profile.txt").write_text(profile_decode(run))
    return {"copy_bandwidth_gbs": round(copy_gbs, 1)} | figures


def run_graphs(args: argparse.Namespace, device: torch.device) -> Report:
    copy_gbs = measure_copy_bandwidth(device, args.tiny)
    rows = graphs_figures(device, args.tiny, copy_gbs)
    return {"copy_bandwidth_gbs": round(copy_gbs, 1), "rows": rows}


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def header(args: argparse.Namespace) -> Report:
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {
        "device": name or "cpu",
        "date": datetime.date.today().isoformat(),
        "commit": args.commit or _git_commit(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "fla_core": _version("fla"),
        "flash_attn": _version("flash_attn"),
        "tiny": args.tiny,
    }


def _git_commit() -> str:
    try:
        proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                              capture_output=True, text=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return proc.stdout.strip()


def _version(module: str) -> str | None:
    try:
        return str(__import__(module).__version__)
    except Exception:  # absent, or present but broken: either way not in use
        return None


def run_sections(args: argparse.Namespace, out: Path) -> Report:
    device = torch.device(args.device)
    runners: dict[str, Callable[[], Report]] = {
        "tests": lambda: run_tests(args, out),
        "attention": lambda: run_attention(args, device),
        "recurrent": lambda: run_recurrent(args, device),
        "lora": lambda: {"rows": lora_figures(device, _dtype(device), args.tiny)},
        "quant": lambda: run_quant(args, device),
        "kv_pull": lambda: kv_pull_figures(device, args.tiny),
        "e2e": lambda: run_e2e(args, device),
        "quant_e2e": lambda: {"rows": quant_e2e_figures(quant_e2e_run(args.tiny, device))},
        "images": lambda: image_figures(IMAGE_SHAPES["tiny" if args.tiny else "gpu"], device),
        "layer_ops": lambda: layer_ops_figures(device, args.tiny),
        "graphs": lambda: run_graphs(args, device),
    }
    report: Report = header(args)
    sections: dict[str, Report] = {}
    report["sections"] = sections
    for name in args.sections:
        started = time.perf_counter()
        logging.info("gpu check: %s ...", name)
        try:
            sections[name] = runners[name]()
        except Exception as error:  # one section's failure must not lose the others
            sections[name] = {"error": f"{type(error).__name__}: {error}",
                              "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
        sections[name]["section_seconds"] = round(time.perf_counter() - started, 1)
        logging.info("gpu check: %s done in %.0f s", name, time.perf_counter() - started)
        write_report(report, out)
    return report


def write_report(report: Report, out: Path) -> None:
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu-check.md").write_text(markdown(report))


def markdown(report: Report) -> str:
    """The report as Markdown: the header line, then one table per list of rows."""
    lines = [
        f"GPU check on {report['device']}, {report['date']}, commit {report['commit']} "
        f"(torch {report['torch']}, triton {report['triton']}, fla-core {report['fla_core']}, "
        f"flash-attn {report['flash_attn']})",
        "",
    ]
    sections = report["sections"]
    assert isinstance(sections, dict)
    for name, section in sections.items():
        lines += [f"## {name}", ""]
        scalars = {k: v for k, v in section.items() if not isinstance(v, list | dict)}
        lines += [f"- {key}: {value}" for key, value in scalars.items() if key != "traceback"]
        for key, rows in section.items():
            if isinstance(rows, list) and rows and isinstance(rows[0], dict):
                lines += ["", f"{key}:", "", *table(rows)]
            elif isinstance(rows, list):
                lines += [f"- {key}: {', '.join(map(str, rows)) or 'none'}"]
        lines.append("")
    return "\n".join(lines)


def table(rows: list[dict[str, object]]) -> list[str]:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    body = ["| " + " | ".join(str(row.get(col, "")) for col in columns) + " |" for row in rows]
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *body]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (created)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized shapes (the dry run)")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="pytest-xdist workers for the tests on CUDA")  # fmt: skip
    parser.add_argument("--tests-timeout", type=int, default=330)
    parser.add_argument("--commit", default="", help="default: git rev-parse HEAD")
    args = parser.parse_args(argv)
    args.sections = [name for name in args.sections.split(",") if name]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    if args.device not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = run_sections(args, args.out)
    print(markdown(report))
    sections = report["sections"]
    assert isinstance(sections, dict)
    failed = [name for name, section in sections.items() if "error" in section]
    tests = sections.get("tests", {})
    if tests.get("exit_code", 0) != 0:
        failed.append("tests")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
