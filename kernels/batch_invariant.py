"""Batch-invariant operations: a row's result does not depend on how many rows share the call
(the batch-invariant mode's weight products and pointwise functions, installed on the layers at
model build as `INVARIANT_MATH`; `TORCH_MATH` is torch's own).

A CPU GEMM (MKL, oneDNN) picks its blocking, its kernel (gemv for one row) and its thread split
from the number of rows M, so row r of `x @ W^T` changes in the last bits with the batch around
it. Here every product against a weight runs on tiles of exactly `ROW_TILE` rows (the last tile
padded with zeros): one fixed problem shape, so each row sees the same arithmetic whatever the
batch, chunk or position it comes in. The tiles go through one batched product
(`baddbmm`), whose problems are computed alike whatever their count, except for a single
output column (N = 1), where MKL's batched product changes its algorithm with the count:
there each tile is its own call.

    x [M, K] -> pad to [ceil(M / T) * T, K] -> per tile of T rows: [T, K] @ W^T [K, N] -> [M, N]

Elementwise transcendental functions (sigmoid, SiLU, softplus, ...) have the same trap on CPU:
torch's vectorized loop leaves the elements past the last full vector (of the tensor, or of a
thread's share) to a scalar loop, whose `exp` differs in the last bit. In the mode they run on a
contiguous copy padded to whole vectors of every thread's share, so each element is computed by
the vectorized code whatever the tensor's size.

Products of two batched operands (attention tiles, recurrent states: `[B, m, k] @ [B, k, n]`)
are left to torch: their per-problem shape does not depend on the batch, and each problem is
computed alone. Layers call their `LayerMath` (`math.linear`, `math.matmul`, `math.pointwise`),
so the step runs with no Python dispatch of its own; `WEIGHT_PRODUCTS` and `POINTWISE` name
the torch calls a layer must route through it (a test's detecting mode checks none escapes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ROW_TILE = 16
"""Rows of every weight product in the mode (a decode batch of up to 16 is one tile)."""
_VECTOR_ELEMENTS = 64
"""Elements of two AVX-512 vectors of bf16 (four of fp32): a multiple of every unroll."""


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed on fixed tiles of `ROW_TILE` rows: x `[..., K]`,
    weight `[N, K]` -> `[..., N]`, each row's value independent of the other rows."""
    if weight.dim() != 2 or not x.is_floating_point():
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    num_rows = rows.shape[0]
    # A fresh (aligned) copy even when no row is added: the tiles' addresses stay the same.
    num_padding = -num_rows % ROW_TILE if num_rows else ROW_TILE
    padded = torch.constant_pad_nd(rows, (0, 0, 0, num_padding))
    if weight.shape[0] == 1:  # one output column: one call per tile, never a batched call
        tiles = padded.view(-1, ROW_TILE, rows.shape[1]).unbind(0)
        out = torch.cat([F.linear(tile, weight, bias) for tile in tiles])
    else:
        out = _tile_products(padded.view(-1, ROW_TILE, rows.shape[1]), weight, bias)
    out = out[:num_rows]
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.shape[0])


def _tile_products(
    tiles: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`[T, ROW_TILE, K]` tiles times `weight^T` (+ bias) as one batched product of T
    problems of one shape -> `[T * ROW_TILE, N]`."""
    weight_t = weight.t().expand(tiles.shape[0], *weight.t().shape)
    out = torch.bmm(tiles, weight_t) if bias is None else torch.baddbmm(bias, tiles, weight_t)
    return out.view(-1, weight.shape[0])


def invariant_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` with a tiled product when `b` is a matrix (a weight); otherwise torch's."""
    if b.dim() == 2 and a.dim() >= 2 and a.is_floating_point():
        return invariant_linear(a, b.t())
    return torch.matmul(a, b)


def whole_vectors(
    func: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """`func(x, ...)` of an elementwise function, on a contiguous copy of `x` padded so that
    every thread's share is whole vectors (in place when `func` is, or asks to be)."""
    step = _VECTOR_ELEMENTS * max(1, torch.get_num_threads())
    if x.device.type != "cpu" or not x.is_floating_point():
        return direct(func, x, *args, **kwargs)
    if x.is_contiguous() and x.numel() % step == 0:
        return direct(func, x, *args, **kwargs)
    flat = x.reshape(-1)
    padded = torch.constant_pad_nd(flat, (0, -flat.numel() % step))
    result = func(padded, *args, **kwargs)
    out: torch.Tensor = (padded if result is None else result)[: flat.numel()].view(x.shape)
    if func.__name__.endswith("_") or kwargs.get("inplace"):
        return x.copy_(out)
    return out


def direct(func: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`func(x, ...)` as torch computes it (the normal mode's `pointwise`)."""
    out: torch.Tensor = func(x, *args, **kwargs)
    return out


LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
MatmulFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
PointwiseFn = Callable[..., torch.Tensor]
"""`pointwise(func, x, *args, **kwargs)`: the elementwise function `func` applied to `x`."""


@dataclass(frozen=True)
class LayerMath:
    """The operations of a layer whose rounding may depend on the number of rows: products
    against a weight and elementwise transcendental functions."""

    name: str
    linear: LinearFn
    """`F.linear(x, weight, bias)`."""
    matmul: MatmulFn
    """`x @ weight` (weight `[K, N]`)."""
    pointwise: PointwiseFn


TORCH_MATH = LayerMath("torch", F.linear, torch.matmul, direct)
"""Torch's own calls (the default)."""
INVARIANT_MATH = LayerMath("batch_invariant", invariant_linear, invariant_matmul, whole_vectors)
"""The batch-invariant mode's: tiled weight products, pointwise functions on whole vectors."""


WEIGHT_PRODUCTS: frozenset[Callable[..., Any]] = frozenset({
    F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
    torch.Tensor.mm, torch.addmm, torch.Tensor.addmm,
})  # fmt: skip
"""Torch calls that multiply by a weight matrix (batch-dependent when given one)."""
POINTWISE: frozenset[Callable[..., Any]] = frozenset({
    torch.sigmoid, torch.Tensor.sigmoid, torch.sigmoid_, torch.Tensor.sigmoid_,
    F.silu, F.softplus, F.gelu, F.logsigmoid, F.mish, F.elu,
    torch.exp, torch.Tensor.exp, torch.exp_, torch.Tensor.exp_,
    torch.tanh, torch.Tensor.tanh, torch.tanh_, torch.Tensor.tanh_,
    torch.log, torch.Tensor.log, torch.expm1, torch.Tensor.expm1,
    torch.log1p, torch.Tensor.log1p, torch.erf, torch.Tensor.erf,
})  # fmt: skip
"""Elementwise transcendental functions (batch-dependent in their last vector's bits)."""
