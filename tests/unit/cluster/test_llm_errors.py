"""The offline `LLM` on bad input: a clear error naming the problem, and nothing lost.

Every rejected `generate` call must leave the engine empty (no prompt of the call queued, not
even the valid ones before the bad one) and the same `LLM` must then generate exactly what it
generated before. Bad constructor arguments must be rejected before any rank process starts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.engine.executor.rank_channel import RankFailure
from tests.helpers.tiny_models import save_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=4)
PROMPT = [(7 * i + 3) % 256 for i in range(10)]
MAX_MODEL_LEN = 32
VOCAB = 256
LLM_ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "kv_cache_memory_bytes": 1 << 22,
    "max_model_len": MAX_MODEL_LEN,
}


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    path = tmp_path_factory.mktemp("llama")
    return save_tiny_model("llama", path), path


@pytest.fixture(scope="module")
def model_dir(hf_and_dir: tuple[torch.nn.Module, Path]) -> Path:
    return hf_and_dir[1]


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    engine = LLM(str(model_dir), **LLM_ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def baseline(llm: LLM, hf_and_dir: tuple[torch.nn.Module, Path]) -> list[int]:
    """The greedy tokens of PROMPT before any bad call (transformers' tokens)."""
    tokens = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        out = hf_and_dir[0].generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False)
    assert tokens == out[0, len(PROMPT) :].tolist()
    return tokens


BAD_CALLS = [
    pytest.param([[]], GREEDY, ValueError, "prompt 0 is empty", id="empty-prompt"),
    pytest.param([PROMPT, []], GREEDY, ValueError, "prompt 1 is empty", id="empty-second"),
    pytest.param([[1, VOCAB]], GREEDY, ValueError, r"token ID 256 .*\[0, 256\)", id="oov"),
    pytest.param([PROMPT, [5, -1]], GREEDY, ValueError, "prompt 1: token ID -1", id="negative"),
    pytest.param([[1.5, 2]], GREEDY, TypeError, "token IDs must be ints, got 1.5", id="float"),
    pytest.param([[True, 2]], GREEDY, TypeError, "token IDs must be ints", id="bool-token"),
    pytest.param(
        [PROMPT, [1] * MAX_MODEL_LEN],
        GREEDY,
        ValueError,
        r"prompt 1: .*max_model_len=32",
        id="too-long",
    ),
    pytest.param(
        ["some text"],
        GREEDY,
        ValueError,
        "prompt 0 is text, but .* no tokenizer",
        id="text-without-tokenizer",
    ),
    pytest.param(None, GREEDY, TypeError, "prompts must be a string", id="prompts-none"),
    pytest.param(7, GREEDY, TypeError, "got int", id="prompts-int"),
    pytest.param(b"text", GREEDY, TypeError, "got bytes", id="prompts-bytes"),
    pytest.param([PROMPT, 7], GREEDY, TypeError, "prompt 1 must be a string", id="prompt-int"),
    pytest.param([PROMPT], {"temperature": 0}, TypeError, "SamplingParams", id="params-dict"),
    pytest.param(
        [PROMPT, PROMPT],
        [GREEDY],
        ValueError,
        "1 sampling params for 2 prompts",
        id="params-length",
    ),
    pytest.param(
        [PROMPT], ["greedy"], TypeError, r"sampling_params\[0\] must be", id="params-item"
    ),
]


