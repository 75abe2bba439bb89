"""LoRA adapters over two tensor-parallel ranks (spawned processes, gloo, CPU fp32) against
transformers + PEFT with the adapter merged.

One batch mixes two random adapters on every linear projection and the base model; each rank
holds its cut of every adapter matrix (column-parallel B rows, row-parallel A columns with the
shrink all-reduced), and every request's greedy tokens must equal its merged model's. A rank
that applied its cut wrongly, or not at all, changes the tokens. Llama covers attention and MLP,
Bamba the Mamba-2 in_proj rows and out_proj (the families of the `slow` all-family run in
test_lora_parity.py, cut to two small models and one batch).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cluster import LLM, LoRARequest, SamplingParams
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_lora import save_random_adapter
from tests.helpers.tiny_models import hf_greedy, save_tiny_model

pytestmark = pytest.mark.parity

NUM_NEW = 6
PROMPT = [(7 * i + 3) % 256 for i in range(13)]
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW)
LLM_ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 16,
    "kv_cache_memory_bytes": 1 << 22,
}
SAVERS: dict[str, Callable[[str, Path], torch.nn.Module]] = {
    "llama": save_tiny_model,
    "bamba": save_tiny_hybrid,
}


@pytest.mark.parametrize("family", list(SAVERS))
def test_two_ranks_apply_each_adapter_like_the_merged_peft_model(
    family: str, tmp_path: Path
) -> None:
    hf_model = SAVERS[family](family, tmp_path / "base")
    expected = {None: hf_greedy(hf_model, PROMPT, NUM_NEW)}
    adapters = []
    for seed, name in enumerate(("one", "two"), start=1):
        merged = save_random_adapter(hf_model, tmp_path / name, seed=seed)
        expected[name] = hf_greedy(merged, PROMPT, NUM_NEW)
        adapters.append(LoRARequest(name, seed, str(tmp_path / name)))
    assert len({tuple(tokens) for tokens in expected.values()}) == 3  # each adapter matters
    one, two = adapters
    llm = LLM(
        str(tmp_path / "base"), enable_lora=True, max_loras=2, tensor_parallel_size=2, **LLM_ARGS
    )
    try:
        results = llm.generate([PROMPT] * 3, GREEDY, lora_request=[one, None, two], use_tqdm=False)
    finally:
        llm.shutdown()
    for name, result in zip(("one", None, "two"), results, strict=True):
        assert result.outputs[0].token_ids == expected[name], name
