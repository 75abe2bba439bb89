"""The offline `LLM` end to end (scheduler + runner + kernels) against transformers (CPU fp32).

Greedy tokens of tiny random models must equal transformers' `generate`, whatever the batch,
chunked prefill, block size, prefix-cache hits, KV cache grouping or tensor parallelism.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import kernels
from cluster import LLM, SamplingParams
from cluster.engine.executor import rank_channel
from tests.helpers.engine_probe import engine_stats
from tests.helpers.tiny_models import WINDOW, hf_greedy, save_tiny_model

pytestmark = pytest.mark.parity
REPO_ROOT = Path(__file__).resolve().parents[2]

NUM_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW)
BASE_PROMPTS = [
    [(7 * i + 3) % 256 for i in range(30)],
    [(11 * i + 5) % 256 for i in range(5)],
    [(13 * i + 1) % 256 for i in range(17)],
]
# Share 16 and 24 leading tokens (4 and 6 blocks of 4) with the first prompt.
SHARED_PREFIX_PROMPTS = [
    [*BASE_PROMPTS[0][:16], 9, 8, 7, 6, 5],
    [*BASE_PROMPTS[0][:24], 200, 100, 50],
]
LLM_ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 16,
    "kv_cache_memory_bytes": 1 << 22,
}


def _hf_greedy(hf_model: torch.nn.Module, prompt: list[int], num_new: int = NUM_NEW) -> list[int]:
    return hf_greedy(hf_model, prompt, num_new)


def _tokens(results) -> list[list[int]]:
    return [result.outputs[0].token_ids for result in results]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("llama")
    return path, save_tiny_model("llama", path)


def test_batch_with_chunked_prefill_and_prefix_hits_matches_single_runs(llama) -> None:
    path, hf_model = llama
    expected = [_hf_greedy(hf_model, p) for p in BASE_PROMPTS + SHARED_PREFIX_PROMPTS]
    llm = LLM(str(path), **LLM_ARGS)
    alone = [_tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in BASE_PROMPTS]
    assert alone == expected[:3]
    # One batch: prompts of 30, 5, 17 tokens with a 16-token budget (chunked prefill) plus two
    # prompts that hit the prefix cache (the first prompt's blocks are cached by now).
    results = llm.generate(BASE_PROMPTS + SHARED_PREFIX_PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(results) == expected
    assert [r.num_cached_tokens for r in results[3:]] == [16, 24]
    assert results[0].num_cached_tokens > 0  # the whole first prompt was cached too
    assert all(r.finish_reason == "length" for r in results)
    assert [r.prompt_token_ids for r in results] == BASE_PROMPTS + SHARED_PREFIX_PROMPTS
    llm.shutdown()


def test_fresh_engine_batch_with_hits_inside_one_call(llama) -> None:
    """Later prompts of one call hit blocks the earlier ones filled in previous steps."""
    path, hf_model = llama
    prompts = [BASE_PROMPTS[0], *SHARED_PREFIX_PROMPTS, BASE_PROMPTS[0][:20]]
    llm = LLM(str(path), max_num_seqs=1, **LLM_ARGS)  # one at a time: each sees the last's cache
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(results) == [_hf_greedy(hf_model, p) for p in prompts]
    assert [r.num_cached_tokens for r in results] == [0, 16, 24, 16]
    llm.shutdown()


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_hybrid_manager_on_and_off_give_identical_tokens(family: str, tmp_path: Path) -> None:
    hf_model = save_tiny_model(family, tmp_path)
    prompts = [[(5 * i + 2) % 256 for i in range(23)], [(3 * i + 7) % 256 for i in range(9)]]
    assert len(prompts[0]) > 3 * WINDOW
    params = SamplingParams(temperature=0, max_tokens=12)
    runs = {}
    for disable in (False, True):
        llm = LLM(str(tmp_path), disable_hybrid_kv_cache_manager=disable, **LLM_ARGS)
        groups = llm.client.core.scheduler.kv_cache_config.groups
        # gemma2: 2 window + 2 full layers -> 2 groups; gemma3: 3 window + 1 full -> 4 groups.
        assert len(groups) == (1 if disable else {"gemma2": 2, "gemma3": 4}[family])
        runs[disable] = _tokens(llm.generate(prompts, params, use_tqdm=False))
        llm.shutdown()
    assert runs[False] == runs[True]
    assert runs[False] == [_hf_greedy(hf_model, p, 12) for p in prompts]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "family",
    ["llama", pytest.param("gemma2", marks=pytest.mark.slow)],  # gemma2: softcaps, windows
)
def test_tensor_parallel_2_matches_tp_1(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two spawned rank processes (gloo) give the tokens of one in-process rank, also after a
    call interrupted (Ctrl-C) while the ranks were computing."""
    hf_model = save_tiny_model(family, tmp_path)
    prompts = [BASE_PROMPTS[0], BASE_PROMPTS[2]]
    single = LLM(str(tmp_path), **LLM_ARGS)
    expected = _tokens(single.generate(prompts, GREEDY, use_tqdm=False))
    single.shutdown()
    assert expected == [_hf_greedy(hf_model, p) for p in prompts]
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **LLM_ARGS)
    try:
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        with monkeypatch.context() as patch:
            patch.setattr(rank_channel, "wait", _interrupt_on_call(3, rank_channel.wait))
            with pytest.raises(KeyboardInterrupt):
                llm.generate(prompts, GREEDY, use_tqdm=False)
        assert not llm.client.core.has_unfinished_requests()
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    finally:
        llm.shutdown()


