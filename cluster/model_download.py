"""Hugging Face model IDs turned into local snapshot folders where the workers run.

`resolve_model_folder` tells a local folder from a model ID; `hub_snapshot` returns a model's
snapshot folder in the hub cache (`download_dir`, else HF_HUB_CACHE, i.e. HF_HOME/hub),
downloading what is missing on first use. One process per node talks to the Hub: the others wait
on a file lock in the cache folder, then read the cache. huggingface_hub shows a progress bar on
terminals and resumes a dropped transfer with a Range request; elsewhere a log line says what is
downloaded. HF_HUB_OFFLINE=1 (read by huggingface_hub) keeps it to the cache. Hub errors become
one-line ValueErrors that say what to fix.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from huggingface_hub import constants, get_token, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)
from huggingface_hub.utils import WeakFileLock  # type: ignore[attr-defined]  # lazy facade
from huggingface_hub.utils.tqdm import tqdm as hub_tqdm

logger = logging.getLogger(__name__)

TOKEN_HINT = (
    "set HF_TOKEN to a token of an account with access (Helm chart: "
    "`kubectl create secret generic hf-token --from-literal=hf_token=hf_...` and "
    "`--set model.hfToken.secretName=hf-token`)"
)
"""How to give the engine a Hugging Face token, locally and with the chart."""


class TerminalBar(hub_tqdm):
    """huggingface_hub's progress bar, shown only on a terminal (its file-count bar otherwise
    prints to logs too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("disable", None)  # tqdm: None disables the bar when not on a TTY
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]


def resolve_model_folder(model: str, cache_dir: str | None = None) -> Path:
    """A local folder as is; a Hugging Face model ID as its snapshot in the hub cache, downloaded
    into `cache_dir` on first use (only read from the cache when HF_HUB_OFFLINE is set)."""
    folder = Path(model).expanduser()
    if folder.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        return folder
    return hub_snapshot(model, cache_dir)


def hub_snapshot(repo_id: str, cache_dir: str | None = None) -> Path:
    """The snapshot folder of `repo_id`, downloaded into `cache_dir` unless HF_HUB_OFFLINE is set.

    Raises ValueError (one line) when the model cannot be had: not cached while offline, not
    found, gated without a token, or the Hub unreachable.
    """
    cache = Path(cache_dir or constants.HF_HUB_CACHE).expanduser()
    if constants.is_offline_mode():
        return _cached_or_raise(repo_id, cache)
    lock = cache / ".locks" / f"hybridserve--{repo_id.replace('/', '--')}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    # Ranks and replicas of one node start together: one downloads, the others wait here and
    # then find every file in the cache.
    with WeakFileLock(lock):
        return _download(repo_id, cache)


def _cached(repo_id: str, cache: Path) -> Path | None:
    """The complete cached snapshot of `repo_id`'s main revision, or None."""
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        return None


def _cached_or_raise(repo_id: str, cache: Path) -> Path:
    folder = _cached(repo_id, cache)
    if folder is None:
        raise ValueError(
            f"model {repo_id!r} is neither a local folder nor in the Hugging Face cache {cache} "
            "(HF_HUB_OFFLINE is set: nothing is downloaded): download it first, e.g. "
            f"`hf download {repo_id}`, unset HF_HUB_OFFLINE, or pass a folder"
        )
    return folder


def _download(repo_id: str, cache: Path) -> Path:
    """Fetch what the cache lacks of `repo_id` (nothing when it is complete and current)."""
    cached = _cached(repo_id, cache)
    if cached is None:
        logger.warning(
            "downloading %s from %s into %s (once per node; later starts read the cache)",
            repo_id,
            constants.ENDPOINT,
            cache,
        )
    start = time.perf_counter()
    try:
        folder = Path(snapshot_download(repo_id, cache_dir=cache, tqdm_class=TerminalBar))
    except (HfHubHTTPError, LocalEntryNotFoundError) as error:
        raise ValueError(hub_error_message(repo_id, cache, error)) from None
    if folder != cached:
        size_mb = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6
        logger.info(
            "downloaded %s (%.1f MB) in %.1f s into %s",
            repo_id,
            size_mb,
            time.perf_counter() - start,
            folder,
        )
    return folder


def hub_error_message(
    repo_id: str, cache: Path, error: HfHubHTTPError | LocalEntryNotFoundError
) -> str:
    """One line saying why `repo_id` could not be downloaded and what to do about it."""
    endpoint = constants.ENDPOINT
    if isinstance(error, GatedRepoError):
        who = "the token in HF_TOKEN has no access" if get_token() else "no token was given"
        return (
            f"model {repo_id!r} is gated on the Hugging Face Hub and {who}: accept its terms at "
            f"{endpoint}/{repo_id}, then {TOKEN_HINT}"
        )
    if isinstance(error, RepositoryNotFoundError):
        return (
            f"model {repo_id!r} was not found on the Hugging Face Hub ({endpoint}): check the "
            f"name; for a private model, {TOKEN_HINT}"
        )
    if isinstance(error, HfHubHTTPError):
        status = error.response.status_code
        if status in (401, 403):
            return f"the Hugging Face Hub refused model {repo_id!r} (HTTP {status}): {TOKEN_HINT}"
        return f"downloading model {repo_id!r} from {endpoint} failed with HTTP {status}"
    return (
        f"model {repo_id!r} is not in the Hugging Face cache {cache} and the Hub ({endpoint}) "
        "cannot be reached: check the network (HTTPS_PROXY, HF_ENDPOINT), or copy the model "
        "into the cache and set HF_HUB_OFFLINE=1"
    )
