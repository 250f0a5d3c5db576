"""Printing, saving and instantiating the composed Hydra config."""

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import hydra
import rich.syntax
import rich.tree
from hydra.errors import InstantiationException
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, ListConfig, OmegaConf

from vitrain.errors import UserError
from vitrain.utils.secrets import redact

PRINT_ORDER = ("datamodule", "model", "callbacks", "logger", "trainer", "paths", "extras")


@rank_zero_only
def print_config_tree(
    cfg: DictConfig, save_to: Path | None = None, order: Sequence[str] = PRINT_ORDER
) -> None:
    """Rich tree of the config on rank zero; also written to `save_to` (the run dir's config_tree.log)."""
    cfg = redact(cfg, resolve=True)  # a key named like a secret, or a secret's value, never reaches the tree
    tree = rich.tree.Tree("CONFIG", style="dim", guide_style="dim")
    fields = [f for f in order if f in cfg] + [f for f in cfg if f not in order]
    for field in fields:
        branch = tree.add(str(field), style="bold", guide_style="dim")
        node = cfg[field]
        text = OmegaConf.to_yaml(node, resolve=True) if isinstance(node, DictConfig) else str(node)
        branch.add(rich.syntax.Syntax(text, "yaml"))
    rich.print(tree)
    if save_to is not None:
        save_to.parent.mkdir(parents=True, exist_ok=True)
        with save_to.open("w") as f:
            rich.print(tree, file=f)


@rank_zero_only
def print_run_config(cfg: DictConfig, save_to: Path | None = None) -> None:
    """The config tree on global rank zero, printed by a task once its set-up has succeeded: an error in
    the config or the data is then one line, not one line after the whole tree."""
    print_config_tree(cfg, save_to=save_to)


def instantiate_node(node: DictConfig, key: str, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate(node, **kwargs)`; a key its class does not take is one line naming it. Only
    composition leaves one there (a key typed on the command line is checked first, vitrain/tasks/cli.py):
    an experiment's option for another group choice, e.g. experiment=cifar's `datamodule.download` with
    `datamodule=image_folder`."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as err:
        bad = re.search(r"unexpected keyword argument '(\w+)'", str(err.__cause__))
        if not isinstance(err.__cause__, TypeError) or bad is None:
            raise
        target = str(node.get("_target_", "?")).rsplit(".", 1)[-1]
        experiment = _choice("experiment")
        by = f"experiment={experiment}" if experiment else "the config"
        raise UserError(
            f"{key}.{bad[1]} is not an option of {target}: {by} sets it for another {key}; drop it with "
            f"~{key}.{bad[1]}"
        ) from None


def _choice(group: str) -> str | None:
    """The option chosen for a config group in this Hydra run (None outside one, or none chosen)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get(group)


def instantiate_dict(cfg: DictConfig | None) -> list[Any]:
    """Instantiate every `_target_` node of a group such as `callbacks` or `logger` (None-valued: skipped)."""
    if not cfg:
        return []
    return [
        hydra.utils.instantiate(node)
        for node in cfg.values()
        if isinstance(node, DictConfig) and "_target_" in node
    ]


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """Plain, resolved dict of the config without secrets (what a checkpoint stores)."""
    return redact(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))


def plain(value: Any) -> Any:
    """`value` as plain dicts/lists/scalars: OmegaConf nodes resolved, Hydra nodes (`_target_`) kept as data."""
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value
