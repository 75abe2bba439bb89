"""Images by URL: data URLs decode, http(s) URLs are fetched from allowed hosts only (a real HTTP
server on 127.0.0.2) within the deadline and the size limit, file:// URLs are read only under
allowed_local_media_path; every refusal says what is wrong."""

from __future__ import annotations

import base64
import contextlib
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from cluster.engine.media import MediaConfig, MediaError, load_image
from tests.helpers.ray_local import NODE_IP
from tests.helpers.tiny_image_processor import data_url, png_bytes, random_image

IMAGE = random_image(7)
PNG = png_bytes(IMAGE)
SLOW_S = 1.0


class _Handler(BaseHTTPRequestHandler):
    hits: ClassVar[Counter[str]] = Counter()

    def do_GET(self) -> None:
        _Handler.hits[self.path] += 1
        if self.path == "/slow.png":
            time.sleep(SLOW_S)
        if self.path.startswith("/to/"):
            self.send_response(302)
            self.send_header("Location", self.path.removeprefix("/to"))
            self.end_headers()
            return
        if self.path == "/away":
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.3/image.png")
            self.end_headers()
            return
        kind = "text/html" if self.path == "/page.html" else "image/png"
        self._send(200 if self.path != "/missing.png" else 404, kind, PNG)

    def _send(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(ConnectionError):  # a client that gave up (deadline, size)
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer((NODE_IP, 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://{NODE_IP}:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


ONLY_HERE = MediaConfig(allowed_media_domains=(NODE_IP,))


def _same_pixels(image: object) -> bool:
    return bool(np.array_equal(np.asarray(image), np.asarray(IMAGE)))


def test_a_data_url_decodes_to_the_image() -> None:
    assert _same_pixels(load_image(data_url(IMAGE), MediaConfig()))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "decoded"),
        ("data:image/png;base64," + base64.b64encode(PNG[: len(PNG) // 2]).decode(), "decoded"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:text/plain;base64," + base64.b64encode(PNG).decode(), "unsupported image type"),
        ("data:image/png," + PNG.hex(), "base64"),
        ("ftp://host/image.png", "must be a data:image"),
    ],
)
def test_bad_data_urls_are_refused_saying_why(url: str, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        load_image(url, MediaConfig())


def test_limits_on_bytes_and_pixels() -> None:
    with pytest.raises(MediaError, match="max_media_bytes"):
        load_image(data_url(IMAGE), MediaConfig(max_media_bytes=len(PNG) // 2))
    with pytest.raises(MediaError, match=r"40x30 pixels exceeds max_image_pixels=1000"):
        load_image(data_url(IMAGE), MediaConfig(max_image_pixels=1000))


def test_an_allowed_host_is_fetched_through_redirects(server: str) -> None:
    assert _same_pixels(load_image(f"{server}/image.png", ONLY_HERE))
    assert _same_pixels(load_image(f"{server}/to/image.png", ONLY_HERE))


def test_a_host_outside_the_allowed_domains_is_never_asked(server: str) -> None:
    before = _Handler.hits["/other.png"]
    elsewhere = MediaConfig(allowed_media_domains=("images.example.com",))
    with pytest.raises(
        MediaError, match=rf"host '{re.escape(NODE_IP)}' is not in allowed_media_domains"
    ):
        load_image(f"{server}/other.png", elsewhere)
    assert _Handler.hits["/other.png"] == before
    with pytest.raises(MediaError, match=r"'127\.0\.0\.3' is not in allowed_media_domains"):
        load_image(f"{server}/away", ONLY_HERE)  # a redirect leaving the allowed hosts


def test_fetch_deadline_size_status_and_type(server: str) -> None:
    started = time.monotonic()
    with pytest.raises(MediaError, match="timed out"):
        load_image(f"{server}/slow.png", replace(ONLY_HERE, fetch_timeout_s=0.2))
    assert time.monotonic() - started < SLOW_S
    with pytest.raises(MediaError, match="max_media_bytes"):
        load_image(f"{server}/image.png", replace(ONLY_HERE, max_media_bytes=100))
    with pytest.raises(MediaError, match="HTTP 404"):
        load_image(f"{server}/missing.png", ONLY_HERE)
    with pytest.raises(MediaError, match="unsupported image type 'text/html'"):
        load_image(f"{server}/page.html", ONLY_HERE)


def test_local_files_only_under_the_allowed_path(tmp_path: Path) -> None:
    allowed, other = tmp_path / "allowed", tmp_path / "other"
    allowed.mkdir()
    other.mkdir()
    (allowed / "in.png").write_bytes(PNG)
    (other / "out.png").write_bytes(PNG)
    (allowed / "link.png").symlink_to(other / "out.png")
    config = MediaConfig(allowed_local_media_path=str(allowed))
    assert _same_pixels(load_image(f"file://{allowed}/in.png", config))
    for outside in (f"{other}/out.png", f"{allowed}/../other/out.png", f"{allowed}/link.png"):
        with pytest.raises(MediaError, match="outside allowed_local_media_path"):
            load_image(f"file://{outside}", config)
    with pytest.raises(MediaError, match="refused: the server sets no allowed_local_media_path"):
        load_image(f"file://{allowed}/in.png", MediaConfig())
    with pytest.raises(MediaError, match="could not be read"):
        load_image(f"file://{allowed}/missing.png", config)
