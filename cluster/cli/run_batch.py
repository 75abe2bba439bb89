"""`hybridserve run-batch -i IN.jsonl -o OUT.jsonl`: vLLM's `run-batch`, OpenAI batch format.

Input lines `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body"}`; output lines `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}` in input order (`cluster.openai_api.batch_protocol`). The model runs in this process
(`cluster.batch.openai_run`). vLLM's flags: `-i/--input-file`, `-o/--output-file`,
`--output-tmp-dir`, `--response-role` (assistant only), `--max-log-len`,
`--enable-prompt-tokens-details` and `--enable-force-include-usage` (usage is always in the
body), `--served-model-name`, `--model` and the engine flags; `--dynamic-lora-loading-path` serves
LoRA adapters (`"model": "<served model>:<adapter>"`). Exit status 0 when every line succeeded,
1 when a line errored.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cluster.cli.errors import EXIT_FAILED, EXIT_OK
from cluster.config.engine_flags import add_engine_arg_flags

DEFAULT_WINDOW = 256
"""Lines in flight at once in the one engine (it batches them; prefix groups go together)."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "run-batch", help="run an OpenAI batch file (vLLM's run-batch)"
    )
    parser.add_argument("-i", "--input-file", required=True, type=Path, help="JSONL batch input")
    parser.add_argument("-o", "--output-file", required=True, type=Path, help="JSONL batch output")
    parser.add_argument(
        "--output-tmp-dir", type=Path, default=None, help="folder of the in-progress output"
    )
    parser.add_argument("--model", help="local model folder or Hugging Face ID (default: embedded)")
    parser.add_argument("--served-model-name", help="the `model` the response bodies name")
    parser.add_argument("--response-role", default="assistant", help="only 'assistant'")
    parser.add_argument("--max-log-len", type=int, default=None, help="accepted; unused")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true", help="accepted")
    parser.add_argument("--enable-force-include-usage", action="store_true", help="accepted")
    parser.add_argument(
        "--max-concurrency", type=int, default=DEFAULT_WINDOW, help="lines in flight at once"
    )
    parser.add_argument(
        "--dynamic-lora-loading-path",
        help="a folder of PEFT adapter folders (or hf://OWNER): lines name one as "
        '"model": "<served model>:<adapter>"',
    )
    parser.set_defaults(stream_batching_interval_ms=None)
    add_engine_arg_flags(parser, skip=("model",))
    return parser


def run(args: argparse.Namespace) -> int:
    from cluster.batch.openai_run import run_openai_batch
    from cluster.cli.serve import llm_config_from_flags
    from cluster.serve.llm_server import LLMServer

    if args.response_role != "assistant":
        raise ValueError(f"--response-role must be 'assistant', got {args.response_role!r}")
    if not args.input_file.is_file():
        raise ValueError(f"--input-file {args.input_file} is not a file")
    config = llm_config_from_flags(args)
    kwargs = config["engine_kwargs"]
    if kwargs.get("tensor_parallel_size", 1) == 1:
        kwargs.setdefault("distributed_executor_backend", "uni")
    config["log_engine_metrics"] = False
    if args.dynamic_lora_loading_path:
        config["lora_config"] = {"dynamic_lora_loading_path": args.dynamic_lora_loading_path}
    server = LLMServer(config)
    try:
        summary = run_openai_batch(
            server, args.input_file, args.output_file, args.output_tmp_dir, args.max_concurrency
        )
    finally:
        server.__del__()
    sys.stdout.write(summary.line() + "\n")
    return EXIT_OK if summary.errored == 0 else EXIT_FAILED
