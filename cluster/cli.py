"""The `hybridserve` command: offline generation and KV trace replay.

`hybridserve generate --prompt "..."` runs the in-process engine (the embedded default model when
no `--model` is given); `hybridserve replay TRACE.json ...` is `python -m scheduler.replay`;
`hybridserve config validate FILE.yaml` checks a serving config without starting anything.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from scheduler import replay


def _generate_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("generate", help="generate completions in-process")
    parser.add_argument("--model", help="local Hugging Face model folder (default: embedded)")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--attention-backend", default="auto", choices=["auto", "triton", "flash_attn", "torch"]
    )
    parser.add_argument("--disable-hybrid-kv-cache-manager", action="store_true")
    return parser


def _run_generate(args: argparse.Namespace) -> int:
    from cluster.llm import LLM
    from scheduler.request import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
    )
    try:
        results = llm.generate(args.prompt, params, use_tqdm=sys.stderr.isatty())
        for prompt, result in zip(args.prompt, results, strict=True):
            sys.stdout.write(f"{prompt}{result.outputs[0].text}\n")
    finally:
        llm.shutdown()
    return 0


def _config_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    config_commands = subparsers.add_parser("config", help="check serving config files")
    actions = config_commands.add_subparsers(dest="action", required=True)
    validate = actions.add_parser(
        "validate", help="validate an LLMConfig, LLMServingArgs or Serve config YAML file"
    )
    validate.add_argument("file", metavar="FILE.yaml")


def _run_config_validate(path: str) -> int:
    from cluster.config import validate_config_file

    try:
        model_ids = validate_config_file(path)
    except ValueError as error:
        sys.stderr.write(f"error: {path}: {error}\n")
        return 2
    sys.stdout.write(f"ok: {len(model_ids)} model(s): {', '.join(model_ids)}\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hybridserve` console script."""
    parser = argparse.ArgumentParser(prog="hybridserve", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    generate_parser = _generate_parser(subparsers)
    replay_parser = subparsers.add_parser("replay", help="replay KV cache traces (no model)")
    replay_parser.add_argument("files", nargs="+", metavar="FILE.json")
    _config_parser(subparsers)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level)
    if args.command == "replay":
        return replay.main(args.files)
    if args.command == "config":
        return _run_config_validate(args.file)
    try:
        return _run_generate(args)
    except ValueError as error:
        generate_parser.error(str(error))
    return 2


if __name__ == "__main__":
    sys.exit(main())
