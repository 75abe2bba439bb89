"""Block files of the offload tier's disk level: one file per block of one KV cache group.

    [magic 8 B][header length 4 B][header JSON][payload][crc32 of header and payload 4 B]

The header names the fingerprint (the name of the folder the scheduler keeps these files in:
model, KV layout and dtype), the group, and each tensor's shape and dtype; the payload is the
tensors' bytes. A file is written to a temporary name and renamed, so a crash leaves no partial
file under a block's name. Reading checks everything: a file that is not ours, of another
fingerprint or layout, truncated, or whose checksum fails raises `BlockFileError`.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import torch

from worker.kv_io.block_export import BlockPages

MAGIC = b"HSKVBLK1"
_LENGTH = struct.Struct("<I")


class BlockFileError(ValueError):
    """A block file that must not be loaded (foreign, truncated or corrupt)."""


def write_block_file(path: str, pages: BlockPages) -> None:
    """Write `pages` (host tensors) under `path`, atomically."""
    tensors = [tensor.contiguous().cpu() for tensor in pages.tensors]
    header = json.dumps(
        {
            "fingerprint": Path(path).parent.name,
            "group_id": pages.group_id,
            "tensors": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors],
        }
    ).encode()
    payload = b"".join(t.view(torch.uint8).numpy().tobytes() for t in tensors)
    body = _LENGTH.pack(len(header)) + header + payload
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "wb") as handle:
        handle.write(MAGIC + body + _LENGTH.pack(zlib.crc32(body)))
    os.replace(temporary, path)


def read_block_file(path: str, group_id: int) -> BlockPages:
    """The pages in `path`, checked (`BlockFileError` when they must not be loaded)."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise BlockFileError(f"{path}: cannot be read ({error})") from error
    if len(data) < len(MAGIC) + 2 * _LENGTH.size or not data.startswith(MAGIC):
        raise BlockFileError(f"{path}: not a block file")
    body, (crc,) = data[len(MAGIC) : -_LENGTH.size], _LENGTH.unpack(data[-_LENGTH.size :])
    if zlib.crc32(body) != crc:
        raise BlockFileError(f"{path}: checksum mismatch (corrupt or truncated)")
    (header_length,) = _LENGTH.unpack(body[: _LENGTH.size])
    header = json.loads(body[_LENGTH.size : _LENGTH.size + header_length])
    if header.get("fingerprint") != Path(path).parent.name or header.get("group_id") != group_id:
        raise BlockFileError(f"{path}: written for another model, layout or group")
    payload = memoryview(body)[_LENGTH.size + header_length :]
    tensors, offset = [], 0
    for shape, dtype_name in header["tensors"]:
        dtype = getattr(torch, dtype_name)
        size = dtype.itemsize * _numel(shape)
        raw = torch.frombuffer(bytearray(payload[offset : offset + size]), dtype=torch.uint8)
        tensors.append(raw.view(dtype).reshape(shape))
        offset += size
    if offset != len(payload):
        raise BlockFileError(f"{path}: payload does not match its header")
    return BlockPages(group_id, 1, tuple(tensors))


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
