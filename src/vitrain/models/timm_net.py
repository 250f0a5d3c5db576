"""Building a timm network from config, with clear errors for the ways it goes wrong offline."""

import difflib
import os
import re
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

from vitrain.checkpoints import load as load_checkpoint
from vitrain.checkpoints import state_dict_mismatch
from vitrain.errors import ModelError, argument_error


def _check_model_name(name: str) -> None:
    if timm.is_model(name):
        return
    close = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(close)}?)" if close else " (see timm.list_models('vit_*'))"
    raise ModelError(f"unknown timm model model.net.model_name={name}{hint}")


def _build(value: Any) -> Any:
    """A keyword given as a Hydra node (`_target_`, e.g. a timm `embed_layer` with a `ConvStem` backbone) is
    built here, at model construction: the config (and so the checkpoint's hyperparameters) stays plain."""
    if isinstance(value, Mapping) and "_target_" in value:
        import hydra

        return hydra.utils.instantiate(value, _convert_="all")
    return value


def _failed_check(err: AssertionError) -> str:
    """An assert's message, or, where it has none, its own source line (`assert x % p == 0` in file:line)."""
    if str(err).strip():
        return str(err).strip().splitlines()[0]
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f"{(frame.line or 'an assert').strip()} failed ({Path(frame.filename).name}:{frame.lineno})"


def create_net(net: Mapping[str, Any], weights_file: str | None = None) -> nn.Module:
    """`timm.create_model(**net)`; a local `weights_file` stands in for the hub download.

    timm itself resizes the classifier when `num_classes` differs from the weights', so a 1000-class
    ImageNet file loads into a 10-class CIFAR model.
    """
    kwargs = {k: _build(v) for k, v in net.items()}
    name = kwargs.pop("model_name")
    if kwargs.get("num_classes") is None:  # set from the data by training.build_model; else timm's default
        kwargs.pop("num_classes", None)
    _check_model_name(name)
    if weights_file:
        # a file or an FSDP checkpoint folder (build_model has fetched an s3:// one)
        path = Path(weights_file).expanduser()
        if not path.exists():
            raise ModelError(f"model.weights_file={weights_file} does not exist")
        # loaded here rather than with timm's `file=` overlay: timm hands files of "custom_load" models
        # (most ViTs) to an .npz reader; a state dict goes through its filter (pos-embed resize) instead.
        state_dict, normalisation = _read_weights(path)
        kwargs["pretrained"] = True
        # the mean/std our checkpoint's images had, as timm's config of pretrained weights gives theirs
        kwargs["pretrained_cfg_overlay"] = {
            **kwargs.get("pretrained_cfg_overlay", {}),
            **normalisation,
            "state_dict": state_dict,
        }
    try:
        built = timm.create_model(name, **kwargs)
    except TypeError as err:
        # timm passes every keyword to the family's constructor: `img_size` suits a ViT, not a ResNet
        bad = re.search(r"unexpected keyword argument '(\w+)'", str(err))
        if bad is None:
            raise argument_error("model.net", net, err) from err
        family = str(err).split(".", 1)[0]
        raise ModelError(
            f"model.net.{bad.group(1)} is not a keyword of {name} ({family}): remove it, or use a "
            "model it fits (ViT keywords such as img_size/patch_size live in configs/model/vit.yaml)"
        ) from err
    except (OSError, ConnectionError) as err:
        if not kwargs.get("pretrained") or weights_file:
            raise
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise ModelError(
            f"could not download pretrained weights for {name}{offline}: {type(err).__name__}. "
            "Train from scratch with model.net.pretrained=false, or give a local file with "
            "model.weights_file=/path/to/weights.safetensors"
        ) from err
    except ValueError as err:
        raise argument_error("model.net", net, err) from err
    except AssertionError as err:
        # timm checks sizes that must match or divide with asserts, some without a message: name the check
        raise ModelError(
            f"model.net: timm cannot build {name} with these settings: {_failed_check(err)}"
        ) from err
    except RuntimeError as err:
        detail = state_dict_mismatch(err) if weights_file else None
        if detail is None:
            raise
        raise ModelError(f"model.weights_file={weights_file} does not fit {name}: {detail}") from err
    if isinstance(getattr(built, "pretrained_cfg", None), dict):
        # timm keeps the overlay's weights in the config it attaches: a second copy of the initial weights for
        # the whole run, in every process (and in every deep copy of the network: EMA's)
        built.pretrained_cfg.pop("state_dict", None)
    return built


def input_spec(net: nn.Module, pretrained: bool, img_size: int | None) -> dict[str, Any]:
    """Input size, resize/crop and normalisation the network expects, from timm's data config for the model.

    The size: `model.net.img_size` when given (a ViT built for 32 px), else the patch embedding's, else
    timm's default for the model (224 px for most; a ResNet or ConvNeXt also runs at any other size:
    `datamodule.img_size=32`). Normalisation: the pretrained weights' mean/std; from scratch None, and the
    datamodule uses its data set's own statistics (CIFAR-10's, or ImageNet's for an image folder). The
    datamodule's own img_size/mean/std take precedence over both.
    """
    cfg = timm.data.resolve_model_data_config(net)
    embed_size = getattr(getattr(net, "patch_embed", None), "img_size", None)
    size = img_size or (embed_size[-1] if isinstance(embed_size, tuple) else None) or cfg["input_size"][-1]
    spec = {"img_size": size, "interpolation": cfg["interpolation"], "crop_pct": cfg["crop_pct"]}
    if pretrained:
        return {**spec, "mean": tuple(cfg["mean"]), "std": tuple(cfg["std"])}
    return {**spec, "mean": None, "std": None}


