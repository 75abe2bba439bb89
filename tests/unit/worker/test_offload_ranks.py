"""The offload store over two tensor-parallel ranks (gloo, CPU): a load counts as done only when
every rank has it; a page or shard file missing on one rank fails the load on both."""

from __future__ import annotations

import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp

from tests.helpers.offload_rank import run_offload_rank

TP = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        return int(sock.getsockname()[1])


def test_ranks_agree_on_each_load_and_keep_their_own_shard_files(tmp_path: Path) -> None:
    init_method = f"tcp://127.0.0.2:{_free_port()}"
    mp.spawn(run_offload_rank, args=(TP, init_method, str(tmp_path)), nprocs=TP)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(TP)]
    assert ranks[0]["reports"] == ranks[1]["reports"]
    finished = [x for report in ranks[0]["reports"] for x in report["finished"]]
    failed = [x for report in ranks[0]["reports"] for x in report["failed"]]
    assert sorted(finished) == ["a", "c"]
    assert failed == ["b"]  # its page is missing on rank 1 only
    assert ranks[0]["files"] == ["fingerprint-rank1/g0-ab-1.kv", "fingerprint/g0-ab-1.kv"]
