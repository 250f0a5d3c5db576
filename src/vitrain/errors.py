"""Errors that mean "the user asked for something we cannot do", shown as one line, not a traceback."""

import re
from collections.abc import Iterator
from typing import Any


def chain(err: BaseException | None) -> Iterator[BaseException]:
    """`err` and what caused it (`raise ... from`, or raised while handling), each once: a chain can loop (an
    exception re-raised inside the handler of one it caused), which a plain walk would follow forever."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


class UserError(Exception):
    """Bad input: a config value, a path, a model name. The message must say what is wrong and how to fix it."""


class DataError(UserError):
    """The dataset is missing, empty, corrupted or in an unknown layout."""


class ModelError(UserError):
    """Unknown model name, weights that cannot be loaded or a checkpoint of another architecture."""


# words of torch's optimizer messages ("Invalid learning rate: -1") and the keyword each is about
_ARGUMENT_WORDS = {
    "learning rate": "lr",
    "weight_decay": "weight_decay",
    "beta": "betas",
    "epsilon": "eps",
    "momentum": "momentum",
}


def argument_error(prefix: str, node: Any, err: BaseException) -> UserError:
    """A library's complaint about its arguments (`ValueError`/`TypeError` from a torch optimizer, timm or
    torchvision constructor) as one line naming the config key: `model.optimizer.lr=-1: Invalid learning
    rate: -1 (torch.optim.AdamW)`."""
    message = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
    message = message.removesuffix(", but expected one of:")  # torch's overload listing follows
    options = {k: v for k, v in dict(node or {}).items() if not str(k).startswith("_")}
    named = [k for k in options if re.search(rf"\b{re.escape(str(k))}\b", message)]
    named = named or [
        key for word, key in _ARGUMENT_WORDS.items() if word in message.lower() and key in options
    ]
    if not named and isinstance(
        err, TypeError
    ):  # e.g. '<=' between a str and a float: a word where a number goes
        named = [k for k, v in options.items() if isinstance(v, str) and not str(k).endswith("name")]
    where = f"{prefix}.{named[0]}={options[named[0]]}" if len(named) >= 1 else prefix
    target = dict(node or {}).get("_target_")
    return UserError(f"{where}: {message}" + (f" ({target})" if target else ""))