def _read_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, tuple[float, ...]]]:
    """(weights, the `mean` and `std` they were trained with where the file says) of a timm/safetensors file,
    a torch state dict, or one of our checkpoints: a Lightning `.ckpt` file or an FSDP checkpoint folder (its
    `state_dict`: the EMA weights where the run averaged, as evaluated; `normalisation`: recorded by
    training since 2026-12-01)."""
    if path.is_dir() or path.suffix == ".ckpt":  # timm reads files only, and keeps nothing but the weights
        checkpoint = load_checkpoint(path, key="model.weights_file")
        recorded = checkpoint.get("normalisation") or {}
        normalisation = {k: tuple(recorded[k]) for k in ("mean", "std") if recorded.get(k)}
        weights = checkpoint.get("state_dict", checkpoint)
        return _without_net_prefix(weights), normalisation if len(normalisation) == 2 else {}
    try:
        state_dict = timm.models.load_state_dict(str(path))
    except Exception as err:
        raise ModelError(f"model.weights_file={path} cannot be read: {type(err).__name__}: {err}") from err
    return _without_net_prefix(state_dict), {}


def _without_net_prefix(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    prefix = "net."  # ImageClassifier keeps the timm model under `net`
    if state_dict and all(k.startswith(prefix) for k in state_dict):
        state_dict = {k.removeprefix(prefix): v for k, v in state_dict.items()}
    return state_dict


HF_HOST = ("huggingface.co", 443)
# what timm reads from a Hugging Face repo, in the order it tries them
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin")


def check_pretrained_available(
    net: Mapping[str, Any], weights_file: str | None = None, timeout_s: float = 3.0
) -> None:
    """Before any data is decoded: pretrained weights must be in the local cache, or the hub reachable.

    Offline (HF_HUB_OFFLINE=1, or no connection to huggingface.co within `timeout_s`) and not cached, the run
    would otherwise decode its data first and then spend ~45 s in the hub client's retries before failing."""
    if not net.get("pretrained") or weights_file:
        return
    name = str(net.get("model_name"))
    _check_model_name(name)
    try:
        repo = timm.models.get_pretrained_cfg(name).hf_hub_id
    except Exception:  # no pretrained config for this name: timm says so itself
        return
    if not repo:
        return  # weights behind a plain URL (torch hub's cache): timm handles those
    from huggingface_hub import try_to_load_from_cache

    if any(isinstance(try_to_load_from_cache(repo, f), str) for f in HF_WEIGHT_FILES):
        return
    fix = (
        "give a local file with model.weights_file=/path/to/weights.safetensors, or train from scratch with "
        "model.net.pretrained=false"
    )
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ModelError(
            f"could not download pretrained weights for {name} ({repo}): HF_HUB_OFFLINE=1 is set and they are "
            f"not in the local cache; {fix}"
        )
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # through a proxy a direct connection says nothing: the hub client tries itself
    import socket
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or f"https://{HF_HOST[0]}")
    host = (endpoint.hostname or HF_HOST[0], endpoint.port or (80 if endpoint.scheme == "http" else 443))
    try:
        socket.create_connection(host, timeout=timeout_s).close()
    except OSError as err:
        raise ModelError(
            f"could not download pretrained weights for {name} ({repo}): {host[0]} cannot be reached "
            f"({type(err).__name__}) and they are not in the local cache; {fix} (offline with a filled cache: "
            "HF_HUB_OFFLINE=1)"
        ) from err


class PatchConv2d(nn.Conv2d):
    """A non-overlapping patch convolution (kernel = stride, no padding: a ViT's patch embedding) computed as
    one matrix product over the flattened patches. The same function and parameters (state-dict keys
    unchanged); on an H100 cuDNN ran ViT-B/32's 32x32/32 patch convolution (bf16) in ~7 ms of a ~36 ms
    step, where the product takes well under 1 ms (docs/benchmarks.md)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kh, kw = self.kernel_size
        if x.shape[-2] % kh or x.shape[-1] % kw:
            return super().forward(x)
        b, c, h, w = x.shape
        gh, gw = h // kh, w // kw
        patches = x.reshape(b, c, gh, kh, gw, kw).permute(0, 2, 4, 1, 3, 5).reshape(b * gh * gw, c * kh * kw)
        out = nn.functional.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)
        return out.reshape(b, gh, gw, self.out_channels).permute(0, 3, 1, 2)


def patch_convs_as_matmuls(net: nn.Module, min_kernel: int = 8) -> int:
    """Every plain non-overlapping patch convolution of at least `min_kernel` px becomes a `PatchConv2d`, in
    place (the class changes, as torch's parametrize does; parameters and keys stay). Returns how many."""
    count = 0
    for module in net.modules():
        if (
            type(module) is nn.Conv2d
            and module.kernel_size == module.stride
            and min(module.kernel_size) >= min_kernel
            and module.padding in ((0, 0), "valid")
            and module.dilation == (1, 1)
            and module.groups == 1
            and module.padding_mode == "zeros"
        ):
            module.__class__ = PatchConv2d
            count += 1
    return count
