"""Where the Files and Batch APIs keep their data: a folder, or Ray's object store.

`BatchStore` keeps uploaded and produced files (content and `FileObject`), batch records
(`BatchObject`) and each batch's progress log: one JSON line per finished input line, appended
and flushed as the line finishes, so a batch that is interrupted resumes after its last finished
line and never writes one twice. It stores them as named blobs in one of two backends:

- `FolderBlobs(root)`: files under a folder (`HYBRIDSERVE_BATCH_DIR`; on Kubernetes a volume),
  which outlive the Serve app and its replicas;
- `ObjectStoreBlobs()`: objects in Ray's object store, owned by the batch service actor (they
  live as long as it does: for tests and trials).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

from cluster.openai_api.batch_protocol import BatchObject, FileObject

BATCH_DIR_ENV = "HYBRIDSERVE_BATCH_DIR"
"""The folder the Files and Batch APIs store into (unset: Ray's object store)."""


class Blobs(Protocol):
    """Named byte strings, with appends."""

    def put(self, name: str, data: bytes) -> None: ...

    def get(self, name: str) -> bytes | None: ...

    def append(self, name: str, data: bytes) -> None: ...

    def delete(self, name: str) -> None: ...

    def names(self, prefix: str) -> list[str]: ...


class FolderBlobs:
    """Blobs as files under `root`; a put is atomic (written aside, then renamed), an append is
    flushed and synced before it returns."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        return self.root / name

    def put(self, name: str, data: bytes) -> None:
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        aside = path.with_name(path.name + ".writing")
        aside.write_bytes(data)
        os.replace(aside, path)

    def get(self, name: str) -> bytes | None:
        path = self._path(name)
        return path.read_bytes() if path.is_file() else None

    def append(self, name: str, data: bytes) -> None:
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def names(self, prefix: str) -> list[str]:
        folder = self._path(prefix)
        if not folder.is_dir():
            return []
        return sorted(
            f"{prefix}/{p.name}" for p in folder.iterdir() if not p.name.endswith(".writing")
        )


class ObjectStoreBlobs:
    """Blobs as objects in Ray's object store (an append adds one object)."""

    def __init__(self) -> None:
        self._refs: dict[str, list[Any]] = {}

    def put(self, name: str, data: bytes) -> None:
        import ray

        self._refs[name] = [ray.put(data)]

    def get(self, name: str) -> bytes | None:
        import ray

        refs = self._refs.get(name)
        return None if refs is None else b"".join(ray.get(refs))

    def append(self, name: str, data: bytes) -> None:
        import ray

        self._refs.setdefault(name, []).append(ray.put(data))

    def delete(self, name: str) -> None:
        self._refs.pop(name, None)

    def names(self, prefix: str) -> list[str]:
        return sorted(name for name in self._refs if name.startswith(prefix + "/"))


def blobs_from_env(environ: dict[str, str] | None = None) -> Blobs:
    """The folder `HYBRIDSERVE_BATCH_DIR` names, else Ray's object store."""
    folder = (os.environ if environ is None else environ).get(BATCH_DIR_ENV, "").strip()
    return FolderBlobs(Path(folder)) if folder else ObjectStoreBlobs()


class BatchStore:
    """Files, batch records and progress logs over one `Blobs` backend."""

    def __init__(self, blobs: Blobs) -> None:
        self.blobs = blobs

    # -- files -----------------------------------------------------------------------------------

    def add_file(self, info: FileObject, content: bytes) -> None:
        self.blobs.put(f"content/{info.id}", content)
        self.blobs.put(f"files/{info.id}", info.model_dump_json().encode())

    def file(self, file_id: str) -> FileObject | None:
        data = self.blobs.get(f"files/{file_id}")
        return None if data is None else FileObject.model_validate_json(data)

    def files(self) -> list[FileObject]:
        found = (self.blobs.get(name) for name in self.blobs.names("files"))
        return sorted(
            (FileObject.model_validate_json(data) for data in found if data is not None),
            key=lambda info: (info.created_at, info.id),
        )

    def content(self, file_id: str) -> bytes | None:
        return self.blobs.get(f"content/{file_id}")

    def delete_file(self, file_id: str) -> bool:
        if self.file(file_id) is None:
            return False
        self.blobs.delete(f"files/{file_id}")
        self.blobs.delete(f"content/{file_id}")
        return True

    # -- batches ---------------------------------------------------------------------------------

    def save_batch(self, batch: BatchObject) -> None:
        self.blobs.put(f"batches/{batch.id}", batch.model_dump_json().encode())

    def batch(self, batch_id: str) -> BatchObject | None:
        data = self.blobs.get(f"batches/{batch_id}")
        return None if data is None else BatchObject.model_validate_json(data)

    def batches(self) -> list[BatchObject]:
        found = (self.blobs.get(name) for name in self.blobs.names("batches"))
        return sorted(
            (BatchObject.model_validate_json(data) for data in found if data is not None),
            key=lambda batch: (batch.created_at, batch.id),
        )

    def record_line(self, batch_id: str, index: int, output_line: dict[str, Any]) -> None:
        """One finished input line (durable when this returns)."""
        entry = json.dumps({"index": index, "line": output_line}) + "\n"
        self.blobs.append(f"progress/{batch_id}", entry.encode())

    def finished_lines(self, batch_id: str) -> dict[int, dict[str, Any]]:
        """The output lines recorded so far, by input line index (a torn last entry, from a
        process killed mid-write, is skipped: that line runs again)."""
        data = self.blobs.get(f"progress/{batch_id}") or b""
        finished: dict[int, dict[str, Any]] = {}
        for raw in data.decode("utf-8", errors="replace").splitlines():
            try:
                entry = json.loads(raw)
            except json.JSONDecodeError:
                continue
            finished.setdefault(int(entry["index"]), entry["line"])
        return finished
