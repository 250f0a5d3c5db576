"""S3 failures as one exception class per fix: the message says what to check, and never holds a secret.

boto3 raises a handful of botocore types whose meaning hides in error codes; `classify` maps them to the
classes below so callers and users see "no credentials" or "bucket missing", not a stack of HTTP details.
"""

from __future__ import annotations

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

from vitrain.errors import UserError, chain
from vitrain.utils.secrets import scrub


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


def error_code(exc: ClientError) -> str:
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


def classify(exc: BaseException, doing: str, endpoint: str) -> S3Error:
    """Map the botocore exception in `exc`'s chain to one of our S3Error classes with a fix-it hint."""
    kinds = BotoCoreError | ClientError | S3Error
    err: BaseException = next((e for e in chain(exc) if isinstance(e, kinds)), exc)
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
        code = error_code(err)
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
