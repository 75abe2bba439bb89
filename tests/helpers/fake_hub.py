"""A small Hugging Face Hub on a loopback address: the endpoints `snapshot_download` calls.

    GET  /api/models/ORG/NAME/revision/REV     model info (sha, siblings)
    GET  /api/models/ORG/NAME/tree/REV         the file list (recursive, one page)
    HEAD /ORG/NAME/resolve/REV/PATH            ETag, X-Repo-Commit, Content-Length
    GET  /ORG/NAME/resolve/REV/PATH            the bytes; `Range: bytes=N-` gives 206

Repos are folders of files; a gated repo answers 401 GatedRepo to file requests (as the Hub does
for a client without a token), a missing one 404 RepoNotFound. `drop_once` files send half their
bytes and close the connection the first time they are fetched; `delay_s` slows every file GET.
Every request is recorded, so tests see what a client fetched.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

HOST = "127.0.0.3"


@dataclass(frozen=True)
class Request:
    """One request the hub answered."""

    method: str
    path: str
    range: str | None


@dataclass
class HubState:
    """The repos served and what happened so far (shared with the handler threads)."""

    repos: dict[str, Path] = field(default_factory=dict)
    gated: set[str] = field(default_factory=set)
    drop_once: dict[str, int] = field(default_factory=dict)
    delay_s: float = 0.0
    requests: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def files(self, repo_id: str) -> dict[str, bytes]:
        root = self.repos[repo_id]
        return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    def file_requests(self, method: str = "GET") -> list[Request]:
        with self.lock:
            return [r for r in self.requests if r.method == method and "/resolve/" in r.path]


def commit_sha(repo_id: str) -> str:
    """The fake commit of a repo's main branch: 40 hex digits."""
    return hashlib.sha1(repo_id.encode()).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    server: _HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet test output

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def _answer(self, send_body: bool) -> None:
        state = self.server.state
        path = unquote(urlsplit(self.path).path)
        with state.lock:
            state.requests.append(Request(self.command, path, self.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            self._api("/".join(parts[2:4]), parts[4], send_body)
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._file("/".join(parts[:2]), "/".join(parts[4:]), send_body)
        else:
            self._error(404, "EntryNotFound", send_body)

    def _api(self, repo_id: str, endpoint: str, send_body: bool) -> None:
        state = self.server.state
        if repo_id not in state.repos:
            self._error(404, "RepoNotFound", send_body)
            return
        files = state.files(repo_id)
        if endpoint == "revision":
            siblings = [{"rfilename": name} for name in sorted(files)]
            body = {"id": repo_id, "sha": commit_sha(repo_id), "siblings": siblings}
        else:  # tree
            body = [
                {"type": "file", "path": name, "size": len(data), "oid": _etag(data)}
                for name, data in sorted(files.items())
            ]
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, send_body)

    def _file(self, repo_id: str, name: str, send_body: bool) -> None:
        state = self.server.state
        if repo_id not in state.repos:
            self._error(404, "RepoNotFound", send_body)
            return
        if repo_id in state.gated and "Authorization" not in self.headers:
            self._error(401, "GatedRepo", send_body)
            return
        data = state.files(repo_id).get(name)
        if data is None:
            self._error(404, "EntryNotFound", send_body)
            return
        headers = {"ETag": f'"{_etag(data)}"', "X-Repo-Commit": commit_sha(repo_id)}
        headers["Accept-Ranges"] = "bytes"
        if not send_body:
            self._send(200, data, headers, send_body=False)
            return
        time.sleep(state.delay_s)
        with state.lock:
            drop_at = state.drop_once.pop(name, None)
        self._send_file(data, headers, drop_at)

    def _send_file(self, data: bytes, headers: dict[str, str], drop_at: int | None) -> None:
        requested = self.headers.get("Range")  # the only form clients send: bytes=N-
        start = int(requested.removeprefix("bytes=").split("-")[0]) if requested else 0
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if drop_at is None:
            self._send(206 if start else 200, data[start:], headers, send_body=True)
            return
        self.send_response(200)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data[:drop_at])
        self.wfile.flush()
        self.close_connection = True  # the client sees the body end early

    def _error(self, status: int, code: str, send_body: bool) -> None:
        headers = {
            "X-Error-Code": code,
            "X-Error-Message": code,
            "Content-Type": "application/json",
        }
        self._send(status, json.dumps({"error": code}).encode(), headers, send_body)

    def _send(self, status: int, body: bytes, headers: dict[str, str], send_body: bool) -> None:
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        if send_body:
            self.wfile.write(body)


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _HubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state: HubState) -> None:
        super().__init__((HOST, 0), _Handler)
        self.state = state


class FakeHub:
    """The hub server, running in a thread until `close`."""

    def __init__(self, state: HubState) -> None:
        self.state = state
        self._server = _HubServer(state)
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The URL to set as HF_ENDPOINT."""
        return f"http://{HOST}:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
