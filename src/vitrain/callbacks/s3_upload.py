"""Upload checkpoints, logs and run files to S3 in the background while training goes on.

When is a checkpoint on disk? ModelCheckpoint writes inside its own hooks, Lightning moves it to the end of
the callback list, and `on_save_checkpoint` fires before the write; wrapping the CheckpointIO would miss
ModelParallelStrategy, which writes sharded folders without it. So every hook of ours that runs after a
possible save looks at each ModelCheckpoint's `best_model_path` / `last_model_path` and uploads the ones
whose (size, mtime, inode) changed. `Trainer.save_checkpoint` returns only after a barrier, so at that point
the file, or every shard of a folder (checked against the DCP `.metadata`), is complete on disk, except one
that `AtomicCheckpointIO` still writes in the background: it appears (renamed into place, whole) at a later
hook, and the end of training waits for it (`wait_for_writes`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from vitrain.callbacks.upload_jobs import UploadRunner
from vitrain.callbacks.upload_queue import Signature, UploadJob, UploadWorker, sharded_complete, signature
from vitrain.checkpoints import wait_for_writes
from vitrain.errors import UserError
from vitrain.s3.client import S3Options, S3Uri, parse_s3_uri
from vitrain.s3.errors import S3Error, S3ObjectNotFound
from vitrain.s3.store import S3Store
from vitrain.utils.atomic import write_atomic
from vitrain.utils.run_files import LOGGER_RUNS_FILE

log = logging.getLogger(__name__)


class S3CheckpointUpload(Callback):
    """Mirror the run to `s3://<bucket>/<prefix>/<run_name>/` (see configs/callbacks/s3.yaml for the knobs).

    `options` (client and transfer settings) is one node so the callback's own knobs stay apart from boto3's,
    and so a resume from S3 reads with the same client the run uploaded with.

    Only global rank zero talks to S3. Failures never stop training unless `fatal=True`; the local files are
    always kept. After fit, `uploaded` lists the s3:// URIs and `failures` the errors still unresolved.
    """

    def __init__(
        self,
        bucket: str | None,
        prefix: str = "runs",
        run_name: str | None = None,
        run_dir: str | None = None,
        runs_root: str | None = None,
        upload_best: bool = True,
        upload_last: bool = True,
        upload_logs: bool = True,
        run_files: Sequence[str] = (
            ".hydra/config.yaml",
            ".hydra/overrides.yaml",
            "config_tree.log",
            "report.md",
            "report.json",
            "*.log",
        ),
        prune: bool = True,
        preflight: bool = True,
        fatal: bool = False,
        wait_timeout: float | None = None,
        options: S3Options | Mapping[str, Any] | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix
        self.run_name = run_name
        self.run_dir = Path(run_dir) if run_dir else None
        self.runs_root = Path(runs_root) if runs_root else None
        self.upload_best = upload_best
        self.upload_last = upload_last
        self.upload_logs = upload_logs
        self.run_files = list(run_files)
        self.prune = prune
        self.preflight = preflight
        self.fatal = fatal
        self.wait_timeout = wait_timeout
        self.options = S3Options.from_config(options)  # a frozen dataclass: the callback stays picklable
        # Created in `setup`, not here: a callback holding threads or clients cannot be pickled (ddp_spawn).
        self._runner: UploadRunner | None = None  # the store, and what was uploaded or failed
        self._worker: UploadWorker | None = None
        self.base: S3Uri | None = None
        self._queued: dict[Path, Signature] = {}  # what was last handed to the worker, per local path
        self._stop_requested = False

    # --- public results ---------------------------------------------------------------------------------------

    @property
    def uploaded(self) -> list[str]:
        return self._runner.uploaded if self._runner is not None else []

    @property
    def failures(self) -> list[str]:
        return self._runner.failures if self._runner is not None else []

    # --- Lightning hooks --------------------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self._worker is not None:
            return
        problem: UserError | None = None
        if trainer.is_global_zero:
            try:
                self._start(trainer)
            except UserError as err:
                problem = err
        message = str(problem) if problem else None
        if trainer.world_size > 1:  # every rank fails the same way, none is left waiting in a collective
            message = trainer.strategy.broadcast(message, src=0)
        if problem is not None:
            raise problem
        if message:
            raise S3Error(message)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self._collect(trainer)  # saves by `every_n_train_steps`

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._collect(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._collect(trainer)  # saves of this epoch's validation
        if self.fatal and self._must_stop(trainer):
            trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Still inside fit on every rank: the last chance for all ranks to fail together when `fatal`.
        if self._worker is not None:
            wait_for_writes(trainer)
            self._collect(trainer, retry=True)
            self._wait()
        if self.fatal and self._must_stop(trainer):
            raise S3Error(self._fatal_message())

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._worker is None:
            return
        wait_for_writes(trainer)
        self._collect(trainer, retry=True)  # ModelCheckpoint's own on_train_end save
        self.upload_run_files(trainer, wait=False)
        self._wait()
        self._report()
        if self.fatal and self.failures:
            raise S3Error(self._fatal_message())

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and self._worker is not None:
            self._worker.close(self.wait_timeout)
            self._worker = None

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if self._worker is None:
            return
        if not isinstance(exception, KeyboardInterrupt):  # keep what was saved before the crash
            with contextlib.suppress(Exception):  # a write that failed is the run's error, raised elsewhere
                wait_for_writes(trainer)
            self._collect(trainer, retry=True)
            self._wait(timeout=self.wait_timeout if self.wait_timeout is not None else 600.0)
            self._report()
        self._worker.close(timeout=0)
        self._worker = None

    def fetch_last(self, trainer: L.Trainer, cache_dir: Path) -> Path | None:
        """This run's `last` checkpoint from the bucket (a new machine with an empty disk), downloaded into
        `cache_dir`; None without a bucket or when the run has none there yet (vitrain/tasks/runs.py)."""
        if not self.bucket:
            return None
        uri = self.run_uri(trainer).child("checkpoints", "last.ckpt")
        try:
            path = S3Store(self.options).fetch(uri, cache_dir)
        except S3ObjectNotFound as err:
            log.info("%s: nothing to resume", err)
            return None
        log.info("Resuming from %s (downloaded from %s)", path, uri)
        self._fetch_logger_runs(trainer, cache_dir)
        return path

    def _fetch_logger_runs(self, trainer: L.Trainer, cache_dir: Path) -> None:
        """The run's `logger_runs.json` beside the checkpoint, so the resume continues its W&B / MLflow runs
        on this machine too (vitrain/loggers.py); a run without one continues without it."""
        local = self._root() / LOGGER_RUNS_FILE
        if local.exists():
            return
        try:
            fetched = S3Store(self.options).fetch(self.run_uri(trainer).child(LOGGER_RUNS_FILE), cache_dir)
        except S3ObjectNotFound:
            return
        write_atomic(local, fetched.read_bytes())

    def run_stats_entry(self) -> dict[str, Any]:
        """This callback's part of run_stats.json (vitrain/callbacks/run_stats.py)."""
        return {"s3": {"uploaded": self.uploaded, "failures": self.failures}}

    # --- run files --------------------------------------------------------------------------------------------

    def upload_run_files(self, trainer: L.Trainer | None = None, wait: bool = True) -> list[str]:
        """Logger dirs (TensorBoard events, CSV metrics) and the run's config/report files.

        Called at the end of fit; call it again after writing a report (only changed files go up again).
        Returns the URIs uploaded so far.
        """
        if self._runner is None:
            return self.uploaded
        if self._worker is None:  # after teardown: a short-lived worker for this call
            self._worker = UploadWorker(self._runner)
            closing = True
        else:
            closing = False
        if self.upload_logs and trainer is not None:
            for log_dir in _logger_dirs(trainer):
                for path in sorted(p for p in log_dir.rglob("*") if p.is_file()):
                    self._offer(path, slot=f"file:{path}", kind="file")
        root = self._root()
        for pattern in self.run_files:
            for path in sorted(root.glob(pattern)):
                if path.is_file():
                    self._offer(path, slot=f"file:{path}", kind="file")
        self._retry_failed()
        if wait or closing:
            self._wait()
        if closing:
            self._worker.close()
            self._worker = None
        return self.uploaded

    # --- internals --------------------------------------------------------------------------------------------

    def _start(self, trainer: L.Trainer) -> None:
        if not self.bucket:
            raise S3Error(
                "S3 upload is enabled but no bucket is set: export S3_BUCKET=<bucket> (or .env), "
                "or pass callbacks.s3_upload.bucket=<bucket>"
            )
        self.base = self.run_uri(trainer)
        store = S3Store(self.options)
        if self.preflight:
            store.preflight(self.base)
        self._runner = UploadRunner(store, prune=self.prune, fatal=self.fatal)
        self._worker = UploadWorker(self._runner)
        log.info("S3: uploading checkpoints to %s/", self.base)
        # what a resume on another machine reads besides `last` (written before fit): up now, not at the end
        runs_file = self._root() / LOGGER_RUNS_FILE
        if runs_file.is_file():
            self._offer(runs_file, slot=f"file:{runs_file}", kind="file")

    def run_uri(self, trainer: L.Trainer) -> S3Uri:
        """`s3://<bucket>/<prefix>/<run name>`: where this run's files go, and where a resume looks."""
        bucket = parse_s3_uri(f"s3://{self.bucket}").bucket
        return S3Uri(bucket).child(self.prefix or "", self._run_name(trainer))

    def _root(self) -> Path:
        return self.run_dir or Path.cwd()

    def _run_name(self, trainer: L.Trainer) -> str:
        if self.run_name:
            return self.run_name
        if self.run_dir is None:
            self.run_dir = Path(trainer.default_root_dir)
        run_dir = self.run_dir.resolve()
        if self.runs_root is not None:
            try:
                return run_dir.relative_to(self.runs_root.resolve()).as_posix()
            except ValueError:
                pass
        return run_dir.name

    def _uri_for(self, path: Path, kind: str) -> S3Uri:
        """The run dir's layout, mirrored: `<base>/checkpoints/last.ckpt`, `<base>/tensorboard/...`."""
        assert self.base is not None
        root = self._root()
        # not resolve() on the path: `last.ckpt` may be a symlink to the best file (save_last="link")
        for candidate, base in (
            (path.absolute(), root.absolute()),
            (path.parent.resolve() / path.name, root.resolve()),
        ):
            try:
                return self.base.child(candidate.relative_to(base).as_posix())
            except ValueError:
                continue
        return self.base.child("checkpoints" if kind != "file" else "files", path.name)  # outside the run dir

    def _collect(self, trainer: L.Trainer, retry: bool = False) -> None:
        """Queue checkpoints that changed on disk since we last queued them (rank zero only)."""
        if self._worker is None:
            return
        new = False
        for index, callback in enumerate(trainer.checkpoint_callbacks):
            if not isinstance(callback, ModelCheckpoint):
                continue
            # a ModelCheckpoint without a monitor keeps the newest state (our `last_checkpoint`): its
            # "best" is the latest, not a best
            latest_only = callback.monitor is None
            best = "" if latest_only else callback.best_model_path
            last = callback.best_model_path if latest_only else callback.last_model_path
            wanted = [("best", best if self.upload_best else ""), ("last", last if self.upload_last else "")]
            for kind, path in wanted:
                if path:
                    new |= self._offer(Path(path), slot=f"{kind}:{index}", kind=kind)
        if new or retry:
            self._retry_failed()

    def _offer(self, path: Path, slot: str, kind: str) -> bool:
        sig = signature(path)
        if sig is None or self._queued.get(path) == sig:
            return False
        if path.is_dir() and not sharded_complete(path):
            log.warning(
                "S3: %s lacks shards listed in its .metadata (no shared filesystem?); not uploaded", path
            )
            return False
        assert self._worker is not None
        self._queued[path] = sig
        self._worker.submit(UploadJob(path, self._uri_for(path, kind), slot, sig, kind))
        return True

    def _retry_failed(self) -> None:
        assert self._runner is not None and self._worker is not None
        for job in self._runner.failed_jobs():
            sig = signature(job.local)
            if sig is not None:  # else superseded: ModelCheckpoint removed it
                self._worker.submit(UploadJob(job.local, job.uri, job.slot, sig, job.kind))

    def _wait(self, timeout: float | None = None) -> None:
        if self._worker is None:
            return
        timeout = self.wait_timeout if timeout is None else timeout
        if self._worker.pending:
            log.info("S3: waiting for %d upload(s) to finish", self._worker.pending)
        if not self._worker.wait(timeout):
            log.error(
                "S3: uploads still running after %.0f s; giving up on them (local files are kept)", timeout
            )

    def _must_stop(self, trainer: L.Trainer) -> bool:
        stop = bool(self.failures) and trainer.is_global_zero
        if trainer.world_size > 1:
            stop = bool(trainer.strategy.broadcast(stop, src=0))
        if stop and not self._stop_requested:
            self._stop_requested = True
            log.error("S3: stopping training because an upload failed and fatal=true")
        return stop

    def _fatal_message(self) -> str:
        return "; ".join(self.failures) or "S3 upload failed on rank zero (fatal=true)"

    def _report(self) -> None:
        if self.base is None:
            return
        lines = [f"  {uri}" for uri in self.uploaded]
        log.info("S3: %d object(s) under %s/:\n%s", len(lines), self.base, "\n".join(lines) or "  (none)")
        for message in self.failures:
            log.error("S3: NOT uploaded: %s", message)


def _logger_dirs(trainer: L.Trainer) -> list[Path]:
    """Existing, flushed log dirs of the trainer's loggers."""
    dirs: list[Path] = []
    for logger in trainer.loggers:
        log_dir = getattr(logger, "log_dir", None)
        if not log_dir or not os.path.isdir(log_dir):
            continue
        try:
            logger.save()  # TensorBoard: flush event files; CSV: write metrics.csv
        except Exception as err:
            log.debug("S3: could not flush logger %s: %s", type(logger).__name__, err)
        path = Path(log_dir).resolve()
        if path not in dirs:
            dirs.append(path)
    return dirs
