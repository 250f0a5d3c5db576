"""The background side of the S3 upload: one thread draining a queue of jobs, and what tells a file changed.

Uploads run beside training, never in its hooks; jobs for the same slot replace each other, so a burst of
`last.ckpt` saves costs one upload of the newest. A file's identity is its (size, mtime, inode), a sharded
checkpoint's the identities of all its files, and a sharded folder only counts once every shard is there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitrain.s3.client import S3Uri

log = logging.getLogger(__name__)

Signature = tuple[Any, ...]


@dataclass(frozen=True)
class UploadJob:
    local: Path
    uri: S3Uri
    slot: str  # jobs for the same slot replace each other: only the newest `last.ckpt` matters
    signature: Signature
    kind: str  # "best", "last" or "file"

    @property
    def folder(self) -> bool:
        """A sharded checkpoint (its signature has an entry per file): still known once the folder is gone."""
        return bool(self.signature) and isinstance(self.signature[0], tuple)


class UploadWorker:
    """One background thread draining a queue of jobs keyed by slot."""

    def __init__(self, run: Callable[[UploadJob], None]) -> None:
        self._run = run
        self._cond = threading.Condition()
        self._pending: dict[str, UploadJob] = {}
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="s3-upload", daemon=True)
        self._thread.start()

    def submit(self, job: UploadJob) -> None:
        with self._cond:
            self._pending.pop(job.slot, None)  # re-insert at the end: keep submission order
            self._pending[job.slot] = job
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """True when the queue is empty and nothing is running."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._pending) + int(self._busy)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return
                slot = next(iter(self._pending))
                job = self._pending.pop(slot)
                self._busy = True
            try:
                self._run(job)
            except Exception:  # the worker must survive anything: a dead thread would hang `wait`
                log.exception("S3: unexpected error uploading %s", job.local)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def signature(path: Path) -> Signature | None:
    """Identity of what is on disk at `path` (a file or a sharded folder), or None if missing."""
    try:
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
            return tuple((p.relative_to(path).as_posix(), *_stat(p)) for p in files)
        return _stat(path)
    except FileNotFoundError:
        return None


def _stat(path: Path) -> Signature:
    st = path.stat()
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def sharded_complete(folder: Path) -> bool:
    """Every shard named in the DCP `.metadata` exists: false without a shared filesystem across nodes."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (folder / ".metadata").is_file():
        return False
    try:
        storage = FileSystemReader(str(folder)).read_metadata().storage_data
    except Exception:
        return False
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    return all(
        (folder / rel).is_file() and (folder / rel).stat().st_size >= end for rel, end in needed.items()
    )