def _interrupt_on_call(number: int, wait: Callable[..., list]) -> Callable[..., list]:
    """`wait` that raises KeyboardInterrupt on its `number`-th call (replies still owed)."""
    calls = itertools.count(1)

    def interrupting_wait(*args: object, **kwargs: object) -> list:
        if next(calls) == number:
            raise KeyboardInterrupt
        return wait(*args, **kwargs)

    return interrupting_wait


def test_preemption_during_prefill_keeps_the_tokens(llama) -> None:
    """Requests preempted while their prompts are still being computed (no output yet); victims
    that already generated tokens, greedy and seeded, on full and hybrid models, are in
    test_hybrid_end_to_end.py."""
    path, hf_model = llama
    # A block costs 4 layers x 1 KiB; 14 blocks hold one request of max_model_len 48 but not
    # three prompts of 30 tokens plus their outputs at once, so requests get preempted.
    llm = LLM(str(path), max_model_len=48, **{**LLM_ARGS, "kv_cache_memory_bytes": 14 * 4096})
    prompts = [[(k * i + k) % 256 for i in range(30)] for k in (3, 5, 7)]
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert engine_stats(llm).num_preemptions > 0
    assert _tokens(results) == [_hf_greedy(hf_model, p) for p in prompts]
    llm.shutdown()


