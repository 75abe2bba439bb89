"""Tensor parallelism on CPU: two gloo ranks must reproduce the single-rank logits.

Each rank must also build parameters of its shard's shape and read from the checkpoint only
its rows or columns (KV heads are replicated when there are fewer of them than ranks).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tests.helpers.paged_driver import PagedDriver
from tests.helpers.tiny_models import save_tiny_model
from tests.helpers.tp_worker import run_rank
from worker import distributed
from worker.config import ModelConfig, ParallelConfig
from worker.model_loader import load_model

PROMPT = [(5 * i + 1) % 251 for i in range(14)]
VOCAB = 251  # odd: the second rank's vocabulary shard is one row short (padded)
HIDDEN = 64
HEAD_SIZE = 16
TP = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _expected_read(name: str, numel: int, rank: int, num_kv_heads: int) -> int:
    """Elements rank `rank` should read of checkpoint tensor `name`."""
    if "embed_tokens" in name or "lm_head" in name:
        rows = [126, 125][rank]
        return rows * HIDDEN
    is_replicated = (
        "norm" in name
        or name.endswith(("o_proj.bias", "down_proj.bias"))
        or (num_kv_heads < TP and ("k_proj" in name or "v_proj" in name))
    )
    return numel if is_replicated else numel // TP


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Checkpoints, their TP=1 logits, and both ranks' TP=2 results."""
    root = tmp_path_factory.mktemp("tp")
    variants = {
        "kv_split": {"vocab_size": VOCAB},
        "kv_replicated": {
            "vocab_size": VOCAB,
            "num_key_value_heads": 1,
            "tie_word_embeddings": False,
            "attention_bias": True,
            "mlp_bias": True,
        },
    }
    dirs = {}
    for label, overrides in variants.items():
        dirs[label] = str(root / label)
        save_tiny_model("llama", Path(dirs[label]), **overrides)
    out_dir = root / "out"
    out_dir.mkdir()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    mp.spawn(run_rank, args=(TP, init_method, list(dirs.values()), str(out_dir), PROMPT), nprocs=TP)
    single = {}
    for label, path in dirs.items():
        model = load_model(
            ModelConfig.from_pretrained(path, dtype="float32"), ParallelConfig(), "cpu"
        )
        single[label] = PagedDriver(model).step({"req": PROMPT})["req"]
    ranks = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(TP)]
    return {"dirs": dirs, "single": single, "ranks": ranks}


@pytest.mark.parametrize("label", ["kv_split", "kv_replicated"])
def test_tp2_logits_match_tp1(tp_results: dict, label: str) -> None:
    path = tp_results["dirs"][label]
    for rank_result in tp_results["ranks"]:
        got = rank_result[path]["logits"]
        assert got.shape == (len(PROMPT), VOCAB)
        torch.testing.assert_close(got, tp_results["single"][label], atol=1e-5, rtol=0)


@pytest.mark.parametrize("label", ["kv_split", "kv_replicated"])
def test_each_rank_reads_and_holds_only_its_shard(tp_results: dict, label: str) -> None:
    path = tp_results["dirs"][label]
    num_kv_heads = 2 if label == "kv_split" else 1
    checkpoint = load_file(Path(path) / "model.safetensors")
    for rank, rank_result in enumerate(tp_results["ranks"]):
        result = rank_result[path]
        assert rank_result["group"] == {"rank": rank, "size": TP}
        for name, tensor in checkpoint.items():
            assert result["reads"][name] == _expected_read(
                name, tensor.numel(), rank, num_kv_heads
            ), name
        shapes = result["shapes"]
        local_kv = max(1, num_kv_heads // TP)
        qkv_rows = (4 // TP + 2 * local_kv) * HEAD_SIZE
        assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (qkv_rows, HIDDEN)
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (HIDDEN, 4 * HEAD_SIZE // TP)
        assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 128 // TP, HIDDEN)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (HIDDEN, 128 // TP)
        assert shapes["model.embed_tokens.weight"] == (126, HIDDEN)
        assert set(result["loaded"]) == set(shapes)


def test_collectives_are_identity_without_a_process_group() -> None:
    tensor = torch.arange(6.0).view(2, 3)
    assert distributed.tp_size() == 1
    assert distributed.tp_rank() == 0
    assert distributed.all_reduce(tensor) is tensor
    assert distributed.all_gather(tensor, dim=0) is tensor
    distributed.init_distributed(0, 1, "tcp://127.0.0.1:1")  # a world of one needs no group
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="outside a world"):
        distributed.init_distributed(2, 2, "tcp://127.0.0.1:1")
