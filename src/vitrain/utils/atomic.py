"""Replacing a file whole: readers see the old content or the new, never part of it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(
    path: str | Path, data: bytes | memoryview | str | Callable[[BinaryIO], None], *, durable: bool = False
) -> Path:
    """Write `data` (or let `data(file)` write) to a temporary file beside `path`, then rename it over `path`.

    A rename within one directory is atomic, a copy across filesystems is not: so the temporary file lives
    in the target's directory. Its name is unique per call (parallel writers, several ranks). `durable`
    also fsyncs the file and the directory, so that a crash right after cannot bring the old content back
    (checkpoints). The file gets the usual umask permissions, unlike `tempfile.mkstemp`'s 0600.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("xb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return path
