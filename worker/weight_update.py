"""New weights into a running rank's model, in place, through the checkpoint loaders.

Weights arrive in checkpoint (Hugging Face) format: the names and full shapes of the checkpoint
tensors, read by the very `load_weights` that loaded the model at start-up, so packed q/k/v and
gate/up parameters, renamed prefixes, quantized checkpoints (dequantized as at load) and an MTP
layer are filled exactly as a fresh load fills them.

Every update is checked whole before any weight changes: the loaders first run against a copy of
the model on the meta device (no memory, no data read), with sources that only record what the
loaders ask for. A name no parameter takes, or a shape no parameter fits, is a one-line
`WeightUpdateError` and the model keeps its weights. The same dry run tells which part of each
tensor this rank reads (`ShardPlan`): a sender can then ship every rank its own shard only, and
the rank serves the loaders from what it received (`ReceivedWeight`).

A dry run depends only on the update's signature (names, shapes and dtypes, in order), so an
accepted signature's regions are kept and a trainer's next update of the same layout is checked
against them without running the loaders again (an RL loop sends the same layout every step).
A signature that fails is not kept: it fails again, the same way, each time it is sent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from worker.config import ModelConfig, ParallelConfig
from worker.layers.loading import WeightSource
from worker.models.registry import get_model_class
from worker.quantization.checkpoint import DequantizationReport, dequantized_weights
from worker.quantization.methods import read_quantization_config
from worker.quantization.schemes import scheme_for

logger = logging.getLogger(__name__)

Region = tuple[int, int, int]
"""(dim, start, length) of one `narrow` a loader asks of a tensor; `WHOLE` for `read_all`."""
WHOLE: Region = (-1, 0, 0)
ShardPlan = dict[str, list[Region]]
"""Checkpoint name -> the regions this rank's loaders read of it."""
ReceivedShard = dict[str, dict[Region, torch.Tensor]]
"""Checkpoint name -> region -> the tensor of that region, as a sender shipped it."""

_ACCEPTED_SIGNATURES_KEPT = 8
"""Accepted signatures kept per rank (the oldest dropped first)."""
_TOLERATED_UNREAD = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_TIED_HEAD = "lm_head.weight"
"""Sent by trainers whose state dict lists a tied head: nothing reads it, and that is fine."""


class WeightUpdateError(ValueError):
    """An update that cannot be applied (unknown name, wrong shape, missing part, lost sender);
    the model keeps its weights."""


@dataclass
class RecordingWeight:
    """A checkpoint tensor of the dry run: meta tensors out, the regions asked recorded."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    dtype_name: str = "F32"
    regions: list[Region] = field(default_factory=list)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if not self.shape or not 0 <= start <= start + length <= self.shape[dim]:
            raise WeightUpdateError(
                f"{self.name}: a tensor of shape {self.shape} has no elements "
                f"[{start}, {start + length}) along dim {dim}"
            )
        self.regions.append((dim, start, length))
        shape = list(self.shape)
        shape[dim] = length
        return torch.empty(shape, dtype=self.dtype, device="meta")

    def read_all(self) -> torch.Tensor:
        self.regions.append(WHOLE)
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


@dataclass
class ReceivedWeight:
    """A checkpoint tensor of which this rank holds only the regions its loaders read."""

    name: str
    shape: tuple[int, ...]
    parts: dict[Region, torch.Tensor]
    dtype_name: str = "F32"

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        part = self.parts.get((dim, start, length))
        if part is None:
            raise WeightUpdateError(
                f"{self.name}: the part [{start}, {start + length}) of dim "
                f"{dim} was not sent to this rank"
            )
        return part

    def read_all(self) -> torch.Tensor:
        part = self.parts.get(WHOLE)
        if part is None:
            raise WeightUpdateError(f"{self.name}: the whole tensor was not sent to this rank")
        return part


def cut_shard(tensor: torch.Tensor, regions: Sequence[Region]) -> dict[Region, torch.Tensor]:
    """The parts of a full checkpoint tensor that one rank's plan names (contiguous copies)."""
    parts: dict[Region, torch.Tensor] = {}
    for region in regions:
        dim, start, length = region
        part = tensor if region == WHOLE else tensor.narrow(dim, start, length)
        parts[tuple(region)] = part.contiguous()  # type: ignore[index]
    return parts


