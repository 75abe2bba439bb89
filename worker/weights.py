"""Read Hugging Face safetensors checkpoints and route each tensor to its parameter's loader.

`iterate_weights` yields `(hf_name, lazy tensor)` over a single-file or sharded checkpoint; a
lazy tensor reads from disk only the rows or columns a rank's `weight_loader` asks for.
`load_named_weights` maps HF names onto our packed parameters (q/k/v -> qkv_proj, gate/up ->
gate_up_proj) and calls the loaders. A quantized checkpoint (`quantization_config` in its
config.json) is read through `worker.quantization`: each quantized tensor arrives as one
source dequantized on first read, under its unquantized name.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from worker.layers.loading import ShardId, WeightSource, weight_loader_of
from worker.quantization.checkpoint import DequantizationReport, dequantized_weights
from worker.quantization.methods import read_quantization_config
from worker.quantization.schemes import scheme_for

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# (our packed parameter, HF parameter, shard id)
PACKED_MODULES: tuple[tuple[str, str, ShardId], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
# Checkpoint entries that are buffers recomputed at init, not parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class SafetensorsWeight:
    """One tensor of an open safetensors file, read lazily (a `LazyWeight`)."""

    def __init__(self, handle: Any, name: str) -> None:
        self._handle, self._name = handle, name
        self._slice = handle.get_slice(name)
        self.shape = tuple(int(d) for d in self._slice.get_shape())
        self.dtype_name: str = self._slice.get_dtype()

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read elements `[start, start + length)` of `dim` (and everything of other dims)."""
        index = (slice(None),) * dim + (slice(start, start + length),)
        tensor: torch.Tensor = self._slice[index]
        return tensor

    def read_all(self) -> torch.Tensor:
        """The whole tensor (scalars included)."""
        tensor: torch.Tensor = self._handle.get_tensor(self._name)
        return tensor


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, in a stable order."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors checkpoint")
    return files


def iterate_weights(
    folder: str | Path, show_progress: bool = False, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, WeightSource]]:
    """Yield `(name, lazy tensor)` for every tensor of the checkpoint.

    A lazy tensor is valid until the next item is requested (its file may be closed then).
    A quantized checkpoint yields its quantized tensors dequantized (float32, cast by the
    parameter's copy); the cost is logged once, in `dtype` when given.
    """
    quant_config = read_quantization_config(folder)
    if quant_config is None:
        yield from _plain_weights(folder, show_progress)
        return
    scheme = scheme_for(quant_config, folder)
    report = DequantizationReport(scheme.method)
    with contextlib.ExitStack() as stack:
        tensors: dict[str, SafetensorsWeight] = {}
        for path in checkpoint_files(folder):
            handle = stack.enter_context(_open_checkpoint(path))
            for name in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                tensors[name] = SafetensorsWeight(handle, name)
        items = dequantized_weights(tensors, scheme, report)
        yield from tqdm(
            items, desc="Loading quantized weights", unit="tensors", disable=not show_progress
        )
    if report.tensors:  # none when every quantized layer keeps its quantized weights
        logger.info("%s", report.describe(dtype or torch.float32))


def _plain_weights(folder: str | Path, show_progress: bool) -> Iterator[tuple[str, WeightSource]]:
    files = checkpoint_files(folder)
    with tqdm(total=len(files), desc="Loading safetensors files", disable=not show_progress) as bar:
        for path in files:
            with _open_checkpoint(path) as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                    yield name, SafetensorsWeight(handle, name)
            bar.update(1)
            logger.debug("read %s", path.name)


def _open_checkpoint(path: Path) -> Any:
    """`safe_open` of one checkpoint file; a corrupt file is a ValueError naming it."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own SafetensorError or OSError
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from None


def renamed_prefix(name: str, renames: Sequence[tuple[str, str]]) -> str:
    """`name` with its first matching prefix `old` replaced by `new` (checkpoint layouts that
    nest the text model under another prefix); unchanged when none matches."""
    for old, new in renames:
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


def packed_target(name: str) -> tuple[str, ShardId] | None:
    """Our packed parameter and shard of an HF tensor name (None: not part of a packed one)."""
    for packed, original, shard_id in PACKED_MODULES:
        marker = f".{original}."
        if marker in name:
            return name.replace(marker, f".{packed}."), shard_id
    return None


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, WeightSource]],
    skip_prefixes: Sequence[str] = (),
) -> set[str]:
    """Load HF-named tensors into `model`; returns the names of the parameters that were filled.

    Names under `skip_prefixes` (e.g. a tied `lm_head.`) and rotary buffers are skipped; names
    the model does not know are logged and skipped, so the caller should check completeness.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    packed_shards: dict[str, set[ShardId]] = {}
    for name, source in weights:
        if name.endswith(_IGNORED_SUFFIXES) or name.startswith(tuple(skip_prefixes)):
            continue
        target = packed_target(name)
        param_name, shard_id = target if target is not None else (name, None)
        param = params.get(param_name)
        if param is None:
            logger.warning("checkpoint tensor %s matches no parameter; skipped", name)
            continue
        weight_loader_of(param)(param, source, shard_id)
        if target is None:
            loaded.add(param_name)
        else:
            packed_shards.setdefault(param_name, set()).add(shard_id)
    modules = dict(model.named_modules())
    for param_name, shard_ids in packed_shards.items():
        if shard_ids == _expected_shards(param_name, modules):
            loaded.add(param_name)
    return loaded


def _expected_shards(param_name: str, modules: dict[str, nn.Module]) -> set[ShardId]:
    """The shards the packed parameter's layer holds (a K = V layer has no value shard)."""
    shards = getattr(modules[param_name.rpartition(".")[0]], "shards", None)
    assert isinstance(shards, dict), f"{param_name} does not belong to a packed layer"
    return set(shards)
