"""Where an S3 object is (`S3Uri`) and how to reach it (`S3Options`, `make_client`).

Kept apart from the transfers so that configs, the callback and the resume path can name a location and
its client settings without touching a connection.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import boto3
from botocore.config import Config

from vitrain.errors import UserError

MiB = 1024**2


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
    max_concurrency: int = 4  # parts of one large file in flight at once
    # files of a folder fetched or uploaded at once (a sharded checkpoint, a prefix of photos, data shards):
    # thousands of small objects one after another are paced by each request's round trip, not the bandwidth
    parallel_files: int = 8
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
        # a connection for every request in flight (botocore keeps 10 and drops the ones past them, with a
        # warning each): the files of a folder at once, the parts of each
        max_pool_connections=max(10, options.parallel_files * options.max_concurrency),
    )
    return session.client(
        "s3", endpoint_url=options.endpoint_url or None, region_name=options.region, config=config
    )
