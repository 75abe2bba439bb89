"""The decoder layer loop every model runs its layer stack through.

`DecoderLayerLoop` runs the decoder layers in order. With truncated prefill (see
`metadata_transforms.py`, its one home) the trailing run of KV-sharing layers may see only the
rows that reach the LM head: the loop gathers the hidden states and per-token inputs to those
rows before the run and scatters the results back after it. KV sharing itself is validated once,
by the KV config builder; the loop only reads each attention layer's `kv_sharing_target`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar, Union, cast

import torch
from torch import nn

from worker.attention.attention import Attention, ForwardContext
from worker.attention.metadata_transforms import first_truncated_layer

RowData = Union[torch.Tensor, tuple["RowData", ...], Mapping[str, "RowData"]]  # noqa: UP007
"""Per-token inputs of the layers (tokens on dim 0), possibly nested in tuples and dicts."""
Inputs = TypeVar("Inputs", bound=RowData)


def attention_modules(module: nn.Module) -> list[Attention]:
    """The attention layers under `module` (itself included), in module order."""
    return [child for child in module.modules() if isinstance(child, Attention)]


def select_rows(data: Inputs, rows: torch.Tensor) -> Inputs:
    """The rows `rows` (dim 0) of every tensor in `data`, keeping its structure."""
    if isinstance(data, torch.Tensor):
        return cast(Inputs, data.index_select(0, rows))
    if isinstance(data, tuple):
        items = tuple(select_rows(item, rows) for item in data)
        rebuild = getattr(data, "_make", None)  # a NamedTuple keeps its type
        return cast(Inputs, rebuild(items) if rebuild is not None else items)
    return cast(Inputs, {key: select_rows(value, rows) for key, value in data.items()})


class DecoderLayerLoop:
    """Runs a model's decoder layers; the trailing KV-sharing run may see only the kept rows.

    When the metadata of the first truncated layer carries `query_rows` (truncated prefill is
    on and this step has prefill rows), the hidden states and per-token inputs are gathered to
    those rows before that layer, the remaining layers run on them, and the results are
    scattered back after the last layer. Rows not kept keep the values of the earlier layers:
    they are never read by the LM head. Without `query_rows` every layer runs on every row.
    """

    def __init__(self, layers: Iterable[nn.Module]) -> None:
        """`layers`: the decoder layers in model order (an attention layer stands for itself).

        Raises ValueError when the trailing KV-sharing layers share a decoder layer with a
        layer that owns KV (see `first_truncated_layer`).
        """
        per_layer = [attention_modules(layer) for layer in layers]
        sharing = {
            attn.layer_name
            for attns in per_layer
            for attn in attns
            if attn.config.kv_sharing_target is not None
        }
        names = [[attn.layer_name for attn in attns] for attns in per_layer]
        self.num_layers = len(per_layer)
        self.first_truncated = first_truncated_layer(names, sharing)
        self.probe_layer: str | None = None
        """Attention layer whose metadata says which rows are kept."""
        if self.first_truncated < self.num_layers:
            self.probe_layer = names[self.first_truncated][0]

    def kept_rows(self, ctx: ForwardContext) -> torch.Tensor | None:
        """Rows the truncated layers compute this step; None: all rows."""
        if self.probe_layer is None or self.probe_layer not in ctx.metadata:
            return None
        return ctx.metadata[self.probe_layer].query_rows

    def run(
        self,
        run_layer: Callable[[int, torch.Tensor, Inputs], torch.Tensor],
        hidden: torch.Tensor,
        inputs: Inputs,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """`hidden = run_layer(layer_idx, hidden, inputs)` for every layer, in order."""
        rows = self.kept_rows(ctx)
        stop = self.num_layers if rows is None else self.first_truncated
        for idx in range(stop):
            hidden = run_layer(idx, hidden, inputs)
        if rows is None or rows.numel() == 0:  # empty: no row reaches the LM head this step
            return hidden
        kept, kept_inputs = select_rows(hidden, rows), select_rows(inputs, rows)
        for idx in range(stop, self.num_layers):
            kept = run_layer(idx, kept, kept_inputs)
        return hidden.index_copy(0, rows, kept)
