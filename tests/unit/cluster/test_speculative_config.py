"""`speculative_config` (vLLM's keys) through the engine arguments, the CLI flag and
`LLMConfig.engine_kwargs`: defaults, the frozen config it becomes, one-line errors naming the
key."""

from __future__ import annotations

import argparse
import re

import pytest

from cluster.config.engine_args import validate_engine_kwargs
from cluster.config.engine_flags import add_engine_arg_flags, engine_kwargs_from_args
from cluster.config.llm_config import LLMConfig
from scheduler.spec_config import SpecMethod, SpeculativeConfig


def _config(spec: dict) -> SpeculativeConfig:
    args = validate_engine_kwargs({"speculative_config": spec})
    assert args.speculative_config is not None
    return args.speculative_config.to_config()


def test_ngram_defaults_and_overrides() -> None:
    assert _config({"method": "ngram", "num_speculative_tokens": 3}) == SpeculativeConfig(
        SpecMethod.NGRAM, 3, prompt_lookup_min=5, prompt_lookup_max=5
    )
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_max": 2,
        "disable_by_batch_size": 8,
    }
    config = _config(spec)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 2)  # vLLM's rule
    assert config.disable_by_batch_size == 8


def test_draft_model_and_mtp() -> None:
    spec = {"model": "/models/draft", "num_speculative_tokens": 4}  # method defaults to draft_model
    assert _config(spec) == SpeculativeConfig(SpecMethod.DRAFT_MODEL, 4, model="/models/draft")
    assert _config(spec).draft_lookahead == 4  # its drafts' KV: k slots past each step
    mtp = _config({"method": "mtp", "num_speculative_tokens": 1})
    assert (mtp.method, mtp.model, mtp.draft_lookahead) == (SpecMethod.MTP, None, 1)
    assert _config({"method": "ngram", "num_speculative_tokens": 3}).draft_lookahead == 0


BAD = [
    ({"method": "ngram", "num_speculative_tokens": 0},
     "speculative_config.num_speculative_tokens must be >= 1, got 0"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1},
     "unknown speculative_config key 'lookahead'"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"num_speculative_tokens": 2}, "speculative_config needs 'method'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"},
     "model names a draft model: not used by method 'ngram'"),
    ({"method": "draft_model", "num_speculative_tokens": 2},
     "method 'draft_model' needs 'model'"),
    ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "prompt_lookup_max applies to method 'ngram' only"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
      "prompt_lookup_max": 3}, "prompt_lookup_min (5) must be <= prompt_lookup_max (3)"),
    ({"method": "mtp", "num_speculative_tokens": 2, "model": "/models/draft"},
     "model names a draft model: not used by method 'mtp'"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "message"), BAD)
def test_bad_keys_and_combinations_are_one_line_errors_naming_the_key(
    spec: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        validate_engine_kwargs({"speculative_config": spec})
    assert "\n" not in str(info.value)


def test_cli_flag_takes_a_json_object() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arg_flags(parser)
    args = parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    )
    kwargs = engine_kwargs_from_args(args)
    assert kwargs == {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
    assert validate_engine_kwargs(kwargs).speculative_config is not None
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "[1, 2]"])


def test_llm_config_engine_kwargs_carry_it() -> None:
    config = LLMConfig.model_validate(
        {
            "model_loading_config": {"model_id": "m", "model_source": "/models/m"},
            "engine_kwargs": {
                "speculative_config": {"method": "ngram", "num_speculative_tokens": 4}
            },
        }
    )
    spec = config.engine_args().speculative_config
    assert spec is not None
    assert spec.num_speculative_tokens == 4
    with pytest.raises(ValueError, match="unknown speculative_config key"):
        LLMConfig.model_validate(
            {
                "model_loading_config": {"model_id": "m", "model_source": "/models/m"},
                "engine_kwargs": {"speculative_config": {"method": "ngram", "k": 4}},
            }
        )
