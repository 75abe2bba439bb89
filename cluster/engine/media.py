"""Images named by URL -> decoded PIL images, within the serving limits.

    data:image/png;base64,...  ─► decoded here
    http(s)://host/...          ─► fetched (hosts in `allowed_media_domains` only, when set;
                                   a deadline and a byte limit; redirects checked hop by hop)
    file:///path                ─► read, only under `allowed_local_media_path`

Every refusal is a `MediaError` (a ValueError) whose message says what is wrong with the image;
the caller prefixes the place of the part in the request.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import httpx
from PIL import Image, UnidentifiedImageError

MAX_REDIRECTS = 5
_CHUNK_BYTES = 1 << 16


class MediaError(ValueError):
    """An image that cannot be had or used (the message names why)."""


@dataclass(frozen=True)
class MediaConfig:
    """Where images may come from and how large they may be."""

    allowed_local_media_path: str = ""
    """Folder `file://` URLs must lie in; empty: local files are refused."""
    allowed_media_domains: tuple[str, ...] | None = None
    """Hosts `http(s)://` URLs may name; None: any host."""
    fetch_timeout_s: float = 5.0
    """Seconds a fetch may take, connection to last byte."""
    max_media_bytes: int = 20 * 1024 * 1024
    """Largest encoded image (decoded from base64, fetched, or read)."""
    max_image_pixels: int = 1 << 25
    """Largest image, width x height."""


def load_image(url: str, config: MediaConfig) -> Image.Image:
    """The image `url` names, decoded (its pixels loaded), within `config`'s limits."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        payload = _data_url_bytes(url, config)
    elif scheme in ("http", "https"):
        payload = _fetch(url, config)
    elif scheme == "file":
        payload = _read_local(url, config)
    else:
        raise MediaError(
            f"image URL must be a data:image/...;base64, http(s):// or file:// URL, got "
            f"{_shown(url)}"
        )
    return decode_image(payload, config)


def decode_image(payload: bytes, config: MediaConfig) -> Image.Image:
    """`payload` (an encoded image file) as a loaded PIL image; MediaError when it is no image
    PIL reads, is corrupt, or has more pixels than allowed."""
    try:
        image = Image.open(io.BytesIO(payload))
    except UnidentifiedImageError:
        raise MediaError("image could not be decoded (not an image format we read)") from None
    except Exception as error:  # e.g. PIL's DecompressionBombError
        raise MediaError(f"image could not be decoded: {error}") from None
    check_pixels(image, config)
    try:
        image.load()
    except Exception as error:  # truncated or corrupt data
        raise MediaError(f"image could not be decoded: {error}") from None
    return image


def check_media_type(media_type: str, where: str) -> None:
    """MediaError unless `media_type` is an image type PIL reads (`image/png`, ...)."""
    Image.init()
    readable = {kind for kind in Image.MIME.values() if kind.startswith("image/")}
    if media_type not in readable | {"image/jpg"}:
        raise MediaError(f"unsupported image type {media_type!r} {where}")


def check_pixels(image: Image.Image, config: MediaConfig) -> None:
    """MediaError when `image` has more than `max_image_pixels` pixels."""
    width, height = image.size
    if width * height > config.max_image_pixels:
        raise MediaError(
            f"image of {width}x{height} pixels exceeds max_image_pixels={config.max_image_pixels}"
        )


def _data_url_bytes(url: str, config: MediaConfig) -> bytes:
    header, comma, data = url.partition(",")
    if not comma:
        raise MediaError("data URL has no ',' before its data")
    media_type, *params = header[len("data:") :].split(";")
    check_media_type(media_type.strip().lower() or "text/plain", "in data URL")
    if "base64" not in (param.lower() for param in params):
        raise MediaError("data URL must be base64-encoded (data:image/...;base64,...)")
    if len(data) * 3 // 4 > config.max_media_bytes:
        raise MediaError(_too_large(config))
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("data URL is not valid base64") from None


def _fetch(url: str, config: MediaConfig) -> bytes:
    """The body at `url`, following up to MAX_REDIRECTS redirects to allowed hosts."""
    deadline = time.monotonic() + config.fetch_timeout_s
    try:
        with httpx.Client(timeout=config.fetch_timeout_s, follow_redirects=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                _check_host(url, config)
                with client.stream("GET", url) as response:
                    if response.is_redirect:
                        url = str(response.url.join(response.headers["location"]))
                        continue
                    return _body(response, config, deadline)
    except httpx.TimeoutException:
        raise MediaError(_timed_out(config)) from None
    except httpx.HTTPError as error:
        raise MediaError(f"image could not be fetched: {error}") from None
    raise MediaError(f"image URL redirected more than {MAX_REDIRECTS} times")


def _body(response: httpx.Response, config: MediaConfig, deadline: float) -> bytes:
    if response.status_code != httpx.codes.OK:
        raise MediaError(f"image could not be fetched: HTTP {response.status_code}")
    content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in ("", "application/octet-stream"):  # no type: the bytes tell
        check_media_type(content_type, "at the image URL")
    declared = int(response.headers.get("content-length") or 0)
    if declared > config.max_media_bytes:
        raise MediaError(_too_large(config))
    body = bytearray()
    for chunk in response.iter_bytes(_CHUNK_BYTES):
        body += chunk
        if len(body) > config.max_media_bytes:
            raise MediaError(_too_large(config))
        if time.monotonic() > deadline:
            raise MediaError(_timed_out(config))
    return bytes(body)


def _check_host(url: str, config: MediaConfig) -> None:
    host = urllib.parse.urlsplit(url).hostname or ""
    allowed = config.allowed_media_domains
    if allowed is not None and host.lower() not in {domain.lower() for domain in allowed}:
        raise MediaError(f"image URL host {host!r} is not in allowed_media_domains")


def _read_local(url: str, config: MediaConfig) -> bytes:
    if not config.allowed_local_media_path:
        raise MediaError(
            "file:// image URLs are refused: the server sets no allowed_local_media_path"
        )
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"file:// image URL names a host ({parts.netloc!r}); only local files")
    path = Path(urllib.parse.unquote(parts.path)).resolve()
    root = Path(config.allowed_local_media_path).resolve()
    if not path.is_relative_to(root):
        raise MediaError("file:// image URL lies outside allowed_local_media_path")
    try:
        if path.stat().st_size > config.max_media_bytes:
            raise MediaError(_too_large(config))
        return path.read_bytes()
    except OSError as error:
        raise MediaError(f"image file could not be read: {error.strerror}") from None


def _too_large(config: MediaConfig) -> str:
    return f"image is larger than max_media_bytes={config.max_media_bytes}"


def _timed_out(config: MediaConfig) -> str:
    return f"image fetch timed out after media_fetch_timeout_s={config.fetch_timeout_s}"


def _shown(url: str) -> str:
    return repr(url if len(url) <= 40 else url[:40] + "...")
