"""KV transfer between two engine actors on Ray: the receiver's held keys, the sender's export
and the receiver's import are chained as object references, so the pages go from the sender's
node to the receiver's through Ray's object store (never through the caller), within a deadline.

    caller ─► receiver.kv_held_keys ─ref─► sender.kv_export ─ref─► receiver.kv_import ─► result

Faults: a sender that dies never produces the transfer, so the import fails before it reserves a
block; a sender that hangs or a transfer past `timeout_s` is cancelled (the import never ran, or
ran whole: an import is one call between two steps); a dead receiver holds nothing. Each ends
in `KVTransferError`, and the caller recomputes. On GPU machines NIXL or NCCL would carry the
pages device to device; they are detected and, until used, the object store is the fallback.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from typing import Any

import ray

from cluster.engine.kv_transfer import KVImportResult

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0


class KVTransferError(RuntimeError):
    """A transfer between engines did not complete (peer dead, hung, or past its deadline)."""


def transport_name() -> str:
    """The transport KV transfers use here, logging when an accelerator one is present but
    the object store carries the pages instead."""
    for package in ("nixl", "cupy"):
        if importlib.util.find_spec(package) is not None:
            logger.info(
                "kv transfer: %s is installed; pages go through Ray's object store", package
            )
            break
    return "ray_object_store"


def start_transfer(
    sender: Any, receiver: Any, prompt_token_ids: Sequence[int], cache_salt: str | None = None
) -> tuple[Any, Any]:
    """Chain the three calls; (export ref, import ref)."""
    prompt = list(prompt_token_ids)
    held = receiver.kv_held_keys.remote(prompt, cache_salt)
    transfer = sender.kv_export.remote(prompt, held, cache_salt)
    return transfer, receiver.kv_import.remote(transfer)


def pull_prefix(
    sender: Any,
    receiver: Any,
    prompt_token_ids: Sequence[int],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cache_salt: str | None = None,
) -> KVImportResult:
    """Move the sender actor's cached prefix of the prompt into the receiver actor."""
    transfer, imported = start_transfer(sender, receiver, prompt_token_ids, cache_salt)
    try:
        result: KVImportResult = ray.get(imported, timeout=timeout_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as exc:
        _cancel(transfer, imported)
        raise _transfer_error(exc, timeout_s) from None
    return result


def _cancel(*refs: Any) -> None:
    for ref in refs:
        try:
            ray.cancel(ref)
        except Exception as exc:  # already finished, or its actor is gone
            logger.debug("kv transfer: cancel: %s", exc)


def _transfer_error(exc: BaseException, timeout_s: float) -> KVTransferError:
    if isinstance(exc, ray.exceptions.GetTimeoutError):
        return KVTransferError(f"kv transfer did not complete within {timeout_s:g} s")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return KVTransferError(f"kv transfer failed: {first}")