def safetensors_dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name of a torch dtype (what quantized-checkpoint schemes check)."""
    for name, known in _TORCH_DTYPES.items():
        if known == dtype:
            return name
    return str(dtype).removeprefix("torch.").upper()


class WeightUpdater:
    """One rank's in-place weight updates: dry-run check, shard plans, staged apply."""

    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        parallel: ParallelConfig,
        mtp: nn.Module | None = None,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.parallel = parallel
        self.mtp = mtp
        """The checkpoint's MTP layer when it drafts: its `mtp.*` tensors update with the rest."""
        self._meta: tuple[nn.Module, nn.Module | None] | None = None
        self._accepted: dict[Signature, dict[str, list[Region]]] = {}
        """Signatures whose dry run passed -> the regions each tensor's loaders read."""
        self._quantized: bool | None = None
        self._staged: dict[str, ReceivedWeight] = {}
        self.bytes_received = 0
        """Bytes of weight shards this rank has received (all updates)."""

    # Checking

    def plan(self, shapes: Mapping[str, tuple[Sequence[int], torch.dtype]]) -> ShardPlan:
        """The regions of each tensor this rank reads; WeightUpdateError naming the first bad
        name or shape. A quantized model reads its quantized tensors whole."""
        sources = {
            name: RecordingWeight(
                name, tuple(int(d) for d in shape), dtype, safetensors_dtype_name(dtype)
            )
            for name, (shape, dtype) in shapes.items()
        }
        self._dry_run(sources, group_quantized=True)
        if self._is_quantized:
            return {name: [WHOLE] for name in sources}
        return {name: list(dict.fromkeys(source.regions)) for name, source in sources.items()}

    def _dry_run(self, sources: Mapping[str, RecordingWeight], group_quantized: bool) -> None:
        """Every tensor through the loaders of the meta copy; WeightUpdateError when a loader
        rejects one or no loader reads one. A signature that passed before gets its regions
        back without the loaders running again."""
        signature = _signature(sources, group_quantized)
        accepted = self._accepted.get(signature)
        if accepted is not None:
            for name, source in sources.items():
                source.regions.extend(accepted[name])
            return
        self._run_loaders_on_meta(sources, group_quantized)
        if len(self._accepted) >= _ACCEPTED_SIGNATURES_KEPT:
            del self._accepted[next(iter(self._accepted))]
        self._accepted[signature] = {name: list(s.regions) for name, s in sources.items()}

    def _run_loaders_on_meta(
        self, sources: Mapping[str, RecordingWeight], group_quantized: bool
    ) -> None:
        model, mtp = self._meta_models()
        _load_named(model, self._grouped(sources, group_quantized))
        if mtp is not None:
            _load_named(mtp, self._grouped(sources, group_quantized))
        unread = [
            name
            for name, source in sources.items()
            if not source.regions and not name.endswith(_TOLERATED_UNREAD) and name != _TIED_HEAD
        ]
        if unread:
            more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
            raise WeightUpdateError(f"{unread[0]} matches no parameter of the model{more}")

    def _meta_models(self) -> tuple[nn.Module, nn.Module | None]:
        """The model (and MTP layer) built on the meta device once, for dry runs."""
        if self._meta is None:
            config = self.model_config
            previous = torch.get_default_dtype()
            torch.set_default_dtype(config.dtype)
            try:
                with torch.device("meta"):
                    model = get_model_class(config.architecture)(config, self.parallel)
                    mtp = None
                    if self.mtp is not None:
                        mtp = type(self.mtp)(model, config, self.parallel)
            finally:
                torch.set_default_dtype(previous)
            self._meta = (model, mtp)
        return self._meta

    @property
    def _is_quantized(self) -> bool:
        if self._quantized is None:
            config = read_quantization_config(self.model_config.model_path)
            self._quantized = config is not None
        return self._quantized

    def _grouped(
        self, sources: Mapping[str, WeightSource], group_quantized: bool
    ) -> Iterator[tuple[str, WeightSource]]:
        """Sources as the loaders take them: a quantized model's parts grouped and dequantized,
        as `worker.weights.iterate_weights` groups a checkpoint's (unless grouped already)."""
        if not group_quantized or not self._is_quantized:
            return iter(sources.items())
        quant_config = read_quantization_config(self.model_config.model_path)
        assert quant_config is not None
        scheme = scheme_for(quant_config, self.model_config.model_path)
        report = DequantizationReport(scheme.method)
        return dequantized_weights(sources, scheme, report)  # type: ignore[arg-type]

    # Staging and applying

    def stage(self, shard: ReceivedShard, shapes: Mapping[str, Sequence[int]]) -> None:
        """Keep a received shard (checked first: names, shapes, parts) until `apply_staged`."""
        unknown = [name for name in shard if name not in shapes]
        if unknown:
            raise WeightUpdateError(f"{unknown[0]}: sent without its shape")
        received = {
            name: ReceivedWeight(name, tuple(int(d) for d in shapes[name]), parts)
            for name, parts in shard.items()
        }
        for weight in received.values():
            weight.dtype_name = safetensors_dtype_name(_dtype_of(weight))
        recordings = {name: recording_of(name, weight) for name, weight in received.items()}
        self._dry_run(recordings, group_quantized=True)
        for name, weight in received.items():
            _check_parts(weight, recordings[name])
        self._staged.update(received)
        self.bytes_received += sum(
            part.numel() * part.element_size()
            for parts in shard.values()
            for part in parts.values()
        )

    def discard_staged(self) -> None:
        self._staged = {}

    @property
    def num_staged(self) -> int:
        return len(self._staged)

    def apply_staged(self) -> int:
        """Copy every staged tensor into the model; the number of tensors applied."""
        staged, self._staged = self._staged, {}
        self._apply(staged.items, group_quantized=True)
        return len(staged)

    def load_folder(self, read: Callable[[], Iterable[tuple[str, WeightSource]]]) -> None:
        """A checkpoint folder's tensors (`read()` iterates them lazily, as often as needed):
        all checked on the meta copy first, then loaded."""
        recordings = {name: recording_of(name, source) for name, source in read()}
        self._dry_run(recordings, group_quantized=False)
        self._apply(read, group_quantized=False)

    @torch.no_grad()
    def _apply(
        self, read: Callable[[], Iterable[tuple[str, WeightSource]]], group_quantized: bool
    ) -> None:
        """Load checked sources into the model (and the MTP layer) in place; `read()` gives
        them (once per module)."""
        for module in (self.model, self.mtp):
            if module is not None:
                _load_named(module, self._grouped_items(read(), group_quantized))

    def _grouped_items(
        self, items: Iterable[tuple[str, WeightSource]], group_quantized: bool
    ) -> Iterator[tuple[str, WeightSource]]:
        if group_quantized and self._is_quantized:
            return self._grouped(dict(items), group_quantized)
        return iter(items)


