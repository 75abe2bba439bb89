"""Tensor-parallel linear layers with per-parameter weight loaders.

Column-parallel layers split the output features over ranks (no communication); row-parallel
layers split the input features and sum the partial outputs with an all-reduce. Packed layers
(merged q/k/v, merged gate/up) hold several checkpoint tensors; their loaders take a `shard_id`
naming which one is being loaded and copy this rank's rows of it into the right place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from kernels.batch_invariant import TORCH_MATH, LayerMath
from worker.config import ParallelConfig
from worker.distributed import all_gather, all_reduce
from worker.layers.loading import (
    ShardId,
    WeightSource,
    copy_checked,
    default_weight_loader,
    new_parameter,
    read_full,
    read_part,
)

if TYPE_CHECKING:
    from worker.quantization.execution import QuantizedWeights


class _Projection(nn.Module):
    """A layer whose `weight` may stay quantized on a kernel (`worker.quantization.execution`
    sets `quantized` at load when the model runs on quantized-weight kernels)."""

    quantized_params = ("weight",)
    weight: nn.Parameter

    def __init__(self) -> None:
        super().__init__()
        self.quantized: QuantizedWeights | None = None
        self.math: LayerMath = TORCH_MATH
        """Products against weights and pointwise functions (the batch-invariant mode's once
        installed)."""

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + bias, on the quantized kernel when the weight has one."""
        if self.quantized is None:
            return self.math.linear(x, self.weight, bias)
        return self.quantized.linear(x, bias)

    def offer_quantized(
        self, param: nn.Parameter, source: WeightSource, **cut: tuple[int, int] | int
    ) -> bool:
        """Whether the quantized weights took `source` (else the caller loads it dense); only
        the layer's own weight is offered (adapters cut their factors with these loaders)."""
        if self.quantized is None or param is not self.weight:
            return False
        return self.quantized.take("weight", param, source, **cut)  # type: ignore[arg-type]


