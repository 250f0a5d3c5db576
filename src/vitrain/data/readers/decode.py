"""An image folder held in memory (`datamodule.in_memory`): whether it fits, decided from the file list before
anything is decoded, and the decode itself: every image once, shorter side resized to S and center-cropped
to S x S, RGB, into one uint8 [N,3,S,S] tensor per split, cached on disk so a later run (and the other
ranks of this one) only loads the file. Batches are then tensor slices augmented on the device, as for
CIFAR-10 (vitrain/data/datamodules/base.py)."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch
from PIL import Image, ImageOps
from torch import Tensor

from vitrain.data.readers.cache import digest, stat_key
from vitrain.data.transforms import header_orientation, pil_rgb
from vitrain.errors import DataError
from vitrain.utils.atomic import write_atomic

log = logging.getLogger(__name__)

#: share of the memory available at start-up that `in_memory_budget_gb: null` allows
DEFAULT_BUDGET_FRACTION = 0.25
GB = 1e9
# bump when what the cache file holds changes (2: images turned upright by their EXIF orientation; 3: 16-bit
# images scaled to 8 bits, not clipped)
CACHE_FORMAT = 3

Files = list[tuple[str, int]]


def budget_bytes(budget_gb: float | None) -> int:
    """The stated budget, or a quarter of the memory available now (the rest: the model, the loaders, the
    other processes of the node)."""
    if budget_gb is None:
        return int(DEFAULT_BUDGET_FRACTION * psutil.virtual_memory().available)
    return int(budget_gb * GB)


def decoded_bytes(n_images: int, size: int) -> int:
    """uint8 RGB at size x size: what the tensor holds, known from the file count alone."""
    return n_images * 3 * size * size


@dataclass(frozen=True)
class MemoryPlan:
    in_memory: bool
    reason: str  # one line, logged


def plan(mode: bool | str, n_images: int, size: int, budget: int, processes: int) -> MemoryPlan:
    """In memory or streamed. Each training process on a node holds its own copy, so the need is counted
    `processes` times against the node's budget. `in_memory: true` that does not fit is refused here,
    before any file is decoded."""
    one = decoded_bytes(n_images, size)
    need = one * processes
    copies = f" ({human(one)} x {processes} processes on this node)" if processes > 1 else ""
    sizes = f"{n_images} images at {size}x{size} px need {human(need)} decoded{copies}"
    budget_text = f"the budget of {human(budget)} (datamodule.in_memory_budget_gb)"
    if mode is False:
        return MemoryPlan(False, "datamodule.in_memory=false: decoding from disk in loader workers")
    if need <= budget:
        return MemoryPlan(True, f"in memory (datamodule.in_memory={mode}): {sizes}, within {budget_text}")
    if mode is True:
        raise DataError(
            f"datamodule.in_memory=true but {sizes}, more than {budget_text}: raise the budget, lower "
            "datamodule.in_memory_size, or set datamodule.in_memory=auto to stream from disk"
        )
    return MemoryPlan(False, f"streaming from disk (datamodule.in_memory=auto): {sizes}, over {budget_text}")


def human(n_bytes: int) -> str:
    """Decimal units, three significant digits: 18.4 MB, 1.23 GB."""
    for unit, scale in (("TB", 1e12), ("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.3g} {unit}"
    return f"{n_bytes} B"


def decode_square(path: str, size: int, resample: int) -> Tensor:
    """One image as uint8 [3,size,size]: upright (its EXIF orientation applied) and any mode to RGB (as the
    worker path does), shorter side resized to `size`, center crop."""
    try:
        with Image.open(path) as img:
            # JPEG: let libjpeg decode at 1/2, 1/4 or 1/8 scale when still at least `size` on both sides
            img.draft("RGB", (size, size))
            # upright, as every decoder here turns it
            rgb = pil_rgb(ImageOps.exif_transpose(img) if header_orientation(img) != 1 else img)
    except Exception as e:  # PIL raises many types; only reachable with verify_images=false
        raise DataError(
            f"cannot decode {path} ({type(e).__name__}: {e}): remove or replace it "
            "(datamodule.verify_images=true finds such files before training)"
        ) from None
    square = ImageOps.fit(rgb, (size, size), method=resample, centering=(0.5, 0.5))
    return torch.from_numpy(np.array(square)).permute(2, 0, 1)  # np.array: a writable copy


def decode_files(files: Files, size: int, resample: int, workers: int) -> tuple[Tensor, Tensor]:
    """(images uint8 [N,3,size,size], labels int64 [N]); threads, as PIL releases the GIL while it decodes
    and resizes."""
    out = torch.empty((len(files), 3, size, size), dtype=torch.uint8)

    def work(i: int) -> None:
        out[i] = decode_square(files[i][0], size, resample)

    with ThreadPoolExecutor(max(1, workers)) as pool:
        for _ in pool.map(work, range(len(files))):
            pass
    return out, torch.tensor([label for _, label in files], dtype=torch.int64)


def load_or_decode(
    splits: dict[str, Files], size: int, resample: int, cache_dir: str | os.PathLike, workers: int
) -> dict[str, tuple[Tensor, Tensor]]:
    """Every split decoded, from `<cache_dir>/image_folder/decoded-<key>.pt` when that file exists; the key
    covers each file's path, size and mtime, the size S and the resampling filter. Splits that are the same
    file list (test = val when there is no test/) share one tensor."""
    listing = "\n".join(
        f"{name}|{path}|{label}|{stat_key(Path(path))}"
        for name, files in splits.items()
        for path, label in files
    )
    target = Path(cache_dir).expanduser().absolute() / "image_folder"
    target = target / f"decoded-{digest(f'{CACHE_FORMAT}|{size}|{resample}|{listing}')}.pt"
    if target.is_file():
        try:
            return {
                k: (v[0], v[1]) for k, v in torch.load(target, map_location="cpu", weights_only=True).items()
            }
        except Exception as e:  # a damaged cache is rebuilt, not fatal
            log.warning("ignoring unreadable cache file %s (%s)", target, e)
    total = sum(len(f) for f in {id(f): f for f in splits.values()}.values())
    log.info("decoding %d images at %dx%d px into %s (first run only)", total, size, size, target)
    out: dict[str, tuple[Tensor, Tensor]] = {}
    done: dict[int, tuple[Tensor, Tensor]] = {}
    for name, files in splits.items():
        if id(files) not in done:
            done[id(files)] = decode_files(files, size, resample, workers)
        out[name] = done[id(files)]
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, lambda f: torch.save({k: list(v) for k, v in out.items()}, f))
    return out