Signature = tuple[bool, tuple[tuple[str, tuple[int, ...], torch.dtype, str], ...]]
"""(quantized parts grouped, per tensor in order: name, shape, dtype, dtype name)."""


def _signature(sources: Mapping[str, RecordingWeight], group_quantized: bool) -> Signature:
    return group_quantized, tuple(
        (name, source.shape, source.dtype, source.dtype_name) for name, source in sources.items()
    )


def recording_of(name: str, source: WeightSource) -> RecordingWeight:
    """A dry-run stand-in of `source`: its shape and dtype, no data."""
    dtype = _dtype_of(source)
    dtype_name = getattr(source, "dtype_name", None) or safetensors_dtype_name(dtype)
    return RecordingWeight(name, tuple(int(d) for d in source.shape), dtype, dtype_name)


def _check_parts(weight: ReceivedWeight, asked: RecordingWeight) -> None:
    """Every part the loaders will read was sent, in the shape the loaders expect."""
    for region in asked.regions:
        part = weight.parts.get(region)
        if part is None:
            raise WeightUpdateError(
                f"{weight.name}: the part {region} (dim, start, length) this rank reads was "
                "not sent to it"
            )
        expected = list(asked.shape)
        if region != WHOLE:
            expected[region[0]] = region[2]
        if list(part.shape) != expected:
            raise WeightUpdateError(
                f"{weight.name}: part {region} sent with shape {tuple(part.shape)}, "
                f"expected {tuple(expected)}"
            )


def _load_named(model: nn.Module, sources: Iterable[tuple[str, WeightSource]]) -> None:
    """`model.load_weights(sources)`; a loader's ValueError becomes one line naming the tensor."""
    current = [""]

    def tracked() -> Iterator[tuple[str, WeightSource]]:
        for name, source in sources:
            current[0] = name
            yield name, source

    try:
        model.load_weights(tracked())  # type: ignore[operator]
    except WeightUpdateError:
        raise
    except (ValueError, RuntimeError, AssertionError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise WeightUpdateError(f"{current[0]}: {message}") from None


_TORCH_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _dtype_of(source: WeightSource) -> torch.dtype:
    if isinstance(source, torch.Tensor):
        return source.dtype
    named = _TORCH_DTYPES.get(getattr(source, "dtype_name", ""))
    if named is not None:
        return named
    parts = getattr(source, "parts", None)
    if isinstance(parts, dict) and parts:
        first = next(iter(parts.values()))
        if isinstance(first, torch.Tensor):
            return first.dtype
    return torch.float32
