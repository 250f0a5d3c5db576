"""The export task: a checkpoint's network as a timm model folder (`model.safetensors` + `config.json`, the
layout of timm's Hugging Face Hub models), written by timm's own `save_for_hf`. Anywhere timm is installed,
`timm.create_model("local-dir:<folder>", pretrained=True)` rebuilds it with its weights, its class names
(`pretrained_cfg["label_names"]`) and the evaluation preprocessing it was trained for
(`timm.data.resolve_data_config(model=...)`); the folder can be pushed to the Hub as it is."""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import timm
import torch
from omegaconf import DictConfig
from timm.models import save_for_hf

from vitrain.checkpoints import CheckpointError
from vitrain.errors import ModelError, UserError
from vitrain.tasks.evaluation import checkpoint_model, preprocessing_of, read_checkpoint

log = logging.getLogger(__name__)


def export_model(cfg: DictConfig) -> tuple[dict[str, float], Path]:
    """Write `cfg.ckpt_path`'s network into `cfg.output` (else `model/` in the run dir), then rebuild it from
    there with timm and check that it computes what the checkpoint's network computes; returns the folder."""
    out = Path(str(cfg.output)) if cfg.get("output") else Path(cfg.paths.output_dir) / "model"
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(
            f"output={out} exists and is not an empty folder: give a new one (nothing is replaced)"
        )
    path, checkpoint, run_cfg = read_checkpoint(cfg, {"ckpt_path": str(cfg.ckpt_path), "output": str(out)})
    classes = checkpoint.get("class_names")
    if not classes:
        raise CheckpointError(f"{path} names no classes: it was not written by src/train.py")
    model = checkpoint_model(checkpoint, path, run_cfg, list(classes), str(cfg.ckpt_path))
    data_config, caveat = preprocessing_of(checkpoint, run_cfg, model).timm_data_config()

    net = model.net.eval()
    for tensor in [*net.parameters(), *net.buffers()]:  # safetensors stores contiguous tensors only
        tensor.data = tensor.data.contiguous()
    # written beside `out` and renamed into place once timm has rebuilt it: never half an export there
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write(net, staging, list(classes), data_config, run_cfg.model.net)
        check_rebuilt(net, staging, data_config)
        if out.exists():
            out.rmdir()  # empty (checked above)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("Exported to %s: timm.create_model('local-dir:%s', pretrained=True)", out, out.resolve())
    if caveat:
        log.warning(caveat)
    return {}, out


def write(
    net: torch.nn.Module, folder: Path, classes: list[str], data_config: dict[str, Any], net_cfg: Any
) -> None:
    """timm's `save_for_hf`; an argument of the network timm cannot write in its config (a Hydra node such
    as a ConvStem embedding) is refused in one line naming the config key."""
    try:
        save_for_hf(
            net, str(folder), model_config={"label_names": classes}, data_config=data_config,
            safe_serialization=True,
        )  # fmt: skip
    except ValueError as err:
        key = re.search(r"Model argument '(\w+)' is not serializable", str(err))
        if key is None:
            raise
        node = net_cfg.get(key.group(1))
        what = node.get("_target_") if hasattr(node, "get") else type(node).__name__
        raise ModelError(
            f"model.net.{key.group(1)} ({what}) cannot be written in a timm config: timm cannot rebuild this "
            "network from a folder; classify with src/predict.py, or load the checkpoint with vitrain"
        ) from None


def check_rebuilt(net: torch.nn.Module, folder: Path, data_config: dict[str, Any]) -> None:
    """timm rebuilds the network from `folder` with the same weights and outputs, and the preprocessing it
    resolves for it is `data_config`'s: the export is usable before anyone relies on it."""
    rebuilt = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    x = torch.randn(2, *data_config["input_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        same = torch.allclose(rebuilt(x), net(x), rtol=1e-4, atol=1e-5)
    resolved = timm.data.resolve_data_config({}, model=rebuilt)
    wanted = {k: tuple(v) if isinstance(v, list | tuple) else v for k, v in data_config.items()}
    got = {k: tuple(v) if isinstance(v, list | tuple) else v for k, v in resolved.items() if k in wanted}
    if not same or got != wanted:
        raise ModelError(
            f"the export in {folder} does not rebuild the network as trained (outputs equal: {same}; "
            f"preprocessing {got} instead of {wanted}): report this with the checkpoint's model config"
        )
