"""KV transfer between two engine actors on Ray: the receiver's held keys, the sender's export
and the receiver's import are chained as object references, so the pages go from the sender's
node to the receiver's (never through the caller), within a deadline: through Ray's object
store, or rank to rank over direct connections (the sender's `kv_transfer_transport`; the
export then carries only the ranks' offers of them).

    caller ─► receiver.kv_held_keys ─ref─► sender.kv_export ─ref─► receiver.kv_import ─► result
                                       sending ranks └──── pages, direct ────┘ receiving ranks

Faults: a sender that dies never produces the transfer, so the import fails before it reserves
a block (a sending rank that dies or hangs before its offer is taken fails the import, which
frees what it reserved); a sender that hangs or a transfer past `timeout_s`
is cancelled (the import never ran, or ran whole: an import is one call between two steps); a
dead receiver holds nothing, and the sender drops an offer nobody takes. Each ends in
`KVTransferError`, and the caller recomputes. NIXL and NCCL (device to device) are not used: on
GPU machines the pages are staged through host memory; an installed NIXL is logged as unused.
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


def log_transport(transport: str) -> None:
    """Log how KV pages will travel, and that an installed device-to-device library is not
    what carries them."""
    ways = {
        "object_store": "Ray's object store",
        "direct": "direct connections from rank to rank",
    }
    logger.info("kv transfer: pages go through %s (host memory)", ways.get(transport, transport))
    if importlib.util.find_spec("nixl") is not None:
        logger.info("kv transfer: nixl is installed and not used")


def start_transfer(
    sender: Any,
    receiver: Any,
    prompt_token_ids: Sequence[int],
    cache_salt: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[Any, Any]:
    """Chain the three calls; (export ref, import ref)."""
    prompt = list(prompt_token_ids)
    held = receiver.kv_held_keys.remote(prompt, cache_salt)
    transfer = sender.kv_export.remote(prompt, held, cache_salt, timeout_s)
    return transfer, receiver.kv_import.remote(transfer, timeout_s)


def pull_prefix(
    sender: Any,
    receiver: Any,
    prompt_token_ids: Sequence[int],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cache_salt: str | None = None,
) -> KVImportResult:
    """Move the sender actor's cached prefix of the prompt into the receiver actor."""
    transfer, imported = start_transfer(sender, receiver, prompt_token_ids, cache_salt, timeout_s)
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