def test_logprobs_and_prompt_logprobs_match_transformers(llama) -> None:
    path, hf_model = llama
    prompt = BASE_PROMPTS[2]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=20, prompt_logprobs=20)
    llm = LLM(str(path), enable_prefix_caching=False, **LLM_ARGS)
    (result,) = llm.generate([prompt], params, use_tqdm=False)
    llm.shutdown()
    tokens = result.outputs[0].token_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0].double()
    reference = torch.log_softmax(logits, dim=-1)
    num_prompt = len(prompt)
    prompt_lps = result.prompt_logprobs
    assert prompt_lps is not None
    assert prompt_lps[0] is None  # vLLM's convention: the first prompt token has no context
    assert len(prompt_lps) == num_prompt
    for pos in range(1, num_prompt):
        position = prompt_lps[pos]
        assert position is not None
        assert next(iter(position)) == prompt[pos]  # the prompt's own token comes first
        chosen = float(reference[pos - 1, prompt[pos]])
        assert position[prompt[pos]].logprob == pytest.approx(chosen, abs=1e-4)
        assert _top_ids(position, 20) == reference[pos - 1].topk(20).indices.tolist()
    sample_lps = result.outputs[0].logprobs
    assert sample_lps is not None
    assert len(sample_lps) == len(tokens)
    for step, (token, position) in enumerate(zip(tokens, sample_lps, strict=True)):
        row = reference[num_prompt - 1 + step]
        assert next(iter(position)) == token
        assert position[token].rank == 1  # greedy
        assert position[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert _top_ids(position, 20) == row.topk(20).indices.tolist()
        top = [position[t].logprob for t in _top_ids(position, 20)]
        assert top == pytest.approx(row.topk(20).values.tolist(), abs=1e-4)
    expected_sum = sum(position[t].logprob for t, position in zip(tokens, sample_lps, strict=True))
    assert result.outputs[0].cumulative_logprob == pytest.approx(expected_sum)


def _top_ids(position, k: int) -> list[int]:
    """Token IDs of one position's logprobs by rank, the top k."""
    ranked = sorted(position.items(), key=lambda item: item[1].rank)
    return [token for token, lp in ranked if lp.rank <= k]


def test_block_aligned_prompts_shared_prefixes_and_single_token_outputs(llama) -> None:
    """Prompts of exactly 1, 2 and 4 blocks (block size 4), asked for one token each, then many
    prompts sharing a 13-token prefix through two sequence slots: transformers' tokens, and
    the later prompts read the shared blocks from the prefix cache."""
    path, hf_model = llama
    llm = LLM(str(path), max_num_seqs=2, **LLM_ARGS)
    aligned = [BASE_PROMPTS[0][:4], BASE_PROMPTS[1][:4] * 2, BASE_PROMPTS[0][:16]]
    one_token = SamplingParams(temperature=0, max_tokens=1)
    for _ in range(2):  # the second time every block but the last token's is cached
        results = llm.generate(aligned, one_token, use_tqdm=False)
        assert _tokens(results) == [_hf_greedy(hf_model, p, 1) for p in aligned]
        assert all(r.finish_reason == "length" for r in results)
    assert [r.num_cached_tokens for r in results] == [0, 4, 12]
    prefix = BASE_PROMPTS[2][:13]
    shared = [prefix + [k] * (k % 3) for k in range(7)]
    results = llm.generate(shared, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert _tokens(results) == [_hf_greedy(hf_model, p, 4) for p in shared]
    assert all(r.num_cached_tokens == 12 for r in results[2:])
    llm.shutdown()


def test_seeded_sampling_is_reproducible_across_batches(llama) -> None:
    path, _ = llama
    llm = LLM(str(path), **LLM_ARGS)
    seeded = SamplingParams(temperature=1.0, max_tokens=8, seed=1234)
    other = SamplingParams(temperature=1.0, max_tokens=8)
    alone = _tokens(llm.generate([BASE_PROMPTS[0]], seeded, use_tqdm=False))[0]
    batched = llm.generate(BASE_PROMPTS, [seeded, other, other], use_tqdm=False)
    assert batched[0].outputs[0].token_ids == alone
    reseeded = _tokens(
        llm.generate([BASE_PROMPTS[1], BASE_PROMPTS[0]], [other, seeded], use_tqdm=False)
    )
    assert reseeded[1] == alone
    different = _tokens(
        llm.generate(
            [BASE_PROMPTS[0]],
            SamplingParams(temperature=1.0, max_tokens=8, seed=99),
            use_tqdm=False,
        )
    )[0]
    assert different != alone
    llm.shutdown()


TRITON_GENERATE = """
import json, sys
from cluster import LLM, SamplingParams
from kernels import triton_attention
assert triton_attention.is_interpreted()
llm = LLM(sys.argv[1], attention_backend="triton", device="cpu", block_size=4, dtype="float32",
          max_num_batched_tokens=8, kv_cache_memory_bytes=1 << 20)
prompts = json.loads(sys.argv[2])
results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
print(json.dumps([r.outputs[0].token_ids for r in results]))
llm.shutdown()
"""


@pytest.mark.skipif(not kernels.HAS_TRITON, reason="triton is not installed")
def test_triton_backend_on_the_interpreter_gives_transformers_tokens(tmp_path: Path) -> None:
    """The Triton store and attention kernels inside the real runner (Gemma 2: window and full
    groups viewing shared KV buffers, softcap, chunked prefill), on CPU under TRITON_INTERPRET."""
    hf_model = save_tiny_model("gemma2", tmp_path, num_hidden_layers=2)
    prompts = [BASE_PROMPTS[2][:13], BASE_PROMPTS[1]]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_GENERATE, str(tmp_path), json.dumps(prompts)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    tokens = json.loads(proc.stdout.strip().splitlines()[-1])
    assert tokens == [_hf_greedy(hf_model, p, 6) for p in prompts]


def test_default_model_matches_transformers_on_the_gguf_file(
    default_model_dir: Path, gguf_reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LLM()` serves the embedded default model token-identically to transformers, for plain
    prompts and for a conversation rendered with its chat template."""
    import worker.default_model

    monkeypatch.setattr(worker.default_model, "DEFAULT_CACHE_DIR", default_model_dir)
    tokenizer, hf_model = gguf_reference
    prompts = ["The capital of France is", "Hello, my name is"]
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    llm = LLM(max_model_len=256)
    try:
        results = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
        )
        (chat,) = llm.chat(
            conversation, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
        )
    finally:
        llm.shutdown()
    assert results[0].outputs[0].text.startswith(" Paris")
    chat_ids = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True
    )["input_ids"]
    assert chat.prompt_token_ids == chat_ids
    assert chat.prompt is not None
    assert chat.prompt.endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([chat_ids]),
            attention_mask=torch.ones(1, len(chat_ids), dtype=torch.long),  # pad = <|im_end|>
            max_new_tokens=8,
            do_sample=False,
        )
    assert chat.outputs[0].token_ids == out[0, len(chat_ids) :].tolist()
    for prompt, result in zip(prompts, results, strict=True):
        prompt_ids = tokenizer(prompt).input_ids
        assert result.prompt_token_ids == prompt_ids
        assert result.outputs[0].token_ids == _hf_greedy(hf_model, prompt_ids, 12)
        assert result.outputs[0].text == tokenizer.decode(
            result.outputs[0].token_ids, skip_special_tokens=True
        )


def test_min_tokens_masks_stop_tokens_like_transformers(llama) -> None:
    path, hf_model = llama
    prompt = BASE_PROMPTS[0]
    stop = _hf_greedy(hf_model, prompt)[0]  # the token greedy decoding would emit first
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NUM_NEW,
            do_sample=False,
            eos_token_id=stop,
            min_new_tokens=3,
        )
    expected = out[0, len(prompt) :].tolist()
    llm = LLM(str(path), **LLM_ARGS)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=3, stop_token_ids=(stop,))
    (result,) = llm.generate([prompt], params, use_tqdm=False)
    llm.shutdown()
    assert stop not in result.outputs[0].token_ids[:3]
    assert result.outputs[0].token_ids == expected[: len(result.outputs[0].token_ids)]
    assert result.outputs[0].token_ids == expected  # transformers stops at the same token
