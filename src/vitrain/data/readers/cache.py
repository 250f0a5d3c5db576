"""The on-disk cache's keys and archive unpacking, shared by every data source that caches what it reads.

A key changes when the source's path, size or mtime does, so an edited data set is decoded again and an
unchanged one never is; an archive is unpacked once into a folder named by such a key.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tarfile
import tempfile
import zipfile
import zlib
from pathlib import Path

from vitrain.errors import DataError

log = logging.getLogger(__name__)

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
#: in each unpacked folder, the archive it came from: the unpack of a changed archive names the older ones
SOURCE_FILE = ".vitrain-archive"
# bump when the decoded file's content changes, so old caches are not mistaken for new ones
CACHE_FORMAT = 1


def unpack_archive(archive: Path, unpack_root: Path) -> Path:
    """Unpack once into a folder keyed by the archive's path, size and mtime; a half-done unpack never counts."""
    key = digest(f"{archive}|{stat_key(archive)}")
    name = archive.name
    for suffix in ARCHIVE_SUFFIXES:
        name = name.removesuffix(suffix)
    target = unpack_root / f"{name}-{key}"
    if target.is_dir():
        return target
    unpack_root.mkdir(parents=True, exist_ok=True)
    # logged before the folder is made: a Ctrl-C in the log call (a slow terminal) leaves nothing behind
    log.info("unpacking %s into %s (first run only)", archive, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=unpack_root))
    try:
        if archive.name.lower().endswith(".zip"):  # zipfile drops absolute paths and `..` from member names
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(tmp)
        else:
            with tarfile.open(archive) as tf:
                tf.extractall(tmp, filter="data")
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, OSError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(
            f"cannot unpack {archive} ({type(e).__name__}: {str(e).splitlines()[0].rstrip(':')}): "
            "the archive is truncated or corrupted, copy or download it again"
        ) from e
    except BaseException:  # Ctrl-C during a long unpack: no hidden half copy left taking the disk
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    source = str(archive.absolute())
    (tmp / SOURCE_FILE).write_text(source)
    try:
        tmp.rename(target)
    except OSError:  # another process finished the same unpack first
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():
            raise
        return target
    older = [
        p
        for p in sorted(unpack_root.glob(f"{name}-*"))
        if p != target and (p / SOURCE_FILE).is_file() and (p / SOURCE_FILE).read_text() == source
    ]
    if older:
        # not removed here: a run started before the archive changed may still read it
        log.warning(
            "%s has changed since it was unpacked before (its size or time): the older unpack(s) %s can be "
            "removed once no run reads them",
            archive, ", ".join(map(str, older)),
        )  # fmt: skip
    return target


def is_archive(path: Path) -> bool:
    return path.name.lower().endswith(ARCHIVE_SUFFIXES)


def stat_key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}|{st.st_mtime_ns}"


def digest(text: str) -> str:
    return hashlib.sha256(f"v{CACHE_FORMAT}|{text}".encode()).hexdigest()[:16]
