"""S3 checkpoints against a real HTTP endpoint (moto server on 127.0.0.1): upload, verify, fetch, failures."""

import json
import logging
import os
import socket
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import boto3
import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from moto.server import ThreadedMotoServer
from omegaconf import OmegaConf
from torch.optim.optimizer import register_optimizer_step_pre_hook

from vitrain.callbacks.s3_upload import S3CheckpointUpload
from vitrain.callbacks.upload_jobs import UploadRunner
from vitrain.callbacks.upload_queue import UploadJob, sharded_complete, signature
from vitrain.errors import UserError
from vitrain.s3 import store as store_module
from vitrain.s3.client import MiB, S3Options, S3Uri, make_client, parse_s3_uri
from vitrain.s3.digest import file_digest
from vitrain.s3.errors import (
    S3BucketNotFound,
    S3CredentialsError,
    S3EndpointError,
    S3Error,
    S3ObjectNotFound,
    S3VerifyError,
)
from vitrain.s3.store import SAVE_MANIFEST, S3Store, fetch_checkpoint
from vitrain.utils.secrets import (
    REDACTED,
    SECRET_ENV_VARS,
    SecretFilter,
    find_secrets,
    install_secret_filter,
    redact,
    scrub,
)


def _client(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint)


def _keys(endpoint: str, bucket: str) -> list[str]:
    listing = _client(endpoint).list_objects_v2(Bucket=bucket)
    return sorted(o["Key"] for o in listing.get("Contents", []))


def _body(endpoint: str, bucket: str, key: str) -> bytes:
    return _client(endpoint).get_object(Bucket=bucket, Key=key)["Body"].read()


def _save_dir(endpoint: str, bucket: str, prefix: str) -> str:
    """The subfolder of the save that a checkpoint folder's manifest names."""
    return json.loads(_body(endpoint, bucket, f"{prefix}/{SAVE_MANIFEST}"))["save"]


def _folder_keys(endpoint: str, bucket: str, prefix: str) -> list[str]:
    """The keys under `prefix/`, relative to it, with the manifest's save subfolder written `SAVE`."""
    save = _save_dir(endpoint, bucket, prefix)
    keys = [k[len(prefix) + 1 :] for k in _keys(endpoint, bucket) if k.startswith(prefix + "/")]
    return sorted(k.replace(f"{save}/", "SAVE/", 1) if k.startswith(f"{save}/") else k for k in keys)


@contextmanager
def moto_auth(endpoint: str) -> Iterator[None]:
    """Make the moto server check signatures: our fake keys are then unknown to it."""

    def reset(count: bytes) -> None:
        req = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=count, method="POST")
        req.add_header("Content-Type", "text/plain")
        urllib.request.urlopen(req, timeout=10).read()

    reset(b"0")
    try:
        yield
    finally:
        reset(b"inf")


