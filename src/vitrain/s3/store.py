"""`S3Store`: a configured client plus the verified operations the project needs.

Upload checks what the store holds against the local bytes; download goes through a cache keyed by the
object's ETag, filled once per node and only by atomic rename, so a resume never reads a half-written file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from boto3.s3.transfer import TransferConfig
from botocore.exceptions import BotoCoreError, ClientError
from filelock import FileLock

from vitrain.errors import UserError
from vitrain.s3.client import S3Options, S3Uri, make_client, parse_s3_uri
from vitrain.s3.digest import Digest, file_digest
from vitrain.s3.errors import S3Error, S3ObjectNotFound, S3VerifyError, classify, error_code

log = logging.getLogger(__name__)

SHA256_META = "sha256"  # object metadata key (sent as x-amz-meta-sha256)
# a checkpoint folder's last object: its save's subfolder and each file's sha256 (not fetched into the folder)
SAVE_MANIFEST = ".vitrain-save.json"
_SAVE_DIR = re.compile(r"save-[0-9a-f]{16}/")  # the subfolder of one save (`upload_save`)


@dataclass(frozen=True)
class Uploaded:
    uri: S3Uri
    local: Path
    size: int
    sha256: str


class S3Store:
    """A configured client plus the verified operations the project needs."""

    def __init__(self, options: S3Options | None = None) -> None:
        self.options = options or S3Options()
        try:
            self.client = make_client(self.options)
        except BotoCoreError as exc:  # e.g. AWS_PROFILE names no profile
            raise classify(exc, "creating the client", self.options.endpoint_url or "(default)") from None
        self.transfer = TransferConfig(
            multipart_threshold=self.options.multipart_threshold,
            multipart_chunksize=self.options.multipart_chunksize,
            max_concurrency=self.options.max_concurrency,
            # classic: the CRT client would choose its own part size and break the ETag check
            preferred_transfer_client="classic",
        )

    @property
    def endpoint(self) -> str:
        return self.client.meta.endpoint_url

    # --- checks -------------------------------------------------------------------------------------------

    def preflight(self, uri: S3Uri) -> None:
        """Put and delete a marker under `uri`: fails in seconds, not after hours of training."""
        quick = make_client(replace(self.options, max_attempts=2, connect_timeout=5.0, read_timeout=20.0))
        marker = uri.child(f".vitrain-preflight-{uuid.uuid4().hex}")
        try:
            quick.put_object(Bucket=marker.bucket, Key=marker.key, Body=b"vitrain preflight\n")
        except Exception as exc:
            raise self.error(exc, f"cannot write to s3://{uri.bucket}/{uri.key}") from None
        try:
            quick.delete_object(Bucket=marker.bucket, Key=marker.key)
        except Exception as exc:
            log.warning(
                "S3: could not delete preflight marker %s (%s); uploads work, pruning will not", marker, exc
            )

    def error(self, exc: BaseException, doing: str) -> S3Error:
        """One-line, classified, secret-free error for a boto3/botocore failure."""
        return classify(exc, doing, self.endpoint)

    # --- upload ---------------------------------------------------------------------------------------------

    def digest(self, path: Path) -> Digest:
        return file_digest(path, self.transfer.multipart_threshold, self.transfer.multipart_chunksize)

    def upload_file(self, path: Path, uri: S3Uri, digest: Digest | None = None) -> Uploaded:
        """Upload with the transfer manager (multipart when large), then check what the store holds."""
        digest = digest or self.digest(path)
        try:
            self.client.upload_file(
                str(path),
                uri.bucket,
                uri.key,
                ExtraArgs={"Metadata": {SHA256_META: digest.sha256}},
                Config=self.transfer,
            )
            head = self.client.head_object(Bucket=uri.bucket, Key=uri.key)
        except FileNotFoundError:
            raise  # the caller's business (a checkpoint replaced meanwhile), not an S3 failure
        except Exception as exc:
            raise self.error(exc, f"uploading {path} to {uri}") from exc
        self._check(uri, head, digest)
        return Uploaded(uri, path, digest.size, digest.sha256)

    def upload_tree(self, folder: Path, uri: S3Uri, names: Sequence[str] | None = None) -> list[Uploaded]:
        """The files below `folder` (every one, or the relative paths `names`), keyed by relative path,
        `options.parallel_files` at once; the results in the order of `names`."""
        if names is None:
            names = [path.relative_to(folder).as_posix() for path in _files(folder)]
        return self._in_parallel(lambda name: self.upload_file(folder / name, uri.child(name)), list(names))

    def upload_save(
        self, folder: Path, uri: S3Uri, names: Sequence[str], unchanged: Callable[[], bool] | None = None
    ) -> list[Uploaded]:
        """A checkpoint folder as one save that leaves the folder's older save whole until it is complete.

        S3 has no rename: a newer save written over the folder's keys would replace its files one by one, and
        an upload cut off midway (a machine lost without SIGTERM) would leave two saves' shards under one
        prefix, which load silently mixed when their shapes match. So the files go under a new
        `<uri>/save-<id>/`, and `SAVE_MANIFEST` at `<uri>/`, naming that subfolder and each file's sha256,
        goes up last: until it does, a fetch takes the older save the manifest names (`_whole_save`). No
        manifest goes up when `unchanged()` says the local folder was rewritten meanwhile (its files may be
        of two saves). The caller deletes the older save's objects once the manifest is up."""
        save = f"save-{uuid.uuid4().hex[:16]}"  # matches _SAVE_DIR
        uploads = self.upload_tree(folder, uri.child(save), names)
        if unchanged is not None and not unchanged():
            return uploads
        files = {name: up.sha256 for name, up in zip(names, uploads, strict=True)}
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / SAVE_MANIFEST
            local.write_text(json.dumps({"save": save, "files": files}, indent=1) + "\n")
            up = self.upload_file(local, uri.child(SAVE_MANIFEST))
        return [*uploads, replace(up, local=folder / SAVE_MANIFEST)]

    def prune_tree(self, uri: S3Uri, keep: Collection[S3Uri]) -> list[S3Uri]:
        """Delete the objects under the prefix `uri` that are not in `keep`; return them.

        A sharded checkpoint re-uploaded to the same prefix must not keep files of an older save: a writer's
        temporary file caught by an earlier upload (DCP's `.metadata.tmp`) or another world size's shards
        would be downloaded with it at every resume.
        """
        kept = {u.key for u in keep}
        stale = [S3Uri(uri.bucket, key) for key, _etag, _size in self._listing(uri) if key not in kept]
        # one DELETE each: the batch DeleteObjects is missing from some S3-compatible stores
        for obj in stale:
            self.delete(obj)
        return stale

    def _check(self, uri: S3Uri, head: dict[str, Any], digest: Digest) -> None:
        problems = []
        if head["ContentLength"] != digest.size:
            problems.append(f"size {head['ContentLength']} != local {digest.size}")
        stored_sha = head.get("Metadata", {}).get(SHA256_META)
        if stored_sha != digest.sha256:
            problems.append(f"sha256 metadata {stored_sha} != local {digest.sha256}")
        etag = head.get("ETag", "").strip('"')
        if self.options.verify_etag and etag != digest.etag:
            problems.append(
                f"ETag {etag} != local MD5 {digest.etag} (set verify_etag=false if this store's ETag is not an MD5)"
            )
        if problems:
            raise S3VerifyError(f"S3: {uri} does not match the local file: {'; '.join(problems)}")

    def delete(self, uri: S3Uri) -> None:
        try:
            self.client.delete_object(Bucket=uri.bucket, Key=uri.key)
        except Exception as exc:
            raise self.error(exc, f"deleting {uri}") from exc

    # --- download -------------------------------------------------------------------------------------------

    def fetch(self, uri: S3Uri, cache_dir: Path) -> Path:
        """Download an object, or every object under a prefix, into a verified cache; return the local path.

        The cache is keyed by bucket/key/ETag(s), so a re-uploaded object is fetched again and an unchanged
        one is not. Entries only appear (by atomic rename) once verified. Ranks that fetch at once (torchrun
        or SLURM start every local rank itself, before any process group exists for a barrier) take a file
        lock per entry: the first downloads, the others wait and read its copy, so a node downloads once.
        """
        if not uri.key:
            raise UserError(f"{uri}: give a key or prefix inside the bucket, not the bucket itself")
        rel = _safe_relpath(uri.key)
        base = cache_dir / uri.bucket / rel
        head = self._head(uri)
        if head is None:  # a folder
            listing = self._listing(uri)
            return self._reread_if_changed(
                uri, listing, lambda listed: self._fetch_listed(uri, base, listed), lambda: self._listing(uri)
            )
        return self._reread_if_changed(
            uri,
            head,
            lambda h: self._fetch_object(uri, h, base),
            lambda: self._head(uri),
            lambda h: h["ETag"],
        )

    def _reread_if_changed(
        self,
        uri: S3Uri,
        state: Any,
        read: Callable[[Any], Path],
        refresh: Callable[[], Any],
        version: Callable[[Any], Any] = lambda state: state,
    ) -> Path:
        """`read(state)` (the object's head, or the folder's listing), read again with `refresh()`'s newer state
        when it failed as a concurrent save explains (an object gone, bytes not the ones expected) and the
        object or folder did change: a training run's upload replaces an object (a ranged download can then
        mix both versions: the sha256 refuses that), or puts a newer save's manifest up and then deletes the
        older save's files, which a reader (eval.py, another machine) listed a moment before. A failure of an
        unchanged object or folder stands."""
        for attempt in range(1, _CHANGED_READS + 1):
            try:
                return read(state)
            except (S3ObjectNotFound, S3VerifyError) as err:
                before, state = state, refresh()
                if state is None or version(state) == version(before) or attempt == _CHANGED_READS:
                    raise
                log.info("S3: %s changed while it was read (%s): reading it again", uri, err)
        raise AssertionError("unreachable")

    def _head(self, uri: S3Uri) -> dict[str, Any] | None:
        """The object's head, or None when there is no object at `uri`."""
        try:
            return self.client.head_object(Bucket=uri.bucket, Key=uri.key)
        except ClientError as exc:
            if error_code(exc) not in {"404", "NoSuchKey", "NotFound"}:
                raise self.error(exc, f"reading {uri}") from exc
            return None
        except Exception as exc:
            raise self.error(exc, f"reading {uri}") from exc

    def _fetch_object(self, uri: S3Uri, head: dict[str, Any], base: Path) -> Path:
        target = base / _etag_dir(head["ETag"]) / base.name
        with _entry_lock(target):
            if target.is_file() and target.stat().st_size == head["ContentLength"]:
                log.info("S3: %s is cached at %s", uri, target)
                return target
            partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
            try:
                self._download_verified(uri, head, partial)
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
        log.info("S3: fetched %s -> %s", uri, target)
        return target

    def _fetch_listed(self, uri: S3Uri, base: Path, listing: list[tuple[str, str, int]]) -> Path:
        prefix = uri.key.rstrip("/") + "/"
        if not listing:
            raise S3ObjectNotFound(f"S3: no object and no folder at {uri}")
        keys = {key for key, _etag, _size in listing}
        if prefix + SAVE_MANIFEST not in keys and all(_SAVE_DIR.match(key[len(prefix) :]) for key in keys):
            # `upload_save`'s files without its manifest: the folder's first save was cut off midway
            raise S3ObjectNotFound(
                f"S3: no whole save at {uri}/ yet: the upload of its first save was cut off midway"
            )
        version = hashlib.sha256(repr(listing).encode()).hexdigest()[:16]
        target = base / version / Path(prefix.rstrip("/")).name
        with _entry_lock(target):
            if target.is_dir():
                log.info("S3: %s/ is cached at %s", uri, target)
                return target

            def read_head(key: str) -> dict[str, Any]:
                try:
                    return self.client.head_object(Bucket=uri.bucket, Key=key)
                except Exception as exc:
                    raise self.error(exc, f"reading {S3Uri(uri.bucket, key)}") from exc

            listed = [key for key, _etag, _size in listing]
            heads = dict(zip(listed, self._in_parallel(read_head, listed), strict=True))
            # a folder `upload_save` wrote: the files of the save its manifest names, if whole
            if prefix + SAVE_MANIFEST in heads:
                files = self._whole_save(uri, prefix, heads)  # a newer manifest than the listing: read again
            else:
                files = {key: (key[len(prefix) :], head) for key, head in heads.items()}
            staging = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")

            def download(item: tuple[str, tuple[str, dict[str, Any]]]) -> None:
                key, (name, head) = item
                dest = staging / _safe_relpath(name)
                dest.parent.mkdir(parents=True, exist_ok=True)
                self._download_verified(S3Uri(uri.bucket, key), head, dest)

            try:
                self._in_parallel(download, sorted(files.items()))
                try:
                    os.replace(staging, target)
                except OSError:
                    if not target.is_dir():  # a process without the lock (NFS without locking) won the race
                        raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        log.info("S3: fetched %s/ (%d files) -> %s", uri, len(files), target)
        return target

    def _in_parallel(self, work: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """`work(item)` for each item, `options.parallel_files` at once (boto3's clients are thread-safe; its
        transfer manager takes one file's parts, not many files), the results in order; the first failure is
        raised once the calls in flight end, and the ones not started are dropped."""
        if len(items) <= 1 or self.options.parallel_files <= 1:
            return [work(item) for item in items]
        with ThreadPoolExecutor(min(self.options.parallel_files, len(items)), "s3-files") as pool:
            try:
                return list(pool.map(work, items))
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise

    def _whole_save(
        self, uri: S3Uri, prefix: str, heads: dict[str, dict[str, Any]]
    ) -> dict[str, tuple[str, dict[str, Any]]]:
        """{key: (name in the folder, head)} of the files of the save the folder's manifest names, once each
        holds the bytes the manifest names (the download then checks the bytes against the head). Objects
        the manifest does not name (a newer save whose upload was cut off, an older one not yet deleted) are
        left out. A manifest without `save` (the files at the folder's top) is an earlier version's."""
        key = prefix + SAVE_MANIFEST
        try:
            manifest = json.loads(self.client.get_object(Bucket=uri.bucket, Key=key)["Body"].read())
            files, save = dict(manifest["files"]), manifest.get("save")
            base = prefix + (f"{_safe_relpath(save).as_posix()}/" if save else "")
        except (ValueError, KeyError, TypeError, AttributeError, UserError):
            raise S3VerifyError(f"S3: {S3Uri(uri.bucket, key)} is not a readable save manifest") from None
        except Exception as exc:
            raise self.error(exc, f"reading {S3Uri(uri.bucket, key)}") from exc
        whole = {}
        for name, sha256 in files.items():
            head = heads.get(base + name)
            meta = (head or {}).get("Metadata", {})
            if head is None or meta.get(SHA256_META) != sha256:
                # an earlier version's manifest: its files were replaced in place by a newer save's upload
                why = "changed since its upload" if save else "an upload of a newer save was cut off midway"
                raise S3VerifyError(
                    f"S3: {uri}/ is not one whole save: {save + '/' if save else ''}{name} is "
                    f"{'missing' if head is None else 'not the file the folder manifest names'} ({why}); "
                    "resume from another checkpoint, or upload the folder again"
                )
            whole[base + name] = (name, head)
        ignored = len(heads) - len(whole) - 1
        if ignored:
            log.info("S3: %s/: %d object(s) not of its save (%s) left out", uri, ignored, save)
        return whole

    def _listing(self, uri: S3Uri) -> list[tuple[str, str, int]]:
        """(key, ETag, size) of every object under the prefix `uri`, sorted."""
        prefix = uri.key.rstrip("/") + "/"
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=uri.bucket, Prefix=prefix)
            return sorted(
                (o["Key"], o["ETag"], o["Size"]) for page in pages for o in page.get("Contents", [])
            )
        except Exception as exc:
            raise self.error(exc, f"listing {uri}") from exc

    def _download_verified(self, uri: S3Uri, head: dict[str, Any], dest: Path) -> None:
        try:
            self.client.download_file(uri.bucket, uri.key, str(dest), Config=self.transfer)
        except Exception as exc:
            raise self.error(exc, f"downloading {uri}") from exc
        size = dest.stat().st_size
        if size != head["ContentLength"]:
            raise S3VerifyError(f"S3: {uri} downloaded {size} bytes, expected {head['ContentLength']}")
        sha = head.get("Metadata", {}).get(SHA256_META)
        etag = head["ETag"].strip('"')
        if sha:
            local = file_digest(dest, size + 1, 1).sha256
            if local != sha:
                raise S3VerifyError(f"S3: {uri} sha256 {local} != stored {sha}; the download is corrupt")
        elif self.options.verify_etag and re.fullmatch(r"[0-9a-f]{32}", etag):
            local = file_digest(dest, size + 1, 1).etag
            if local != etag:
                raise S3VerifyError(f"S3: {uri} MD5 {local} != ETag {etag}; the download is corrupt")
        else:
            log.info("S3: %s has no sha256 metadata and a multipart ETag: only its size was verified", uri)


