"""The sha256 and the ETag S3 will report for a local file, computed in one pass.

An upload is checked against these (and a download against the stored ones), so the ETag follows
s3transfer's own multipart rule: the MD5 of the parts' MD5s, with its part size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from s3transfer.utils import ChunksizeAdjuster

from vitrain.s3.client import MiB

_HASH_BLOCK = 4 * MiB


@dataclass(frozen=True)
class Digest:
    size: int
    sha256: str
    etag: str  # what S3 computes for this file uploaded with our transfer config


def file_digest(path: Path, multipart_threshold: int, multipart_chunksize: int) -> Digest:
    """sha256 and the expected S3 ETag of `path`, in one pass over the file."""
    size = path.stat().st_size
    multipart = size >= multipart_threshold  # same rule as s3transfer
    part_size = ChunksizeAdjuster().adjust_chunksize(multipart_chunksize, size) if multipart else 0
    sha, whole, part = hashlib.sha256(), _md5(), _md5()
    parts: list[bytes] = []
    in_part = 0
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            sha.update(block)
            if not multipart:
                whole.update(block)
                continue
            view = memoryview(block)
            while view:
                take = min(len(view), part_size - in_part)
                part.update(view[:take])
                in_part += take
                view = view[take:]
                if in_part == part_size:
                    parts.append(part.digest())
                    part, in_part = _md5(), 0
    if not multipart:
        return Digest(size, sha.hexdigest(), whole.hexdigest())
    if in_part:
        parts.append(part.digest())
    return Digest(size, sha.hexdigest(), f"{_md5(b''.join(parts)).hexdigest()}-{len(parts)}")


def _md5(data: bytes = b"") -> Any:
    return hashlib.md5(data, usedforsecurity=False)
