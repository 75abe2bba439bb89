"""Sleep and wake of one rank's memory: its weights and its KV pool released, then restored.

Level 1 keeps a host copy of the weights (pinned host memory on CUDA; on CPU, whose device memory
is host memory already, an unnamed temporary file, so the process really gives the bytes back)
and drops the KV pool. Level 2 keeps only the model's buffers and the LoRA slots (small) and
drops the weights too: they are read from the checkpoint again once the rank is fully awake,
unless new weights were loaded into them meanwhile (`mark_weights_loaded`).

Every storage is released in place (`resize_(0)`) and grown back at wake, so each view of it (the
layers' KV views, recurrent-state views, drafter caches, fused weights) stays bound and nothing
is rebuilt. KV pages come back zeroed: their contents are forgotten (the engine resets its
prefix cache). On CUDA, addresses change at wake: captured graphs must be captured again.

    awake ──sleep(1|2)──► asleep {weights, kv_cache} ──wake(weights)──► {kv_cache} ──wake──► awake
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import logging
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

WAKE_TAGS = ("weights", "kv_cache")
"""What a rank releases and restores (the engine's third tag, `scheduling`, is not the rank's)."""


@dataclass(frozen=True)
class SleepReport:
    """Bytes one rank released."""

    weight_bytes: int
    kv_cache_bytes: int


class _HostCopy:
    """Host copies of storages: pinned tensors beside a CUDA device, a temporary file on CPU."""

    def __init__(self, device: torch.device) -> None:
        self._on_file = device.type == "cpu"
        self._file: io.BufferedRandom | None = None
        self._tensors: dict[int, torch.Tensor] = {}
        self._offsets: dict[int, int] = {}

    def save(self, key: int, data: torch.Tensor) -> None:
        """Copy the uint8 tensor `data` under `key`."""
        if not self._on_file:
            self._tensors[key] = data.to("cpu", copy=True).pin_memory()
            return
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="hybridserve-sleep-")  # noqa: SIM115 (closed at wake)
            assert isinstance(self._file, io.BufferedRandom)
        self._offsets[key] = self._file.seek(0, 2)
        self._file.write(_host_bytes(data))

    def restore(self, key: int, data: torch.Tensor) -> None:
        """Write the copy under `key` back into the uint8 tensor `data`."""
        if not self._on_file:
            data.copy_(self._tensors.pop(key))
            return
        assert self._file is not None
        self._file.seek(self._offsets.pop(key))
        self._file.readinto(_host_bytes(data))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._tensors.clear()
        self._offsets.clear()


def _host_bytes(data: torch.Tensor) -> memoryview:
    """A CPU uint8 tensor's bytes, without `numpy()` (which would pin the storage's size)."""
    return memoryview((ctypes.c_ubyte * data.numel()).from_address(data.data_ptr())).cast("B")


@dataclass
class _Released:
    """A storage released in place, its size, and the key of its host copy (None: none)."""

    storage: torch.UntypedStorage
    nbytes: int
    copy_key: int | None


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages under `tensors` (views of one buffer count once)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0 and tensor.device.type != "meta":
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class MemoryResidency:
    """Which of one rank's weights and KV pages are resident, and the copies kept while not."""

    def __init__(
        self,
        device: torch.device,
        modules: Callable[[], Sequence[nn.Module]],
        kept_tensors: Callable[[], list[torch.Tensor]],
        kv_tensors: Callable[[], list[torch.Tensor]],
    ) -> None:
        """`modules`: the model and its drafter; `kept_tensors`: tensors a level-2 sleep keeps
        a copy of besides the buffers (LoRA slots); `kv_tensors`: the KV pool's views."""
        self.device = device
        self._modules = modules
        self._kept_tensors = kept_tensors
        self._kv_tensors = kv_tensors
        self._host = _HostCopy(device)
        self.level = 0
        """The level of the sleep under way (0: awake)."""
        self._asleep: dict[str, list[_Released]] = {}
        self.needs_weights = False
        """Level 2: the weights' memory is back but holds no weights yet."""

    @property
    def asleep_tags(self) -> tuple[str, ...]:
        return tuple(self._asleep)

    def sleep(self, level: int) -> SleepReport:
        """Release the KV pool and the weights (level 1: with a host copy; 2: without)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2 on a worker, got {level}")
        if self._asleep:
            raise ValueError("the worker is asleep already: wake it up first")
        _synchronize(self.device)
        modules = self._modules()
        kept = [*(b for m in modules for b in m.buffers()), *self._kept_tensors()]
        kept_storages = unique_storages(kept)
        kept_ptrs = {storage.data_ptr() for storage in kept_storages}
        params = [p for m in modules for p in m.parameters()]
        dropped = [s for s in unique_storages(params) if s.data_ptr() not in kept_ptrs]
        weights = self._release(kept_storages, with_copy=True)
        weights += self._release(dropped, with_copy=level == 1)
        kv_cache = self._release(unique_storages(self._kv_tensors()), with_copy=False)
        self._asleep = {"weights": weights, "kv_cache": kv_cache}
        self.level = level
        _give_back(self.device)
        report = SleepReport(_total(weights), _total(kv_cache))
        logger.info(
            "asleep (level %d): %.1f MiB of weights, %.1f MiB of KV cache released",
            level,
            report.weight_bytes / 2**20,
            report.kv_cache_bytes / 2**20,
        )
        return report

    def wake_up(self, tags: Sequence[str], reload: Callable[[], None]) -> None:
        """Restore the memory of `tags` (weights, kv_cache); once nothing is asleep, after a
        level-2 sleep with no weights loaded meanwhile, `reload` reads them again."""
        unknown = [tag for tag in tags if tag not in WAKE_TAGS]
        if unknown:
            raise ValueError(f"wake_up tags must be among {list(WAKE_TAGS)}, got {unknown}")
        for tag in tags:
            released = self._asleep.pop(tag, None)
            if released is None:
                continue
            for item in released:
                self._restore(item)
            if tag == "weights" and self.level == 2:
                self.needs_weights = True
        if not self._asleep:
            self._host.close()
            self.level = 0
            if self.needs_weights:
                reload()
                self.needs_weights = False
        _synchronize(self.device)

    def mark_weights_loaded(self) -> None:
        """New weights were written into the awake weight memory: no checkpoint read at wake."""
        self.needs_weights = False

    def _release(self, storages: list[torch.UntypedStorage], *, with_copy: bool) -> list[_Released]:
        released = []
        for storage in storages:
            if not storage.resizable():
                logger.warning("a %d-byte storage cannot be released: kept", storage.nbytes())
                continue
            key = storage.data_ptr() if with_copy else None
            if key is not None:
                self._host.save(key, _bytes_of(storage))
            released.append(_Released(storage, storage.nbytes(), key))
            storage.resize_(0)
        return released

    def _restore(self, item: _Released) -> None:
        item.storage.resize_(item.nbytes)
        data = _bytes_of(item.storage)
        if item.copy_key is not None:
            self._host.restore(item.copy_key, data)
        else:
            data.zero_()


def _total(released: list[_Released]) -> int:
    return sum(item.nbytes for item in released)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _give_back(device: torch.device) -> None:
    """Return freed memory to the device (CUDA's cache) or to the OS (glibc's free lists)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    libc = ctypes.CDLL(libc_name)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


@torch.no_grad()
def copy_weights(targets: Sequence[nn.Module], sources: Sequence[nn.Module]) -> None:
    """Copy every parameter of `sources` into the parameter of the same name in `targets`
    (modules built alike: a fresh load of the same checkpoint)."""
    for target, source in zip(targets, sources, strict=True):
        params = dict(target.named_parameters(remove_duplicate=False))
        for name, tensor in source.named_parameters(remove_duplicate=False):
            params[name].copy_(tensor)
