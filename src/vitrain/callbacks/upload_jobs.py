"""What happens to one upload job on the worker thread, and the record of every job's outcome.

A job never raises into the worker: it uploads (a redacted copy of a text file that holds a secret),
verifies, and records success or failure, so the callback can retry failures at the next save and report
them at the end. Bests replaced locally (ModelCheckpoint's save_top_k) are deleted from the bucket too.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from pathlib import Path

from vitrain.callbacks.upload_queue import UploadJob, signature
from vitrain.s3.client import MiB, S3Uri
from vitrain.s3.errors import S3Error, S3VerifyError
from vitrain.s3.store import S3Store, Uploaded
from vitrain.utils.secrets import find_secrets, scrub

log = logging.getLogger(__name__)

_TEXT_SUFFIXES = {".yaml", ".yml", ".log", ".md", ".json", ".txt", ".csv"}


class UploadRunner:
    """Runs jobs against `store` (called by the worker thread) and keeps what was uploaded and what failed."""

    def __init__(self, store: S3Store, prune: bool, fatal: bool) -> None:
        self.store = store
        self.prune = prune
        self.fatal = fatal
        self._lock = threading.Lock()
        self._done: dict[str, Uploaded] = {}  # by URI, in upload order
        self._failed: dict[str, tuple[UploadJob, str]] = {}  # by slot
        self._bests: dict[str, list[UploadJob]] = {}  # by slot, for pruning replaced bests

    @property
    def uploaded(self) -> list[str]:
        with self._lock:
            return list(self._done)

    @property
    def failures(self) -> list[str]:
        with self._lock:
            return [message for _job, message in self._failed.values()]

    def failed_jobs(self) -> list[UploadJob]:
        with self._lock:
            return [job for job, _message in self._failed.values()]

    def __call__(self, job: UploadJob) -> None:
        """Worker thread: upload, verify, record; never raises."""
        try:
            uploads = self._upload(job)
        except FileNotFoundError:
            log.debug("S3: %s is gone before upload (replaced by a newer checkpoint)", job.local)
            self._resolve(job.slot)
            # a best folder that save_top_k removed meanwhile: what went up is of no checkpoint
            if job.kind == "best" and job.folder and not job.local.exists():
                self._delete_under(job.uri, keep=[], what="file(s) of a best replaced while going up")
            return
        except S3VerifyError as err:
            if signature(job.local) != job.signature:  # rewritten while uploading: the newer save is queued
                log.debug("S3: %s changed during upload; the newer version will be uploaded", job.local)
                return
            self._record_failure(job, str(err))
            return
        except S3Error as err:
            self._record_failure(job, str(err))
            return
        except Exception as err:
            self._record_failure(job, scrub(f"{type(err).__name__}: {err}"))
            return
        if job.folder and not self._mirrored(job, uploads):
            return
        with self._lock:
            for up in uploads:
                self._done.pop(str(up.uri), None)
                self._done[str(up.uri)] = up
            self._failed.pop(job.slot, None)
        for up in uploads:
            log.info("S3: uploaded %s (%.1f MiB, sha256 %s)", up.uri, up.size / MiB, up.sha256[:12])
        if job.kind == "best":
            self._prune(job.slot, job)

    def _upload(self, job: UploadJob) -> list[Uploaded]:
        if job.folder:  # the files of the save that was offered, not what a newer save has begun; as one save
            names = [name for name, *_stat in job.signature]
            return self.store.upload_save(
                job.local, job.uri, names, unchanged=lambda: signature(job.local) == job.signature
            )
        if job.kind == "file" and job.local.suffix in _TEXT_SUFFIXES and job.local.stat().st_size < 16 * MiB:
            text = job.local.read_text(errors="replace")
            leaked = find_secrets(text)
            if leaked:  # never let a secret reach the bucket, even if some writer leaked it locally
                log.warning(
                    "S3: %s contains the value of %s; uploading a redacted copy", job.local, ", ".join(leaked)
                )
                return [self._upload_text(scrub(text), job)]
        return [self.store.upload_file(job.local, job.uri)]

    def _mirrored(self, job: UploadJob, uploads: list[Uploaded]) -> bool:
        """After a folder's upload: false if it was rewritten meanwhile (the newer save is queued and will
        do this), else delete what the prefix holds beyond this save's files (the older save), and forget
        the older save's files in the record of what is uploaded."""
        if signature(job.local) != job.signature:
            log.debug("S3: %s changed during upload; the newer version will be uploaded", job.local)
            return False
        self._delete_under(job.uri, keep=[up.uri for up in uploads], what="older file(s)")
        with self._lock:
            for uri in [u for u in self._done if u.startswith(f"{job.uri}/")]:
                self._done.pop(uri)
        return True

    def _delete_under(self, prefix: S3Uri, keep: list[S3Uri], what: str) -> None:
        """Delete the objects under `prefix` beyond `keep`; a refusal is a warning, not a failed upload."""
        try:
            stale = self.store.prune_tree(prefix, keep)
        except S3Error as err:
            log.warning("S3: could not delete %s under %s: %s", what, prefix, err)
        else:
            if stale:
                log.info("S3: deleted %d %s under %s/", len(stale), what, prefix)

    def _upload_text(self, text: str, job: UploadJob) -> Uploaded:
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / job.local.name
            copy.write_text(text)
            up = self.store.upload_file(copy, job.uri)
        return Uploaded(up.uri, job.local, up.size, up.sha256)

    def _record_failure(self, job: UploadJob, message: str) -> None:
        with self._lock:
            self._failed[job.slot] = (job, message)
        what = (
            "fatal (fatal=true): training will stop"
            if self.fatal
            else "training goes on; will retry at the next save and at the end"
        )
        log.error("S3 upload failed: %s. Local copy kept at %s; %s", message, job.local, what)

    def _resolve(self, slot: str) -> None:
        with self._lock:
            self._failed.pop(slot, None)

    def _prune(self, slot: str, new: UploadJob) -> None:
        """Delete earlier bests of this slot once ModelCheckpoint has removed them locally (save_top_k); a
        sharded best is every object under its prefix."""
        keep: list[UploadJob] = []
        for old in self._bests.get(slot, []):
            if old.uri == new.uri:
                continue
            if self.prune and not old.local.exists():
                try:
                    if old.folder:
                        self.store.prune_tree(old.uri, keep=[])
                    else:
                        self.store.delete(old.uri)
                except S3Error as err:
                    log.warning("S3: could not delete replaced checkpoint %s: %s", old.uri, err)
                else:
                    with self._lock:
                        for uri in [
                            u for u in self._done if u == str(old.uri) or u.startswith(f"{old.uri}/")
                        ]:
                            self._done.pop(uri)
                    log.info("S3: deleted replaced checkpoint %s", old.uri)
                    continue
            keep.append(old)
        self._bests[slot] = [*keep, new]