class _Server:
    """A moto server of this test alone, to stop and restart (it shares the process' S3 state)."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server: ThreadedMotoServer | None = None

    def start(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server._server.server_close()  # stop() leaves the socket listening: requests would hang
            self._server = None


@pytest.fixture
def private_server(s3_env: str) -> Iterator[_Server]:
    server = _Server()
    server.start()
    yield server
    server.stop()


def _free_port_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed on exit: nothing listens there


# --- URIs, digests, secrets ------------------------------------------------------------------------------------


def test_parse_s3_uri():
    assert parse_s3_uri("s3://my-bucket/runs/a/b.ckpt") == S3Uri("my-bucket", "runs/a/b.ckpt")
    assert parse_s3_uri("s3://my-bucket") == S3Uri("my-bucket", "")
    assert str(S3Uri("b1b", "x").child("/y/", "z.ckpt")) == "s3://b1b/x/y/z.ckpt"
    for bad in ("my-bucket/key", "s3://", "s3://UPPER/key", "http://bucket/key"):
        with pytest.raises(UserError):
            parse_s3_uri(bad)


def test_file_digest_matches_s3_etag_rules(tmp_path: Path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * (11 * MiB))
    single = file_digest(path, multipart_threshold=64 * MiB, multipart_chunksize=5 * MiB)
    assert "-" not in single.etag and len(single.etag) == 32
    multi = file_digest(path, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    assert multi.etag.endswith("-3") and multi.sha256 == single.sha256 and multi.size == 11 * MiB


def test_redact_and_scrub(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sEcReT-value-123456")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE000000001")
    assert {"AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN"} <= set(SECRET_ENV_VARS)
    cfg = OmegaConf.create(
        {
            "s3": {
                "bucket": "b",
                "aws_secret_access_key": "${oc.env:AWS_SECRET_ACCESS_KEY}",
                "tokenizer": "bpe",
            },
            "net": {"class_token": False, "pin_token": 123456, "hub_token": "hf_abcdef", "api_key": ["k1"]},
            "note": "key AKIAEXAMPLE000000001 leaked",
            "endpoint": "http://minio:minio-password@host:9000",
            "list": ["sEcReT-value-123456", 3],
        }
    )
    clean = redact(cfg, resolve=True)
    text = OmegaConf.to_yaml(clean)
    assert find_secrets(OmegaConf.to_yaml(cfg, resolve=True)) == [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
    ]
    assert find_secrets(text) == [] and "minio-password" not in text
    assert clean.s3.aws_secret_access_key == REDACTED and clean.s3.tokenizer == "bpe" and clean.list[1] == 3
    # a flag under a secret-sounding key is kept (timm's class_token: eval.py rebuilds the model from it);
    # numbers, text and containers there are masked whole
    assert clean.net == {
        "class_token": False,
        "pin_token": REDACTED,
        "hub_token": REDACTED,
        "api_key": REDACTED,
    }
    assert scrub("AKIAEXAMPLE000000001/x") == f"{REDACTED}/x"

    record = logging.LogRecord(
        "botocore", logging.DEBUG, __file__, 1, "Credential=%s/2025", ("AKIAEXAMPLE000000001",), None
    )
    assert SecretFilter().filter(record) and "AKIAEXAMPLE" not in record.getMessage()
    handler = logging.NullHandler()
    install_secret_filter([handler])
    install_secret_filter([handler])
    assert len(handler.filters) == 1


# --- S3Store against the server ------------------------------------------------------------------------------


def test_upload_single_and_multipart_verified(s3_bucket: str, s3_env: str, tmp_path: Path):
    store = S3Store(S3Options(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB))
    small, big = tmp_path / "small.ckpt", tmp_path / "big.ckpt"
    small.write_bytes(os.urandom(1000))
    big.write_bytes(os.urandom(11 * MiB + 7))  # 3 parts
    for path in (small, big):
        up = store.upload_file(path, S3Uri(s3_bucket, f"x/{path.name}"))
        assert _body(s3_env, s3_bucket, up.uri.key) == path.read_bytes()
        head = _client(s3_env).head_object(Bucket=s3_bucket, Key=up.uri.key)
        assert head["Metadata"]["sha256"] == up.sha256
    assert head["ETag"].strip('"').endswith("-3")  # really multipart, and our ETag check agreed


def test_fetch_file_is_verified_and_cached_by_etag(s3_bucket: str, s3_env: str, tmp_path: Path):
    store = S3Store()
    src = tmp_path / "model.ckpt"
    src.write_bytes(b"v1" * 1000)
    store.upload_file(src, S3Uri(s3_bucket, "runs/r/model.ckpt"))
    cache = tmp_path / "cache"
    first = fetch_checkpoint(f"s3://{s3_bucket}/runs/r/model.ckpt", cache)
    assert first.read_bytes() == src.read_bytes() and first.name == "model.ckpt"
    mtime = first.stat().st_mtime_ns
    assert fetch_checkpoint(f"s3://{s3_bucket}/runs/r/model.ckpt", cache) == first
    assert first.stat().st_mtime_ns == mtime  # served from the cache

    src.write_bytes(b"v2" * 1000)  # re-uploaded: new ETag, new cache entry
    store.upload_file(src, S3Uri(s3_bucket, "runs/r/model.ckpt"))
    second = fetch_checkpoint(f"s3://{s3_bucket}/runs/r/model.ckpt", cache)
    assert second != first and second.read_bytes() == b"v2" * 1000


def test_fetch_rejects_corrupt_object(s3_bucket: str, s3_env: str, tmp_path: Path):
    good = tmp_path / "good.ckpt"
    good.write_bytes(b"good bytes" * 100)
    sha = file_digest(good, 64 * MiB, 16 * MiB).sha256
    # bytes that differ from what the uploader hashed (a truncated or tampered object)
    _client(s3_env).put_object(
        Bucket=s3_bucket, Key="bad.ckpt", Body=b"evil bytes" * 100, Metadata={"sha256": sha}
    )
    with pytest.raises(S3VerifyError, match="sha256"):
        fetch_checkpoint(f"s3://{s3_bucket}/bad.ckpt", tmp_path / "cache")
    # nothing unverified is cached (an empty lock file may stay)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.suffix != ".lock"]
    with pytest.raises(S3ObjectNotFound):
        fetch_checkpoint(f"s3://{s3_bucket}/missing.ckpt", tmp_path / "cache")


def test_sharded_folder_upload_and_fetch(s3_bucket: str, s3_env: str, tmp_path: Path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "epoch=1.ckpt"
    dcp.save({"w": torch.randn(8, 8), "b": torch.randn(8)}, checkpoint_id=str(folder))
    torch.save({"epoch": 1}, folder / "meta.pt")
    assert sharded_complete(folder)
    S3Store().upload_tree(folder, S3Uri(s3_bucket, "runs/r/checkpoints/epoch=1.ckpt"))

    local = fetch_checkpoint(f"s3://{s3_bucket}/runs/r/checkpoints/epoch=1.ckpt", tmp_path / "cache")
    assert local.is_dir() and local.name == "epoch=1.ckpt"
    assert {p.name for p in local.iterdir()} == {p.name for p in folder.iterdir()}
    for path in folder.iterdir():
        assert (local / path.name).read_bytes() == path.read_bytes()

    shard = next(folder.glob("*.distcp"))
    shard.unlink()  # another node's shard, on a filesystem rank zero does not see
    assert not sharded_complete(folder)


def _meeting(original: Callable[..., Any], parties: int = 3) -> tuple[Callable[..., Any], dict[str, int]]:
    """`original` (a method) whose first `parties` calls wait for each other before going on: made one at a
    time, the first waits in vain and the barrier breaks. `seen["most"]`: the most calls in flight at once."""
    import itertools
    import threading

    met, calls, lock = threading.Barrier(parties, timeout=10), itertools.count(), threading.Lock()
    seen = {"in_flight": 0, "most": 0}

    def meeting(*args: Any, **kwargs: Any) -> Any:
        with lock:
            seen["in_flight"] += 1
            seen["most"] = max(seen["most"], seen["in_flight"])
        try:
            if next(calls) < parties:
                met.wait()
            return original(*args, **kwargs)
        finally:
            with lock:
                seen["in_flight"] -= 1

    return meeting, seen


def test_a_folder_of_many_objects_is_read_several_at_once(
    s3_bucket: str, s3_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A prefix of photos is read `parallel_files` objects at once (their heads, then their downloads), each
    verified; one corrupt object fails the fetch naming it, and nothing of the folder is cached."""
    client = _client(s3_env)
    bodies = {f"photos/{i:03d}.jpg": os.urandom(2000 + i) for i in range(24)}
    for key, body in bodies.items():
        client.put_object(Bucket=s3_bucket, Key=key, Body=body)
    original = S3Store._download_verified
    meeting, seen = _meeting(original)
    monkeypatch.setattr(S3Store, "_download_verified", meeting)
    store = S3Store(S3Options(parallel_files=4))
    local = store.fetch(S3Uri(s3_bucket, "photos"), tmp_path / "cache")
    assert sorted(p.name for p in local.iterdir()) == [k.split("/")[1] for k in sorted(bodies)]
    assert all((local / k.split("/")[1]).read_bytes() == body for k, body in bodies.items())
    assert 3 <= seen["most"] <= 4

    monkeypatch.setattr(S3Store, "_download_verified", original)
    sha = file_digest(local / "005.jpg", 64 * MiB, 16 * MiB).sha256
    client.put_object(Bucket=s3_bucket, Key="photos/005.jpg", Body=b"other bytes", Metadata={"sha256": sha})
    with pytest.raises(S3VerifyError, match=r"photos/005\.jpg .*sha256"):
        store.fetch(S3Uri(s3_bucket, "photos"), tmp_path / "cache2")
    assert not [p for p in (tmp_path / "cache2").rglob("*") if p.is_file() and p.suffix != ".lock"]


