"""Keep credentials out of everything we print or save: config trees, hparams, logs, reports.

Two nets: keys whose *name* looks secret are masked, and the *current values* of the secret environment
variables are scrubbed from any string, wherever they ended up (a resolved `${oc.env:...}`, an error
message, a URL with userinfo).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "***"

# Environment variables whose values must never be written anywhere.
SECRET_ENV_VARS: tuple[str, ...] = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "WANDB_API_KEY",
)

# Config/dict keys whose values are masked whatever they hold, matched on whole words of the key
# (`aws_secret_access_key`, `apiKey`, `sessionToken`) so that `tokenizer` or `secretary` are left alone.
_SECRET_WORDS = {"secret", "password", "passwd", "token", "credential", "credentials", "authorization"}
_SECRET_PAIRS = {("api", "key"), ("access", "key"), ("private", "key")}
# Values shorter than this are not scrubbed by value: masking every "1" or "x" would wreck the text.
_MIN_SECRET_LEN = 6
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s:]+:[^/@\s]+@")


def secret_values(names: Iterable[str] = SECRET_ENV_VARS) -> dict[str, str]:
    """Current values of the secret env vars that are set (and long enough to scrub safely)."""
    found = {name: os.environ.get(name, "") for name in names}
    return {name: value for name, value in found.items() if len(value) >= _MIN_SECRET_LEN}


def find_secrets(text: str, names: Iterable[str] = SECRET_ENV_VARS) -> list[str]:
    """Names of secret env vars whose current value occurs in `text`; for tests and report writers."""
    return [name for name, value in secret_values(names).items() if value in text]


def scrub(text: str) -> str:
    """`text` with secret env values and URL passwords (`scheme://user:pass@`) replaced by `***`."""
    # Longest first, so a value that contains another is masked whole.
    for value in sorted(secret_values().values(), key=len, reverse=True):
        text = text.replace(value, REDACTED)
    return _URL_USERINFO.sub(rf"\g<scheme>{REDACTED}@", text)


def is_secret_key(key: object) -> bool:
    if not isinstance(key, str):
        return False
    words = re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key).lower())
    return bool(_SECRET_WORDS.intersection(words) or _SECRET_PAIRS.intersection(itertools.pairwise(words)))


def redact(obj: Any, resolve: bool = False) -> Any:
    """A copy of `obj` that is safe to print or save.

    Works on dicts, lists, tuples, strings and OmegaConf containers (returned as OmegaConf containers, so a
    config-tree printer can use the result as is). `resolve=True` resolves interpolations first; the resolved
    secrets are then caught by value.
    """
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(obj, DictConfig | ListConfig):
        return OmegaConf.create(redact(OmegaConf.to_container(obj, resolve=resolve)))
    if isinstance(obj, Mapping):
        # a flag is no credential: timm's `class_token: false` must reach the checkpoint's run config intact
        # (eval.py rebuilds the model from it); any other value under a secret-sounding key is masked whole
        return {
            key: (
                REDACTED
                if is_secret_key(key) and value not in (None, "") and not isinstance(value, bool)
                else redact(value)
            )
            for key, value in obj.items()
        }
    if isinstance(obj, list | tuple):
        return type(obj)(redact(item) for item in obj)
    if isinstance(obj, str):
        return scrub(obj)
    return obj


class SecretFilter(logging.Filter):
    """Scrubs secrets from log records (botocore's DEBUG output carries the access key id)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = scrub(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def install_secret_filter(handlers: Iterable[logging.Handler] | None = None) -> None:
    """Attach a `SecretFilter` to the given handlers (default: the root logger's). Idempotent.

    Handlers, not loggers: a logger's filters do not see records propagated from child loggers.
    """
    for handler in handlers if handlers is not None else logging.getLogger().handlers:
        if not any(isinstance(f, SecretFilter) for f in handler.filters):
            handler.addFilter(SecretFilter())
