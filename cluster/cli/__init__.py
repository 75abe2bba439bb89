"""The `hybridserve` command, one module per subcommand.

main.py           the parser and the dispatch; errors.py turns errors into exit codes
generate.py       `generate`: stream completions of prompts
chat.py           `chat`: talk with a model's chat template
serve.py          `serve`: the OpenAI API on Ray Serve (serve_session.py: one foreground run)
batch.py          `batch` (also `python -m cluster.batch`): a JSONL file on Ray Data
replay.py         `replay`: KV cache traces, no model
config.py         `config validate`: check a serving config file
"""

from cluster.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
