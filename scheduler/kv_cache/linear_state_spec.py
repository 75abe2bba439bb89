"""State specs of the linear-attention layers: gated DeltaNet (Qwen3-Next, Qwen3.5) and short
convolution (LFM2). Both are recurrent states of constant size, kept like Mamba state.

They are `MambaSpec`s with their own kind and shapes, so grouping, page-size unification,
capacity planning and the none / align / all cache modes (and their hit rules) are Mamba's:

    gated DeltaNet page:  | conv state [conv_dim, width - 1] | recurrent [Hv, Dk, Dv] | pad |
                          conv_dim = 2 * Hk * Dk + Hv * Dv  (q, k and v channels)
    short conv page:      | conv state [hidden, width - 1] | pad |

Tensor parallelism splits heads (DeltaNet: key and value heads over the ranks, each rank's
value heads reading its own key heads) and channels (short conv); a rank's spec holds its share.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.kv_cache.spec import MambaCacheMode, MambaSpec


@dataclass(frozen=True, kw_only=True)
class GatedDeltaNetSpec(MambaSpec):
    """A gated DeltaNet layer's conv and recurrent state (one page per state)."""

    @property
    def kind(self) -> str:
        return "gated_delta_net"


@dataclass(frozen=True, kw_only=True)
class ShortConvSpec(MambaSpec):
    """A short-convolution layer's conv state (one page per state)."""

    @property
    def kind(self) -> str:
        return "short_conv"


def _split(total: int, tp_size: int, what: str) -> int:
    if total % tp_size:
        raise ValueError(
            f"{what} ({total}) are not divisible by tp_size={tp_size}; choose a "
            f"tensor_parallel_size that divides {total}"
        )
    return total // tp_size


@dataclass(frozen=True)
class GatedDeltaNetShape:
    """Sizes of one gated DeltaNet layer (whole model, not per rank)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_width: int

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"value heads ({self.num_v_heads}) must be a multiple of key heads "
                f"({self.num_k_heads})"
            )

    def per_rank(self, tp_size: int) -> GatedDeltaNetShape:
        """The share of one of `tp_size` ranks (ValueError when heads do not split evenly)."""
        return GatedDeltaNetShape(
            _split(self.num_k_heads, tp_size, "gated DeltaNet key heads"),
            _split(self.num_v_heads, tp_size, "gated DeltaNet value heads"),
            self.head_k_dim,
            self.head_v_dim,
            self.conv_width,
        )

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, recurrent state) of one request."""
        return (
            (self.conv_dim, self.conv_width - 1),
            (self.num_v_heads, self.head_k_dim, self.head_v_dim),
        )

    def spec(self, block_size: int, dtype_bytes: int, mode: MambaCacheMode) -> GatedDeltaNetSpec:
        """The spec of a layer of this shape, both states in `dtype_bytes`-byte elements."""
        return GatedDeltaNetSpec(
            block_size=block_size,
            shapes=self.state_shapes(),
            dtype_bytes=(dtype_bytes, dtype_bytes),
            mamba_cache_mode=mode,
        )


@dataclass(frozen=True)
class ShortConvShape:
    """Sizes of one short-convolution layer (whole model, not per rank)."""

    channels: int
    conv_width: int

    def per_rank(self, tp_size: int) -> ShortConvShape:
        return ShortConvShape(
            _split(self.channels, tp_size, "short-conv channels"), self.conv_width
        )

    def spec(self, block_size: int, dtype_bytes: int, mode: MambaCacheMode) -> ShortConvSpec:
        """The spec of a layer of this shape (its conv state)."""
        return ShortConvSpec(
            block_size=block_size,
            shapes=((self.channels, self.conv_width - 1),),
            dtype_bytes=(dtype_bytes,),
            mamba_cache_mode=mode,
        )