def test_a_folder_goes_up_several_files_at_once(
    s3_bucket: str, s3_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A folder's files (a sharded checkpoint's, `make shards`') are uploaded `parallel_files` at once, each
    verified; the results in the order of the names, and the save reads back whole."""
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    names = [f"__{i}_0.distcp" for i in range(12)] + [".metadata", "meta.pt"]
    for i, name in enumerate(names):
        (folder / name).write_bytes(os.urandom(1000 + i))
    meeting, seen = _meeting(S3Store.upload_file)
    monkeypatch.setattr(S3Store, "upload_file", meeting)
    uri = S3Uri(s3_bucket, "runs/r/checkpoints/last.ckpt")
    uploads = S3Store(S3Options(parallel_files=4)).upload_save(folder, uri, names)
    assert [up.local.name for up in uploads] == [*names, SAVE_MANIFEST]
    assert 3 <= seen["most"] <= 4
    local = S3Store().fetch(uri, tmp_path / "cache")
    assert {p.name: p.read_bytes() for p in local.iterdir()} == {n: (folder / n).read_bytes() for n in names}


def test_folder_upload_mirrors_the_save_offered(s3_bucket: str, s3_env: str, tmp_path: Path):
    """A `last.ckpt` folder rewritten in place: an upload takes only the files of the save it was offered (not
    DCP's `.metadata.tmp` of a save in progress), and the finished upload leaves no older file under the
    prefix, which every resume would download with it (a flaky CI run fetched 5 files for a 4-file folder)."""
    import torch.distributed.checkpoint as dcp

    folder, prefix = tmp_path / "last.ckpt", "runs/r/checkpoints/last.ckpt"
    dcp.save({"w": torch.randn(8, 8)}, checkpoint_id=str(folder))
    torch.save({"epoch": 1}, folder / "meta.pt")
    client = _client(s3_env)
    for stale in (".metadata.tmp", "__1_0.distcp"):  # an earlier upload's catch; a 2-rank save's shard
        client.put_object(Bucket=s3_bucket, Key=f"{prefix}/{stale}", Body=b"old")
    runner = UploadRunner(S3Store(), prune=True, fatal=False)
    local = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())

    def under_prefix() -> list[str]:
        return sorted(k[len(prefix) + 1 :] for k in _keys(s3_env, s3_bucket) if k.startswith(prefix + "/"))

    # offered, then a newer save starts writing before the worker gets to it
    job = UploadJob(folder, S3Uri(s3_bucket, prefix), "last:0", signature(folder), "last")
    (folder / ".metadata.tmp").write_bytes((folder / ".metadata").read_bytes())
    runner(job)
    assert ".metadata.tmp" in under_prefix()  # the stale one, untouched: the newer save's job mirrors
    assert SAVE_MANIFEST not in under_prefix()  # its files may be of two saves: no manifest names them
    assert runner.uploaded == [] and runner.failures == []  # superseded, not done and not failed
    (folder / ".metadata.tmp").replace(folder / ".metadata")  # the newer save completes

    runner(UploadJob(folder, S3Uri(s3_bucket, prefix), "last:0", signature(folder), "last"))
    # the save's files in a subfolder of their own, then the manifest naming it, last; nothing else
    assert _folder_keys(s3_env, s3_bucket, prefix) == sorted([*(f"SAVE/{n}" for n in local), SAVE_MANIFEST])
    assert len(runner.uploaded) == len(local) + 1 and runner.uploaded[-1].endswith(f"/{SAVE_MANIFEST}")
    fetched = fetch_checkpoint(f"s3://{s3_bucket}/{prefix}", tmp_path / "cache")
    assert sorted(p.relative_to(fetched).as_posix() for p in fetched.rglob("*") if p.is_file()) == local
    assert all((fetched / rel).read_bytes() == (folder / rel).read_bytes() for rel in local)


def test_a_folder_whose_newer_upload_was_cut_off_still_holds_the_older_save(
    s3_bucket: str, s3_env: str, tmp_path: Path
):
    """S3 has no rename: a newer save written over a folder's keys would replace its files one by one, and a
    machine lost midway would leave two saves' shards, which load silently mixed. Each save goes up into a
    subfolder of its own and the manifest naming it last: a cut-off upload leaves the older save whole and
    fetched; a folder whose named files changed after their upload is refused in one line."""
    import torch.distributed.checkpoint as dcp

    folder, prefix = tmp_path / "last.ckpt", "runs/r/checkpoints/last.ckpt"
    uri, url = S3Uri(s3_bucket, prefix), f"s3://{s3_bucket}/{prefix}"
    runner = UploadRunner(S3Store(), prune=True, fatal=False)

    def save(step: int) -> list[str]:
        dcp.save({"w": torch.full((8, 8), float(step))}, checkpoint_id=str(folder))
        torch.save({"global_step": step}, folder / "meta.pt")
        runner(UploadJob(folder, uri, "last:0", signature(folder), "last"))
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())

    def loaded(path: Path) -> tuple[float, int]:
        state = {"w": torch.zeros(8, 8)}
        dcp.load(state, checkpoint_id=str(path))
        assert state["w"].unique().numel() == 1
        return state["w"][0, 0].item(), torch.load(path / "meta.pt")["global_step"]

    def fetched_files(path: Path) -> list[str]:
        return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())

    real_upload = S3Store.upload_file

    def lost_after(files: int):
        """`S3Store.upload_file` on a machine lost after `files` uploads."""
        calls = []

        def upload(self: S3Store, path: Path, *args, **kwargs):
            calls.append(path)
            if len(calls) > files:
                raise ConnectionError("machine lost")
            return real_upload(self, path, *args, **kwargs)

        return mock.patch.object(S3Store, "upload_file", upload)

    # the first save's upload cut off: no whole save there yet, which a resume reads as nothing to resume
    with lost_after(1):
        save(0)
    assert len(runner.failures) == 1 and any(
        k.startswith(prefix + "/save-") for k in _keys(s3_env, s3_bucket)
    )
    with pytest.raises(S3ObjectNotFound, match=rf"no whole save at {url}/ yet: the upload of its first save"):
        fetch_checkpoint(url, tmp_path / "cache0")

    local = save(1)
    assert runner.failures == []
    save1 = _save_dir(s3_env, s3_bucket, prefix)
    # an object no save names (an older file that could not be deleted): left out of the fetched folder
    _client(s3_env).put_object(Bucket=s3_bucket, Key=f"{prefix}/__1_0.distcp", Body=b"other world size")
    fetched = fetch_checkpoint(url, tmp_path / "cache1")
    assert fetched_files(fetched) == local and loaded(fetched) == (1.0, 1)

    # the next save's upload is cut off after its first file (the machine is lost): save 1 is still whole
    with lost_after(1):
        save(2)
    assert len(runner.failures) == 1
    keys = _keys(s3_env, s3_bucket)
    assert len([k for k in keys if k.startswith(prefix + "/save-") and f"/{save1}/" not in k]) == 1
    assert _save_dir(s3_env, s3_bucket, prefix) == save1
    fetched = fetch_checkpoint(url, tmp_path / "cache2")
    assert fetched_files(fetched) == local and loaded(fetched) == (1.0, 1)

    save(3)  # a whole upload: the manifest names save 3, and save 1 and the cut-off files are deleted
    assert _folder_keys(s3_env, s3_bucket, prefix) == sorted([*(f"SAVE/{n}" for n in local), SAVE_MANIFEST])
    up = _save_dir(s3_env, s3_bucket, prefix)  # what the report lists: save 3's files, not the deleted ones
    assert runner.uploaded == [*(f"{url}/{up}/{n}" for n in local), f"{url}/{SAVE_MANIFEST}"]
    assert loaded(fetch_checkpoint(url, tmp_path / "cache3")) == (3.0, 3)

    # a file of the named save replaced after its upload (by hand, another tool): refused, nothing cached
    shard = next(name for name in local if name.endswith(".distcp"))
    save3 = _save_dir(s3_env, s3_bucket, prefix)
    S3Store().upload_file(folder / "meta.pt", uri.child(save3, shard))
    with pytest.raises(
        S3VerifyError, match=rf"{prefix}/ is not one whole save: {save3}/{shard} is not the file"
    ):
        fetch_checkpoint(url, tmp_path / "cache4")
    assert not [p for p in (tmp_path / "cache4").rglob("*") if p.is_file() and p.suffix != ".lock"]

    # the previous version's layout (the files at the folder's top, a manifest without `save`) still loads
    old = S3Uri(s3_bucket, "runs/old/checkpoints/last.ckpt")
    ups = S3Store().upload_tree(folder, old, local)
    manifest = {"files": {name: up.sha256 for name, up in zip(local, ups, strict=True)}}
    _client(s3_env).put_object(Bucket=s3_bucket, Key=f"{old.key}/{SAVE_MANIFEST}", Body=json.dumps(manifest))
    assert loaded(fetch_checkpoint(f"s3://{old.bucket}/{old.key}", tmp_path / "cache5")) == (3.0, 3)


def test_a_checkpoint_read_while_a_newer_save_replaces_it_is_read_again(
    s3_bucket: str, s3_env: str, tmp_path: Path, caplog
):
    """eval.py (or a resume on another machine) lists a checkpoint folder; the training run's upload worker then
    puts the next save up and deletes the listed one. The read starts again on the newer save: before, it ended
    in a one-line "not found" (which `resume=auto` would read as nothing to resume). A folder that fails the
    same way without changing is refused as before."""
    import threading

    import torch.distributed.checkpoint as dcp

    folder, prefix = tmp_path / "last.ckpt", "runs/r/checkpoints/last.ckpt"
    uri, url = S3Uri(s3_bucket, prefix), f"s3://{s3_bucket}/{prefix}"
    runner = UploadRunner(S3Store(), prune=True, fatal=False)

    def save(step: int) -> None:
        dcp.save({"w": torch.full((8, 8), float(step))}, checkpoint_id=str(folder))
        torch.save({"global_step": step}, folder / "meta.pt")
        runner(UploadJob(folder, uri, "last:0", signature(folder), "last"))

    save(1)
    save1 = _save_dir(s3_env, s3_bucket, prefix)
    real = S3Store._download_verified
    downloads: list[str] = []
    first = threading.Lock()  # the folder's files are read several at once

    def download(self: S3Store, source: S3Uri, *args, **kwargs):
        with first:
            # between the listing and the first download: the run's next save, save 1 deleted
            if not downloads:
                save(2)
            downloads.append(source.key)
        return real(self, source, *args, **kwargs)

    with mock.patch.object(S3Store, "_download_verified", download), caplog.at_level(logging.INFO):
        fetched = fetch_checkpoint(url, tmp_path / "cache")
    state = {"w": torch.zeros(8, 8)}
    dcp.load(state, checkpoint_id=str(fetched))
    assert state["w"].unique().tolist() == [2.0] and torch.load(fetched / "meta.pt")["global_step"] == 2
    # the first read (its downloads in flight when save 1 went) ended whole before the second began
    files = len(list(fetched.iterdir()))
    assert f"/{save1}/" in downloads[0] and all(f"/{save1}/" not in key for key in downloads[-files:])
    assert [r for r in caplog.records if "changed while it was read" in r.getMessage()]
    assert runner.failures == []

    # a file of the named save deleted by hand: the folder read again is the same, so it is refused
    save2 = _save_dir(s3_env, s3_bucket, prefix)
    _client(s3_env).delete_object(Bucket=s3_bucket, Key=f"{prefix}/{save2}/meta.pt")
    with pytest.raises(S3VerifyError, match=rf"not one whole save: {save2}/meta.pt is missing"):
        fetch_checkpoint(url, tmp_path / "cache2")

    # a checkpoint file (not sharded) replaced by the run's next upload while it was downloaded
    ckpt, key = tmp_path / "best.ckpt", "runs/r/checkpoints/best.ckpt"
    store = S3Store()
    torch.save({"global_step": 1}, ckpt)
    store.upload_file(ckpt, S3Uri(s3_bucket, key))
    downloads.clear()

    def replaced(self: S3Store, source: S3Uri, head: dict, dest: Path):
        if not downloads:
            torch.save({"global_step": 2, "pad": torch.zeros(64)}, ckpt)
            store.upload_file(ckpt, S3Uri(s3_bucket, key))
        downloads.append(head["ETag"])
        return real(self, source, head, dest)

    with mock.patch.object(S3Store, "_download_verified", replaced):
        fetched = fetch_checkpoint(f"s3://{s3_bucket}/{key}", tmp_path / "cache3")
    assert torch.load(fetched)["global_step"] == 2 and len(set(downloads)) == 2


def test_replaced_sharded_best_is_deleted_whole(s3_bucket: str, s3_env: str, tmp_path: Path):
    """save_top_k replaces a sharded best: every object under its prefix goes, not only one of its files."""
    import shutil

    import torch.distributed.checkpoint as dcp

    runner, base = UploadRunner(S3Store(), prune=True, fatal=False), "runs/r/checkpoints"
    for epoch in (0, 1):
        folder = tmp_path / f"epoch{epoch}.ckpt"
        dcp.save({"w": torch.randn(8, 8)}, checkpoint_id=str(folder))
        torch.save({"epoch": epoch}, folder / "meta.pt")
        if epoch == 1:
            shutil.rmtree(tmp_path / "epoch0.ckpt")  # ModelCheckpoint removes the replaced best
        runner(
            UploadJob(folder, S3Uri(s3_bucket, f"{base}/{folder.name}"), "best:0", signature(folder), "best")
        )
    keys = _keys(s3_env, s3_bucket)
    assert not [k for k in keys if k.startswith(f"{base}/epoch0.ckpt/")], keys
    assert _folder_keys(s3_env, s3_bucket, f"{base}/epoch1.ckpt") == sorted(
        [*(f"SAVE/{p.name}" for p in folder.iterdir()), SAVE_MANIFEST]
    )
    assert all("/epoch1.ckpt/" in uri for uri in runner.uploaded) and runner.failures == []


def test_best_folder_removed_while_uploading_leaves_nothing(
    s3_bucket: str, s3_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """save_top_k removes a best folder while its files go up: the files already up are deleted too."""
    import shutil

    import torch.distributed.checkpoint as dcp

    folder, prefix = tmp_path / "epoch0.ckpt", "runs/r/checkpoints/epoch0.ckpt"
    dcp.save({"w": torch.randn(8, 8)}, checkpoint_id=str(folder))
    torch.save({"epoch": 0}, folder / "meta.pt")
    job = UploadJob(folder, S3Uri(s3_bucket, prefix), "best:0", signature(folder), "best")
    original = S3Store.upload_file

    def then_removed(self, path, uri, digest=None):  # ModelCheckpoint's rmtree after the first file
        up = original(self, path, uri, digest)
        shutil.rmtree(folder)
        return up

    monkeypatch.setattr(S3Store, "upload_file", then_removed)
    runner = UploadRunner(S3Store(), prune=True, fatal=False)
    runner(job)
    assert not [k for k in _keys(s3_env, s3_bucket) if k.startswith(prefix)]
    assert runner.uploaded == [] and runner.failures == []


def test_fsdp_folder_fetched_by_concurrent_ranks_downloads_once(
    s3_bucket: str, s3_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Ranks that torchrun/SLURM start together fetch the same folder at once: one download per file."""
    import threading

    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "last.ckpt"
    dcp.save({"w": torch.randn(8, 8)}, checkpoint_id=str(folder))
    torch.save({"epoch": 1}, folder / "meta.pt")
    S3Store().upload_tree(folder, S3Uri(s3_bucket, "runs/r/checkpoints/last.ckpt"))
    files = len([p for p in folder.rglob("*") if p.is_file()])

    downloads: list[str] = []
    original = S3Store._download_verified

    def slow_first(self, uri, head, dest):  # the first download lasts long enough for the other rank to start
        downloads.append(uri.key)
        if len(downloads) == 1:
            time.sleep(0.5)
        return original(self, uri, head, dest)

    monkeypatch.setattr(S3Store, "_download_verified", slow_first)
    start, results = threading.Barrier(2), []

    def rank() -> None:
        store = S3Store()
        start.wait()
        results.append(store.fetch(S3Uri(s3_bucket, "runs/r/checkpoints/last.ckpt"), tmp_path / "cache"))

    threads = [threading.Thread(target=rank) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 2 and results[0] == results[1] and len(downloads) == files
    assert all((results[0] / p.name).read_bytes() == p.read_bytes() for p in folder.iterdir())


def test_preflight_passes_and_leaves_no_marker(s3_bucket: str, s3_env: str):
    S3Store().preflight(S3Uri(s3_bucket, "runs/r"))
    assert _keys(s3_env, s3_bucket) == []


@pytest.mark.parametrize("case", ["no_bucket", "bad_credentials", "no_credentials", "unreachable"])
def test_preflight_errors_are_classified(
    case: str, s3_bucket: str, s3_env: str, monkeypatch: pytest.MonkeyPatch
):
    bucket, expected = s3_bucket, S3Error
    if case == "no_bucket":
        bucket, expected = "vitrain-no-such-bucket", S3BucketNotFound
    elif case == "no_credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        expected = S3CredentialsError
    elif case == "unreachable":
        monkeypatch.setenv("AWS_ENDPOINT_URL", _free_port_endpoint())
        expected = S3EndpointError
    # "fails in seconds" on any machine, counted rather than timed: the limits of each client made, and the
    # requests sent (retries included)
    limits, sent = [], []

    def counted(options: S3Options):
        client = make_client(options)
        limits.append((options.max_attempts, options.connect_timeout, options.read_timeout))
        client.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.url))
        return client

    monkeypatch.setattr(store_module, "make_client", counted)
    with moto_auth(s3_env) if case == "bad_credentials" else _nothing(), pytest.raises(expected) as info:
        S3Store().preflight(S3Uri(bucket, "runs/r"))
    if case == "bad_credentials":
        assert isinstance(info.value, S3CredentialsError) and "InvalidAccessKeyId" in str(info.value)
    # the preflight's own client (the last made): the request and at most 2 retries (botocore's max_attempts
    # counts the retries), each bounded: 5 s to connect, 20 s to read
    assert limits[-1] == (2, 5.0, 20.0) and len(sent) <= 1 + 2, (limits, sent)
    assert "\n" not in str(info.value) and find_secrets(str(info.value)) == []


@contextmanager
def _nothing() -> Iterator[None]:
    yield


# --- the callback with a real Trainer ------------------------------------------------------------------------


class _Tiny(L.LightningModule):
    """A linear model whose `val/score` rises every epoch: every epoch saves a new best."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.steps = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return self.layer(batch).sum()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val/score", float(self.current_epoch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=4)


def _wait_for_failure(upload: S3CheckpointUpload) -> None:
    # a guard, not a timing: it returns at the first failure (seconds, also on a loaded machine)
    deadline = time.monotonic() + 120
    while not upload.failures and time.monotonic() < deadline:
        time.sleep(0.05)
    assert upload.failures, "no upload failed while the server was down"


class _OnEpoch(Callback):
    """Runs `actions[epoch]` at the start of that training epoch (-1: at train start)."""

    def __init__(self, actions: dict) -> None:
        self.actions = actions

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if -1 in self.actions:
            self.actions[-1]()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch in self.actions:
            self.actions[trainer.current_epoch]()


def _fit(
    run_dir: Path, upload: S3CheckpointUpload, epochs: int = 3, extra: tuple = ()
) -> tuple[L.Trainer, _Tiny]:
    model = _Tiny()
    checkpoint = ModelCheckpoint(
        dirpath=run_dir / "checkpoints",
        filename="epoch{epoch}",
        auto_insert_metric_name=False,
        monitor="val/score",
        mode="max",
        save_top_k=1,
        save_last=True,
    )
    trainer = L.Trainer(
        default_root_dir=run_dir,
        max_epochs=epochs,
        accelerator="cpu",
        logger=TensorBoardLogger(run_dir, name="tensorboard", version=""),
        callbacks=[checkpoint, upload, *extra],  # ModelCheckpoint first: Lightning moves it last anyway
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model)
    return trainer, model


def _upload_cb(bucket: str, run_dir: Path, endpoint_url: str | None = None, **kwargs) -> S3CheckpointUpload:
    options = {"max_attempts": 2, "endpoint_url": endpoint_url}  # a plain mapping, as Hydra passes it
    return S3CheckpointUpload(bucket=bucket, prefix="runs", run_dir=str(run_dir), options=options, **kwargs)


@pytest.fixture
def upload_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Keys passed to S3Store.upload_file (a spy on our code; boto3 is untouched)."""
    calls: list[str] = []
    original = S3Store.upload_file

    def spy(self, path, uri, digest=None):
        calls.append(uri.key)
        return original(self, path, uri, digest)

    monkeypatch.setattr(S3Store, "upload_file", spy)
    return calls


def test_callback_uploads_each_checkpoint_once_and_prunes(
    s3_bucket: str, s3_env: str, tmp_path: Path, upload_calls
):
    run_dir = tmp_path / "run-1"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("model: tiny\n")
    upload = _upload_cb(s3_bucket, run_dir)
    trainer, _ = _fit(run_dir, upload)

    base = "runs/run-1"
    best = Path(trainer.checkpoint_callback.best_model_path)
    assert best.name == "epoch2.ckpt"
    keys = _keys(s3_env, s3_bucket)
    assert f"{base}/checkpoints/epoch2.ckpt" in keys and f"{base}/checkpoints/last.ckpt" in keys
    assert f"{base}/checkpoints/epoch0.ckpt" not in keys  # replaced bests are pruned
    assert f"{base}/.hydra/config.yaml" in keys
    assert any(k.startswith(f"{base}/tensorboard/events.out.tfevents") for k in keys)
    assert _body(s3_env, s3_bucket, f"{base}/checkpoints/epoch2.ckpt") == best.read_bytes()
    assert (
        _body(s3_env, s3_bucket, f"{base}/checkpoints/last.ckpt") == (best.parent / "last.ckpt").read_bytes()
    )
    assert upload_calls.count(f"{base}/checkpoints/epoch2.ckpt") == 1
    # rewritten every epoch; a queued older version is dropped when a newer one is saved
    assert 1 <= upload_calls.count(f"{base}/checkpoints/last.ckpt") <= 3
    assert upload.failures == [] and f"s3://{s3_bucket}/{base}/checkpoints/epoch2.ckpt" in upload.uploaded

    # later files (a report written after fit) go up on request; unchanged ones are not sent again
    (run_dir / "report.md").write_text(f"# report\nleaked: {os.environ['AWS_SECRET_ACCESS_KEY']}\n")
    before = len(upload_calls)
    upload.upload_run_files(trainer)
    assert _body(s3_env, s3_bucket, f"{base}/report.md") == b"# report\nleaked: ***\n"  # redacted copy
    assert upload_calls[before:].count(f"{base}/report.md") == 1
    assert not [k for k in upload_calls[before:] if "checkpoints" in k or ".hydra" in k]


def test_callback_survives_outage_and_retries(
    private_server: _Server, s3_bucket: str, tmp_path: Path, caplog
):
    """Server down from train start to epoch 2: errors logged, training goes on, everything up at the end."""
    upload = _upload_cb(s3_bucket, tmp_path / "run", endpoint_url=private_server.endpoint)

    # ModelCheckpoint saves at epoch end, after our hooks: epoch 0's files are queued during epoch 1
    def restart() -> None:
        _wait_for_failure(upload)
        private_server.start()

    stopper = _OnEpoch({-1: private_server.stop, 2: restart})
    with caplog.at_level(logging.INFO, logger="vitrain"):
        trainer, model = _fit(tmp_path / "run", upload, epochs=4, extra=(stopper,))
    assert trainer.current_epoch == 4 and model.steps == 8  # every epoch ran
    assert any("S3 upload failed" in r.message and "unreachable" in r.message for r in caplog.records)
    assert upload.failures == []  # retried at the next save, after the server came back
    keys = _keys(private_server.endpoint, s3_bucket)
    assert "runs/run/checkpoints/epoch3.ckpt" in keys and "runs/run/checkpoints/last.ckpt" in keys


@pytest.mark.parametrize("fatal", [False, True])
def test_callback_outage_until_the_end(
    fatal: bool, private_server: _Server, s3_bucket: str, tmp_path: Path, caplog
):
    upload = _upload_cb(s3_bucket, tmp_path / "run", endpoint_url=private_server.endpoint, fatal=fatal)

    # certain that the failure is known before epoch 2 ends
    stopper = _OnEpoch({-1: private_server.stop, 2: lambda: _wait_for_failure(upload)})
    with caplog.at_level(logging.INFO, logger="vitrain"):
        if fatal:
            with pytest.raises(S3Error, match="unreachable"):
                _fit(tmp_path / "run", upload, epochs=6, extra=(stopper,))
        else:
            trainer, _ = _fit(tmp_path / "run", upload, epochs=6, extra=(stopper,))
            assert trainer.current_epoch == 6
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["epoch"] == (2 if fatal else 5)  # intact; fatal stopped early
    assert any(r.levelno == logging.ERROR and "S3 upload failed" in r.message for r in caplog.records)
    assert any("NOT uploaded" in r.message for r in caplog.records)
    assert upload.failures


def test_callback_preflight_fails_before_training(s3_env: str, tmp_path: Path):
    upload = _upload_cb("vitrain-no-such-bucket", tmp_path / "run")
    model = _Tiny()
    trainer = L.Trainer(
        max_epochs=1, accelerator="cpu", logger=False, callbacks=[upload], enable_progress_bar=False
    )
    with pytest.raises(S3BucketNotFound, match="vitrain-no-such-bucket"):
        trainer.fit(model)
    assert model.steps == 0
    with pytest.raises(S3Error, match="no bucket is set"):
        L.Trainer(
            max_epochs=1, logger=False, callbacks=[_upload_cb(None, tmp_path)], enable_progress_bar=False
        ).fit(_Tiny())


def test_hydra_list_selection_adds_the_callback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from hydra.utils import instantiate

    from helpers import compose_cfg

    monkeypatch.setenv("S3_BUCKET", "from-env")
    cfg = compose_cfg("train", ["callbacks=[default,s3]"], tmp_path)
    assert {"model_checkpoint", "s3_upload"} <= set(cfg.callbacks)
    upload = instantiate(cfg.callbacks.s3_upload)
    assert isinstance(upload, S3CheckpointUpload) and upload.bucket == "from-env" and upload.prefix == "runs"
    assert upload.options.request_checksum_calculation == "when_required"
    assert upload.options.multipart_threshold == 64 * MiB  # `multipart_threshold_mb` in the config


def test_callback_options_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The client settings are one nested node: overridable there, a typo is an error."""
    from hydra.utils import instantiate

    from helpers import compose_cfg

    overrides = [
        "callbacks=[default,s3]",
        "callbacks.s3_upload.options.endpoint_url=http://minio:9000",
        "callbacks.s3_upload.options.multipart_chunksize_mb=8",
        "callbacks.s3_upload.options.verify_etag=false",
    ]
    upload = instantiate(compose_cfg("train", overrides, tmp_path).callbacks.s3_upload)
    assert upload.options == S3Options(
        endpoint_url="http://minio:9000", multipart_chunksize=8 * MiB, verify_etag=False
    )
    assert S3CheckpointUpload(bucket="b", options=upload.options).options is upload.options
    with pytest.raises(UserError, match=r"endpont_url; valid: .*endpoint_url"):
        S3CheckpointUpload(bucket="b", options={"endpont_url": "http://x"})


# --- end to end: the training and evaluation tasks --------------------------------------------------------------


def _train_overrides(tiny_cifar: Path, data_cache: Path) -> list[str]:
    from helpers import tiny_overrides

    return [
        *tiny_overrides(tiny_cifar, data_cache),
        "trainer.max_epochs=2",
        "callbacks=[default,s3]",
        "test=false",
    ]


@pytest.mark.slow
def test_train_uploads_best_once_and_eval_from_s3_matches_local(
    tmp_path: Path,
    tiny_cifar: Path,
    data_cache: Path,
    s3_bucket: str,
    s3_env: str,
    monkeypatch: pytest.MonkeyPatch,
    upload_calls: list[str],
):
    from helpers import compose_cfg
    from vitrain.tasks.evaluation import evaluate
    from vitrain.tasks.training import train

    monkeypatch.setenv("S3_BUCKET", s3_bucket)
    _, objects = train(compose_cfg("train", _train_overrides(tiny_cifar, data_cache), tmp_path / "run"))
    best = Path(objects.best_model_path)
    key = f"runs/run/checkpoints/{best.name}"
    assert upload_calls.count(key) == 1
    assert _body(s3_env, s3_bucket, key) == best.read_bytes()

    def evaluate_ckpt(ckpt: str, out: str) -> tuple[dict, dict]:
        overrides = [
            f"ckpt_path={ckpt}",
            "split=val",
            "trainer.accelerator=cpu",
            f"paths.cache_dir={tmp_path / 'cache'}",
        ]
        return evaluate(compose_cfg("eval", overrides, tmp_path / out))

    local, _ = evaluate_ckpt(str(best), "eval_local")
    remote, evaluated = evaluate_ckpt(f"s3://{s3_bucket}/{key}", "eval_s3")
    assert remote == local and "val/acc1" in remote
    assert evaluated.checkpoint_path.is_relative_to(tmp_path / "cache")


@pytest.mark.slow
def test_cli_run_uploads_run_files_and_leaks_no_secret(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, s3_bucket: str, s3_env: str
):
    from conftest import S3_TEST_ACCESS_KEY_ID, S3_TEST_SECRET_ACCESS_KEY
    from helpers import run_cli

    overrides = [o for o in _train_overrides(tiny_cifar, data_cache) if not o.startswith("extras.")]
    run_dir = tmp_path / "run"
    env = {name: os.environ[name] for name in os.environ if name.startswith("AWS_")}
    done = run_cli(
        "train.py",
        [*overrides, f"hydra.run.dir={run_dir}"],
        env={**env, "S3_BUCKET": s3_bucket, "S3_PREFIX": "team/exp"},
    )
    assert done.returncode == 0, done.stderr[-3000:]

    keys = _keys(s3_env, s3_bucket)
    base = "team/exp/run"
    for name in (
        ".hydra/config.yaml",
        ".hydra/overrides.yaml",
        "config_tree.log",
        "train.log",
        "checkpoints/last.ckpt",
    ):
        assert f"{base}/{name}" in keys, (name, keys)
    assert any(k.startswith(f"{base}/tensorboard/events.out.tfevents") for k in keys)
    best = next((run_dir / "checkpoints").glob("epoch*.ckpt"))
    assert (
        f"s3://{s3_bucket}/{base}/checkpoints/{best.name}" in done.stdout + done.stderr
    )  # the key is printed

    secrets = [S3_TEST_ACCESS_KEY_ID.encode(), S3_TEST_SECRET_ACCESS_KEY.encode()]
    output = (done.stdout + done.stderr).encode()
    for path in [p for p in run_dir.rglob("*") if p.is_file()]:  # config, hparams, logs, checkpoints, events
        data = path.read_bytes()
        assert not [s for s in secrets if s in data], path
    assert not [s for s in secrets if s in output]
    for key in keys:
        assert not [s for s in secrets if s in _body(s3_env, s3_bucket, key)], key


@pytest.mark.parametrize("case", ["no_bucket", "bad_credentials"])
def test_train_fails_before_training_with_one_line(
    case: str,
    tmp_path: Path,
    tiny_cifar: Path,
    data_cache: Path,
    s3_bucket: str,
    s3_env: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
):
    from helpers import compose_cfg
    from vitrain.tasks.harness import run_task
    from vitrain.tasks.training import train

    monkeypatch.setenv("S3_BUCKET", "vitrain-no-such-bucket" if case == "no_bucket" else s3_bucket)
    cfg = compose_cfg("train", _train_overrides(tiny_cifar, data_cache), tmp_path / "run")
    steps = []  # optimizer steps: none may run (counted, not timed: the same on a slow machine)
    hook = register_optimizer_step_pre_hook(lambda *_: steps.append(1))
    try:
        with (
            moto_auth(s3_env) if case == "bad_credentials" else _nothing(),
            pytest.raises(SystemExit) as info,
        ):
            run_task(train, cfg)
    finally:
        hook.remove()
    assert info.value.code == 2 and steps == []
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    expected = (
        "bucket does not exist" if case == "no_bucket" else "rejected the credentials (InvalidAccessKeyId)"
    )
    assert len(error) == 1 and expected in error[0], error
    assert not (tmp_path / "run" / "checkpoints").exists()  # failed before the first step


# --- distributed: only rank zero uploads; FSDP folders go up whole --------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_distributed_run_uploads_from_rank_zero_once(
    strategy: str, tmp_path: Path, tiny_cifar: Path, data_cache: Path, s3_bucket: str, s3_env: str
):
    from helpers import run_cli

    overrides = [
        *_train_overrides(tiny_cifar, data_cache),
        f"trainer={strategy}",
        "trainer.devices=2",
        "+trainer.limit_train_batches=3",
        "datamodule.val_size=9",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    env = {name: os.environ[name] for name in os.environ if name.startswith("AWS_")}
    done = run_cli("train.py", overrides, env={**env, "S3_BUCKET": s3_bucket}, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]

    best = next((tmp_path / "run" / "checkpoints").glob("epoch*"))
    prefix = f"runs/run/checkpoints/{best.name}"
    if strategy == "ddp":
        assert best.is_file() and output.count(f"S3: uploaded s3://{s3_bucket}/{prefix} ") == 1
        assert _body(s3_env, s3_bucket, prefix) == best.read_bytes()
        return
    # a folder of shards written by both ranks, uploaded whole by rank zero after the barrier
    local = sorted(p.relative_to(best).as_posix() for p in best.rglob("*") if p.is_file())
    assert best.is_dir() and {".metadata", "meta.pt"} <= set(local) and len(local) >= 4
    assert _folder_keys(s3_env, s3_bucket, prefix) == sorted([*(f"SAVE/{n}" for n in local), SAVE_MANIFEST])
    save = _save_dir(s3_env, s3_bucket, prefix)
    for rel in [*(f"{save}/{n}" for n in local), SAVE_MANIFEST]:
        assert output.count(f"S3: uploaded s3://{s3_bucket}/{prefix}/{rel} ") == 1
    fetched = fetch_checkpoint(f"s3://{s3_bucket}/{prefix}", tmp_path / "cache")
    assert all((fetched / rel).read_bytes() == (best / rel).read_bytes() for rel in local)
    # the report names each checkpoint folder once, as ckpt_path takes it, not the files inside
    report = (tmp_path / "run" / "report.md").read_text().splitlines()
    assert sorted(line for line in report if line.startswith("- S3: ")) == [
        f"- S3: `s3://{s3_bucket}/runs/run/checkpoints/{name}`" for name in sorted([best.name, "last.ckpt"])
    ]
    _resume_fsdp_folder_from_s3(overrides, env, tmp_path, s3_bucket, s3_env)


def _resume_fsdp_folder_from_s3(
    first: list[str], env: dict[str, str], tmp_path: Path, bucket: str, endpoint: str
) -> None:
    """A second FSDP x2 run on an empty disk resumes from the first run's `last` folder in the bucket."""
    from helpers import run_cli

    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    prefix = "runs/run/checkpoints/last.ckpt"
    uri = f"s3://{bucket}/{prefix}"
    cache, run_dir = tmp_path / "cache2", tmp_path / "run2"
    overrides = [
        *(o for o in first if not o.startswith(("trainer.max_epochs", "hydra.run.dir"))),
        "trainer.max_epochs=3",  # one more epoch
        f"ckpt_path={uri}",
        f"paths.cache_dir={cache}",
        f"hydra.run.dir={run_dir}",
    ]
    done = run_cli("train.py", overrides, env={**env, "S3_BUCKET": bucket}, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]

    # downloaded once (rank zero; rank one follows its decision), into the cache, every file verified
    local = sorted(p.relative_to(last).as_posix() for p in last.rglob("*") if p.is_file())
    assert output.count(f"S3: fetched {uri}/ ({len(local)} files) -> ") == 1, output[-4000:]
    (copy,) = [p.parent for p in cache.rglob(".metadata")]
    assert copy.is_relative_to(cache / "s3" / bucket) and copy.name == "last.ckpt"
    save = _save_dir(endpoint, bucket, prefix)
    for rel in local:
        head = _client(endpoint).head_object(Bucket=bucket, Key=f"{prefix}/{save}/{rel}")
        recorded = head["Metadata"]["sha256"]
        assert file_digest(copy / rel, MiB, MiB).sha256 == recorded  # what _download_verified checked
        assert (copy / rel).read_bytes() == (last / rel).read_bytes()
    assert f"Restored all states from the checkpoint at {copy}" in output, output[-4000:]

    before = torch.load(last / "meta.pt", weights_only=True)
    after = torch.load(run_dir / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=True)
    assert before["epoch"] == 1 and after["epoch"] == 2
    assert after["global_step"] == before["global_step"] + 3  # limit_train_batches=3: one epoch more


# --- resume from S3: a new machine with an empty disk -----------------------------------------------------------


@pytest.mark.slow
def test_resume_from_s3_on_an_empty_disk(
    tmp_path: Path,
    tiny_cifar: Path,
    data_cache: Path,
    s3_bucket: str,
    s3_env: str,
    mlflow_server: str,
    monkeypatch: pytest.MonkeyPatch,
):
    """resume=auto finds the run's `last` in the bucket when the local disk has none, and continues the
    run's MLflow run; ckpt_path=s3://... too, in a new run dir: a new MLflow run."""
    from helpers import compose_cfg, mlflow_runs
    from vitrain.tasks.training import train

    monkeypatch.setenv("S3_BUCKET", s3_bucket)
    monkeypatch.setenv("VITRAIN_RUN_ID", "spot-1")  # the relaunched job's name (SLURM, torchrun, by hand)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    experiment = f"test-s3-resume-{uuid.uuid4().hex[:8]}"
    base = [o for o in _train_overrides(tiny_cifar, data_cache) if not o.startswith("trainer.max_epochs")]
    base += ["logger=mlflow", f"logger.mlflow.experiment_name={experiment}"]
    base += ["trainer.plugins.0.background=true"]  # uploads follow the background writes

    def run(machine: str, *extra: str) -> dict:
        cfg = compose_cfg(
            "train",
            [*base, f"paths.cache_dir={tmp_path / machine / 'cache'}", *extra],
            tmp_path / machine / "run",
        )
        train(cfg)
        return torch.load(tmp_path / machine / "run" / "checkpoints" / "last.ckpt", weights_only=True)

    assert run("first", "trainer.max_epochs=1")["global_step"] == 28
    resumed = run("second", "trainer.max_epochs=2")  # nothing local: `last` comes from the bucket
    assert resumed["epoch"] == 1 and resumed["global_step"] == 2 * 28
    assert list((tmp_path / "second" / "cache" / "s3" / s3_bucket).rglob("last.ckpt")), (
        "downloaded into the cache"
    )
    [logged] = mlflow_runs(mlflow_server, experiment)  # the second machine continued the first's run
    assert logged["info"]["status"] == "FINISHED"
    assert {t["key"]: t["value"] for t in logged["data"]["tags"]}["resumed/trainer/max_epochs"] == "2"
    assert (tmp_path / "second" / "run" / "logger_runs.json").read_text() == (
        tmp_path / "first" / "run" / "logger_runs.json"
    ).read_text()

    monkeypatch.delenv("VITRAIN_RUN_ID")
    uri = f"s3://{s3_bucket}/runs/run/checkpoints/last.ckpt"
    again = run("third", f"ckpt_path={uri}", "trainer.max_epochs=3")
    assert again["epoch"] == 2 and again["global_step"] == 3 * 28
    assert len(mlflow_runs(mlflow_server, experiment)) == 2


@pytest.mark.parametrize("case", ["missing", "sha256", "changed"])
def test_ckpt_path_on_s3_that_is_missing_or_corrupt_stops_in_one_line(
    case: str,
    tmp_path: Path,
    tiny_cifar: Path,
    data_cache: Path,
    s3_bucket: str,
    s3_env: str,
    capsys: pytest.CaptureFixture,
):
    from helpers import compose_cfg, tiny_overrides
    from vitrain.tasks.harness import run_task
    from vitrain.tasks.training import train

    key = "runs/old/checkpoints/last.ckpt"
    if case == "sha256":  # uploaded with a sha256 that the bytes do not have (bit rot, a partial overwrite)
        _client(s3_env).put_object(
            Bucket=s3_bucket, Key=key, Body=b"not a checkpoint", Metadata={"sha256": "0" * 64}
        )
    if case == "changed":  # a folder whose manifest's file was replaced after the upload
        folder = tmp_path / "last.ckpt"
        folder.mkdir()
        (folder / "meta.pt").write_bytes(b"save 1")
        S3Store().upload_save(folder, S3Uri(s3_bucket, key), ["meta.pt"])
        (folder / "meta.pt").write_bytes(b"save 2")
        save = _save_dir(s3_env, s3_bucket, key)
        S3Store().upload_file(folder / "meta.pt", S3Uri(s3_bucket, f"{key}/{save}/meta.pt"))
    cache = tmp_path / "cache"
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        f"ckpt_path=s3://{s3_bucket}/{key}",
        f"paths.cache_dir={cache}",
    ]
    with pytest.raises(SystemExit) as info:
        run_task(train, compose_cfg("train", overrides, tmp_path / "run"))
    assert info.value.code == 2
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    expected = {
        "missing": "no object and no folder at",
        "sha256": "sha256",
        "changed": "is not one whole save",
    }[case]
    assert len(error) == 1 and expected in error[0] and key in error[0], error
    assert not [p for p in cache.rglob("*") if p.is_file() and p.suffix != ".lock"], (
        "nothing unverified is kept"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_weights_file_on_s3_is_fetched_once_into_the_cache(
    tmp_path: Path, tiny_cifar: Path, data_cache: Path, s3_bucket: str, s3_env: str
):
    """`model.weights_file=s3://...` (a checkpoint the upload callback put there) starts a run from those
    weights, fetched and verified into `paths.cache_dir` as `ckpt_path` is; the hyperparameters keep the URI."""
    import hydra
    import timm

    from helpers import compose_cfg, tiny_overrides
    from vitrain.tasks.build import build_model

    source = timm.create_model(
        "vit_tiny_patch16_224", num_classes=7, img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2
    )
    checkpoint = tmp_path / "last.ckpt"  # the layout of ours: the network under `net.` in `state_dict`
    torch.save({"state_dict": {f"net.{k}": v for k, v in source.state_dict().items()}}, checkpoint)
    uri = f"s3://{s3_bucket}/runs/old/checkpoints/last.ckpt"
    S3Store().upload_file(checkpoint, parse_s3_uri(uri))
    cache = tmp_path / "cache"
    overrides = [*tiny_overrides(tiny_cifar, data_cache), f"model.weights_file={uri}"]
    cfg = compose_cfg("train", [*overrides, f"paths.cache_dir={cache}"], tmp_path / "run")
    datamodule = hydra.utils.instantiate(cfg.datamodule)
    for _ in range(2):  # the second from the cache
        model = build_model(cfg, datamodule)
        assert model.net.head.out_features == len(datamodule.classes) == 10
        assert torch.equal(model.net.blocks[1].attn.qkv.weight, source.blocks[1].attn.qkv.weight)
        assert model.hparams.weights_file == uri and cfg.model.weights_file == uri
    assert [p.read_bytes() for p in cache.rglob("last.ckpt") if p.is_file()] == [checkpoint.read_bytes()]

    cfg.model.weights_file = f"s3://{s3_bucket}/runs/old/checkpoints/best.ckpt"
    with pytest.raises(S3ObjectNotFound, match=r"runs/old/checkpoints/best\.ckpt"):
        build_model(cfg, datamodule)