class ReplicatedLinear(_Projection):
    """A bias-free projection every rank holds and computes in full (small matrices)."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = new_parameter((output_size, input_size), self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, source: WeightSource, shard_id: ShardId = None
    ) -> None:
        """The whole checkpoint tensor."""
        if shard_id is None and self.offer_quantized(param, source):
            return
        default_weight_loader(param, source, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, None)


class ProjectionWeights(nn.Module):
    """A projection whose owner loads its rows its own way (a mixer's fused `in_proj`): holds
    `weight` (and `bias`) under the checkpoint's names and applies them as a column projection."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.math: LayerMath = TORCH_MATH
        """Products against weights and pointwise functions (the batch-invariant mode's once
        installed)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.math.linear(x, self.weight, self.bias)


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact division, with a readable error when a size does not split over the ranks."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tp_size={denominator}")
    return numerator // denominator


class ColumnParallelLinear(_Projection):
    """y = x W^T + b with W's output rows split evenly over ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        parallel: ParallelConfig,
        bias: bool = False,
        gather_output: bool = False,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.gather_output = gather_output
        self.output_size_per_rank = divide(output_size, parallel.tp_size, "output_size")
        self.weight = new_parameter((self.output_size_per_rank, input_size), self.weight_loader)
        self.bias = (
            new_parameter((self.output_size_per_rank,), self.weight_loader) if bias else None
        )

    def weight_loader(
        self, param: nn.Parameter, source: WeightSource, shard_id: ShardId = None
    ) -> None:
        """Copy this rank's block of output rows."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        size = self.output_size_per_rank
        start = self.parallel.rank * size
        if self.offer_quantized(param, source, rows=(start, size)):
            return
        copy_checked(param.data, read_part(source, 0, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(x, self.bias)
        if self.gather_output and self.parallel.tp_size > 1:
            out = all_gather(out, dim=-1)
        return out


class _Shard(NamedTuple):
    """Where one packed checkpoint tensor goes: rows of the parameter and of the source."""

    param_start: int
    size: int
    source_start: int


class _PackedColumnLinear(ColumnParallelLinear):
    """A column-parallel layer whose rows concatenate several checkpoint tensors."""

    def __init__(
        self,
        input_size: int,
        shards: dict[str | int, _Shard],
        parallel: ParallelConfig,
        bias: bool,
    ) -> None:
        total = sum(shard.size for shard in shards.values())
        super().__init__(input_size, total * parallel.tp_size, parallel, bias=bias)
        self.shards = shards

    def weight_loader(
        self, param: nn.Parameter, source: WeightSource, shard_id: ShardId = None
    ) -> None:
        """Copy this rank's rows of the checkpoint tensor `shard_id` into its slot."""
        if shard_id not in self.shards:
            raise ValueError(f"{type(self).__name__} expects a shard id in {list(self.shards)}")
        shard = self.shards[shard_id]
        rows = (shard.source_start, shard.size)
        if self.offer_quantized(param, source, rows=rows, param_start=shard.param_start):
            return
        target = param.data.narrow(0, shard.param_start, shard.size)
        copy_checked(target, read_part(source, 0, shard.source_start, shard.size))


class MergedColumnParallelLinear(_PackedColumnLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(
        self, input_size: int, output_sizes: list[int], parallel: ParallelConfig, bias: bool = False
    ) -> None:
        shards: dict[str | int, _Shard] = {}
        param_start = 0
        for index, output_size in enumerate(output_sizes):
            size = divide(output_size, parallel.tp_size, f"output_sizes[{index}]")
            shards[index] = _Shard(param_start, size, parallel.rank * size)
            param_start += size
        super().__init__(input_size, shards, parallel, bias)
        self.output_sizes_per_rank = [shard.size for shard in shards.values()]


class QKVParallelLinear(_PackedColumnLinear):
    """Query, key and value projections in one matmul; shard ids "q", "k", "v".

    Query heads are split over ranks. KV heads are split too when there are at least as many as
    ranks; otherwise each rank keeps one KV head, replicated over `tp_size / num_kv_heads` ranks.
    With `with_value=False` there are no value rows (a layer whose values come from the key
    projection, Gemma 4's K = V): `split` then returns the key projection as the value too.
    """

    def __init__(  # noqa: PLR0913 (the head layout, then the options)
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        parallel: ParallelConfig,
        bias: bool = False,
        with_value: bool = True,
    ) -> None:
        tp_size, rank = parallel.tp_size, parallel.rank
        self.with_value = with_value
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            if tp_size % total_num_kv_heads:
                raise ValueError(
                    f"tp_size={tp_size} is not a multiple of num_key_value_heads="
                    f"{total_num_kv_heads}, so KV heads cannot be replicated evenly"
                )
            self.num_kv_heads = 1
            first_kv_head = rank // (tp_size // total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            first_kv_head = rank * self.num_kv_heads
        self.head_size = head_size
        q_size, kv_size = self.num_heads * head_size, self.num_kv_heads * head_size
        kv_start = first_kv_head * head_size
        shards: dict[str | int, _Shard] = {
            "q": _Shard(0, q_size, rank * q_size),
            "k": _Shard(q_size, kv_size, kv_start),
        }
        if with_value:
            shards["v"] = _Shard(q_size + kv_size, kv_size, kv_start)
        super().__init__(hidden_size, shards, parallel, bias)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, (H + 2 * KV) * D] -> q [T, H * D], k [T, KV * D], v [T, KV * D]."""
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        if not self.with_value:
            q, k = torch.split(qkv, [q_size, kv_size], dim=-1)
            return q, k, k
        q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
        return q, k, v


class RowParallelLinear(_Projection):
    """y = x W^T + b with W's input columns split over ranks and the partial sums all-reduced."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        parallel: ParallelConfig,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.input_size_per_rank = divide(input_size, parallel.tp_size, "input_size")
        self.weight = new_parameter((output_size, self.input_size_per_rank), self.weight_loader)
        self.bias = new_parameter((output_size,), self.bias_loader) if bias else None

    def weight_loader(
        self, param: nn.Parameter, source: WeightSource, shard_id: ShardId = None
    ) -> None:
        """Copy this rank's block of input columns."""
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear has no shard {shard_id!r}")
        size = self.input_size_per_rank
        start = self.parallel.rank * size
        if self.offer_quantized(param, source, cols=(start, size)):
            return
        copy_checked(param.data, read_part(source, 1, start, size))

    def bias_loader(
        self, param: nn.Parameter, source: WeightSource, shard_id: ShardId = None
    ) -> None:
        """The bias is replicated: it is added once, after the all-reduce."""
        copy_checked(param.data, read_full(source))

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of x W^T (its input columns), without the bias or all-reduce."""
        return self.project(x, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return self.project(x, self.bias)
        out = all_reduce(self.partial_sum(x))
        return out if self.bias is None else out + self.bias
