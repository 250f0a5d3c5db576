"""S3 (and S3-compatible: MinIO, R2, Ceph) storage for checkpoints and run files.

Every transfer is verified against the local bytes, because a checkpoint that silently differs from what
was trained is worse than none. Credentials come from the usual AWS chain (env, profile, instance role);
nothing here reads or stores them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError,
    CredentialRetrievalError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
)
from filelock import FileLock
from s3transfer.utils import ChunksizeAdjuster

from vitrain.errors import UserError
from vitrain.utils.secrets import scrub

log = logging.getLogger(__name__)

MiB = 1024**2
SHA256_META = "sha256"  # object metadata key (sent as x-amz-meta-sha256)
_HASH_BLOCK = 4 * MiB


class S3Error(UserError):
    """S3 could not be used; the message names the bucket/endpoint and what to check."""


class S3EndpointError(S3Error):
    """The endpoint did not answer (network, DNS, wrong AWS_ENDPOINT_URL, outage)."""


class S3CredentialsError(S3Error):
    """No credentials were found, or the store rejected them."""


class S3AccessDenied(S3Error):
    """Valid credentials without permission for this bucket or key."""


class S3BucketNotFound(S3Error):
    """The bucket does not exist at this endpoint."""


class S3ObjectNotFound(S3Error):
    """Neither an object nor a prefix exists at the given URI."""


class S3VerifyError(S3Error):
    """Stored bytes differ from the local file (size or checksum)."""


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    key: str = ""

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def child(self, *parts: str) -> S3Uri:
        segments = [p.strip("/") for p in (self.key, *parts) if p and p.strip("/")]
        return S3Uri(self.bucket, "/".join(segments))


def is_s3_uri(value: object) -> bool:
    return isinstance(value, str) and value.startswith("s3://")


def parse_s3_uri(uri: str) -> S3Uri:
    """`s3://bucket/some/key` -> S3Uri; a bucket alone is allowed (key "")."""
    match = re.fullmatch(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?", uri.strip())
    if not match:
        raise UserError(f"not an S3 URI: {uri!r} (expected s3://<bucket>/<key>, lower-case bucket name)")
    return S3Uri(match.group(1), match.group(2) or "")


@dataclass(frozen=True)
class S3Options:
    """Client and transfer settings. `None` means "let boto3 decide" (env vars, ~/.aws/config)."""

    endpoint_url: str | None = None  # None: boto3 reads AWS_ENDPOINT_URL(_S3) itself
    region: str | None = None
    profile: str | None = None
    max_attempts: int = 5  # botocore "standard" retry mode: throttling, 5xx and connection errors
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    # Recent boto3 sends CRC32 trailers by default, which several S3-compatible stores reject.
    request_checksum_calculation: str = "when_required"
    response_checksum_validation: str = "when_required"
    multipart_threshold: int = 64 * MiB
    multipart_chunksize: int = 16 * MiB
    max_concurrency: int = 4
    # Compare the ETag with the locally computed MD5 (multipart: MD5 of part MD5s). Turn off for stores whose
    # ETag is not an MD5 (SSE-KMS on AWS, some gateways); size and the sha256 metadata are still checked.
    verify_etag: bool = True

    @classmethod
    def from_config(cls, values: S3Options | Mapping[str, Any] | None) -> S3Options:
        """From a config node (plain data, sizes as `*_mb` in MiB); an unknown key is an error, not ignored."""
        if isinstance(values, S3Options):
            return values
        kwargs = dict(values or {})
        for name in ("multipart_threshold", "multipart_chunksize"):
            if f"{name}_mb" in kwargs:
                kwargs[name] = int(kwargs.pop(f"{name}_mb") * MiB)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            valid = ", ".join(sorted(known - {"multipart_threshold", "multipart_chunksize"}))
            raise UserError(
                f"unknown S3 option(s) {', '.join(unknown)}; valid: {valid}, multipart_threshold_mb, "
                "multipart_chunksize_mb"
            )
        return cls(**kwargs)


def make_client(options: S3Options) -> Any:
    session = (
        boto3.session.Session(profile_name=options.profile) if options.profile else boto3.session.Session()
    )
    config = Config(
        retries={"mode": "standard", "max_attempts": options.max_attempts},
        connect_timeout=options.connect_timeout,
        read_timeout=options.read_timeout,
        request_checksum_calculation=options.request_checksum_calculation,
        response_checksum_validation=options.response_checksum_validation,
    )
    return session.client(
        "s3", endpoint_url=options.endpoint_url or None, region_name=options.region, config=config
    )


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
            raise _classify(exc, "creating the client", self.options.endpoint_url or "(default)") from None
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
        return _classify(exc, doing, self.endpoint)

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

    def upload_tree(self, folder: Path, uri: S3Uri) -> list[Uploaded]:
        """Every file below `folder`, keyed by its relative path (a sharded checkpoint, a log dir)."""
        return [
            self.upload_file(path, uri.child(path.relative_to(folder).as_posix())) for path in _files(folder)
        ]

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
        try:
            head = self.client.head_object(Bucket=uri.bucket, Key=uri.key)
        except ClientError as exc:
            if _code(exc) not in {"404", "NoSuchKey", "NotFound"}:
                raise self.error(exc, f"reading {uri}") from exc
            return self._fetch_prefix(uri, cache_dir / uri.bucket / rel)
        except Exception as exc:
            raise self.error(exc, f"reading {uri}") from exc

        target = cache_dir / uri.bucket / rel / _etag_dir(head["ETag"]) / rel.name
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

    def _fetch_prefix(self, uri: S3Uri, base: Path) -> Path:
        prefix = uri.key.rstrip("/") + "/"
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=uri.bucket, Prefix=prefix)
            listing = sorted(
                (o["Key"], o["ETag"], o["Size"]) for page in pages for o in page.get("Contents", [])
            )
        except Exception as exc:
            raise self.error(exc, f"listing {uri}") from exc
        if not listing:
            raise S3ObjectNotFound(f"S3: no object and no folder at {uri}")
        version = hashlib.sha256(repr(listing).encode()).hexdigest()[:16]
        target = base / version / Path(prefix.rstrip("/")).name
        with _entry_lock(target):
            if target.is_dir():
                log.info("S3: %s/ is cached at %s", uri, target)
                return target
            staging = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
            try:
                for key, _etag, _size in listing:
                    obj = S3Uri(uri.bucket, key)
                    try:
                        head = self.client.head_object(Bucket=uri.bucket, Key=key)
                    except Exception as exc:
                        raise self.error(exc, f"reading {obj}") from exc
                    dest = staging / _safe_relpath(key[len(prefix) :])
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    self._download_verified(obj, head, dest)
                try:
                    os.replace(staging, target)
                except OSError:
                    if not target.is_dir():  # a process without the lock (NFS without locking) won the race
                        raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        log.info("S3: fetched %s/ (%d files) -> %s", uri, len(listing), target)
        return target

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


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
    "InvalidClientTokenId",
}
_DENIED_CODES = {"AccessDenied", "403", "Forbidden", "AllAccessDisabled", "AccountProblem"}


def _classify(exc: BaseException, doing: str, endpoint: str) -> S3Error:
    """Map the botocore exception in `exc`'s chain to one of our S3Error classes with a fix-it hint."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, BotoCoreError | ClientError | S3Error):
        cause = cause.__cause__ or cause.__context__
    err: BaseException = cause or exc
    if isinstance(err, S3Error):
        return err
    what = f"S3: {doing}"
    if isinstance(
        err, NoCredentialsError | PartialCredentialsError | CredentialRetrievalError | ProfileNotFound
    ):
        msg = f"{what}: no usable AWS credentials ({err}); set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (env or .env), AWS_PROFILE, or use an instance role"
        return S3CredentialsError(scrub(msg))
    if isinstance(err, ConnectionError | HTTPClientError):
        msg = f"{what}: endpoint {endpoint} unreachable ({type(err).__name__}); check AWS_ENDPOINT_URL and the network"
        return S3EndpointError(scrub(msg))
    if isinstance(err, ClientError):
        code = _code(err)
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            return S3BucketNotFound(
                f"{what}: bucket does not exist at {endpoint} (create it, or fix S3_BUCKET)"
            )
        if code in _CREDENTIAL_CODES:
            return S3CredentialsError(
                f"{what}: the store rejected the credentials ({code}); check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_PROFILE"
            )
        if code in _DENIED_CODES or status == 403:
            return S3AccessDenied(
                f"{what}: access denied ({code}); the credentials lack s3:PutObject/GetObject/ListBucket here"
            )
        if code in {"404", "NoSuchKey", "NotFound"}:
            return S3ObjectNotFound(f"{what}: not found")
        return S3Error(scrub(f"{what}: {code or status}: {err}"))
    return S3Error(scrub(f"{what}: {type(err).__name__}: {err}"))