# reads of an object or folder that changed while it was read (`S3Store.fetch`): a save every few minutes at most
_CHANGED_READS = 3


def fetch_checkpoint(uri: str, cache_dir: Path, options: S3Options | None = None) -> Path:
    """Local path (file, or folder for a sharded checkpoint) of the checkpoint at `uri`, downloaded if needed.

    Client settings default to the environment (AWS_ENDPOINT_URL, AWS_PROFILE, AWS_REGION, ...).
    """
    return S3Store(options).fetch(parse_s3_uri(uri), cache_dir)


# --- helpers ------------------------------------------------------------------------------------------------


def _files(folder: Path) -> Iterator[Path]:
    return (p for p in sorted(folder.rglob("*")) if p.is_file())


def _entry_lock(target: Path) -> FileLock:
    """An inter-process lock for one cache entry (a lock file beside it, left in place: deleting it would
    let a waiter and a newcomer lock different files)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(target.with_name(f".{target.name}.lock"))


def _safe_relpath(key: str) -> Path:
    """A key as a relative path that cannot escape the cache directory."""
    parts = [p for p in key.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise UserError(f"S3 key {key!r} cannot be used as a local path")
    return Path(*parts)


def _etag_dir(etag: str) -> str:
    return "etag-" + re.sub(r"[^A-Za-z0-9-]", "", etag)