@pytest.mark.parametrize(("prompts", "params", "error", "match"), BAD_CALLS)
def test_bad_generate_call_raises_and_leaves_the_llm_usable(
    llm: LLM, baseline: list[int], prompts, params, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.client.core.has_unfinished_requests()  # no prompt of the call was queued
    again = llm.generate([PROMPT, PROMPT[:5]], GREEDY, use_tqdm=False)
    assert again[0].outputs[0].token_ids == baseline
    assert not llm.client.core.has_unfinished_requests()


@pytest.mark.parametrize(
    ("messages", "error", "match"),
    [
        ([{"role": "user", "content": "hi"}], ValueError, "rendered by the tokenizer, but"),
        ("hi", TypeError, "messages must be a list"),
        ([[{"role": "user", "content": "hi"}], []], TypeError, "conversation 1 must be a non-"),
        ([{"role": "user"}], TypeError, "with 'role' and 'content'"),
    ],
)
def test_bad_chat_call_raises_and_leaves_the_llm_usable(
    llm: LLM, baseline: list[int], messages, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert not llm.client.core.has_unfinished_requests()
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == baseline


def test_one_flat_list_of_ids_is_one_prompt_and_numpy_ints_are_accepted(
    llm: LLM, baseline: list[int]
) -> None:
    import numpy as np

    (result,) = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    assert result.outputs[0].token_ids == baseline
    (result,) = llm.generate([np.array(PROMPT).tolist()], GREEDY, use_tqdm=False)
    assert result.outputs[0].token_ids == baseline
    (result,) = llm.generate([[np.int64(t) for t in PROMPT]], GREEDY, use_tqdm=False)
    assert result.outputs[0].token_ids == baseline
    assert llm.generate([], GREEDY, use_tqdm=False) == []


def test_prompt_of_max_model_len_minus_one_gets_one_token(llm: LLM) -> None:
    (result,) = llm.generate([[3] * (MAX_MODEL_LEN - 1)], GREEDY, use_tqdm=False)
    assert len(result.outputs[0].token_ids) == 1
    assert result.finish_reason == "length"


def test_generate_after_shutdown_is_an_error(model_dir: Path) -> None:
    engine = LLM(str(model_dir), **LLM_ARGS)
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate([PROMPT], GREEDY, use_tqdm=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"attention_backend": "cuda"}, r"unknown attention_backend 'cuda'.*flash_attn"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"dtype": "int8"}, "unknown dtype 'int8'"),
        ({"device": "tpu"}, "device must be 'auto', 'cpu' or 'cuda'"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"max_model_len": 129}, "exceeds the model's max_position_embeddings=128"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        ({"kv_cache_memory_bytes": 100}, "hold 0 block"),
    ],
)
def test_bad_engine_argument_is_rejected_with_the_fix(
    model_dir: Path, kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(model_dir), **{**LLM_ARGS, **kwargs})  # type: ignore[arg-type]


def test_unavailable_attention_backend_says_why(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="flash-attn needs a CUDA device"):
        LLM(str(model_dir), attention_backend="flash_attn", device="cpu", **LLM_ARGS)


def test_tensor_parallel_size_that_does_not_split_the_heads_is_rejected_before_spawning(
    model_dir: Path,
) -> None:
    # 4 query heads: 3 ranks cannot share them. Raised in this process (no rank traceback).
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_attention_heads=4"):
        LLM(str(model_dir), tensor_parallel_size=3, **LLM_ARGS)


def test_missing_model_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'.*no-such-model' is not a folder"):
        LLM(str(tmp_path / "no-such-model"), **LLM_ARGS)


def test_unsupported_architecture_lists_the_supported_ones(model_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "gpt2"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel' is not supported.*LlamaForCausalLM"):
        LLM(str(other), **LLM_ARGS)


def test_rank_failures_come_back_as_value_error_or_runtime_error() -> None:
    def failure(exc: Exception) -> RankFailure:
        try:
            raise exc
        except Exception as raised:
            return RankFailure.from_exception(raised)

    bad_input = failure(ValueError("block_size 3 is not supported")).to_exception(rank=1)
    assert isinstance(bad_input, ValueError)
    assert str(bad_input) == "tensor-parallel rank 1: block_size 3 is not supported"
    crash = failure(RuntimeError("NCCL timeout")).to_exception(rank=0)
    assert type(crash) is RuntimeError
    assert "rank 0 failed" in str(crash)
    assert "Traceback" in str(crash)
    assert "NCCL timeout" in str(crash)


@pytest.mark.slow
def test_a_rank_rejecting_its_configuration_raises_value_error(model_dir: Path) -> None:
    """Two rank processes both refuse flash-attn on CPU; the caller gets the reason."""
    assert not torch.cuda.is_available()
    with pytest.raises(ValueError, match=r"tensor-parallel rank 0: .*flash-attn needs a CUDA"):
        LLM(str(model_dir), tensor_parallel_size=2, attention_backend="flash_attn", **LLM_ARGS)
