"""timm's per-sample transform for the datamodules whose loader workers decode each image (image folders,
streaming shards): one place that turns the model's data config and the augmentation options into timm's
`create_transform` arguments, and runs it on uint8 tensors where it can (`on_tensors`)."""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vitrain.data.augment import TRIVIAL_NAMES
from vitrain.errors import DataError


def check_color_jitter(value: Any, decode_device: str = "cpu") -> None:
    """`datamodule.color_jitter`: null, a strength >= 0 (brightness, contrast and saturation alike), or
    [brightness, contrast, saturation(, hue)]; torchvision's ColorJitter on PIL images in the loader workers,
    which the GPU decoder has not."""
    if value is None:
        return
    values = list(value) if isinstance(value, list | tuple) else [value]
    if not (1 <= len(values) <= 4 and len(values) != 2) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in values
    ):
        raise DataError(
            f"datamodule.color_jitter={value!r}: use null, a strength >= 0 (e.g. 0.4), or [brightness, contrast, "
            "saturation] or [brightness, contrast, saturation, hue]"
        )
    if decode_device == "cuda":
        raise DataError(
            "datamodule.color_jitter runs in the loader workers, on PIL images: with datamodule.decode_device=cuda "
            "the GPU decodes and nothing applies it; set color_jitter=null or decode_device=cpu"
        )


def timm_transform(
    train: bool,
    img_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    spec: Mapping[str, Any],
    auto_augment: str | None = None,
    hflip: float = 0.5,
    color_jitter: float | Sequence[float] | None = None,
) -> Any:
    """Training: RandomResizedCrop + flip (+ an auto-augment string such as rand-m9-mstd0.5-inc1,
    `color_jitter`); evaluation: resize + center crop with the model's crop_pct. `spec` is the model's timm
    data config (interpolation, crop_pct; absent keys keep timm's defaults).

    The samples leave the workers as uint8 tensors (timm's `use_prefetcher` form): the device normalises the
    batch and, in training, erases (`re_prob`: augment.py's batched erasing in timm's pixel mode, DeiT's and
    timm's train.py's), as for in-memory data (`ImageDataModule.worker_batches_transform`). A quarter of float32's bytes through the workers' shared
    memory, the pinned copy and the copy to the GPU (58 MB instead of 231 MB for a batch of 384 at 224 px),
    and ~0.2 ms less per image in a worker on a CPU (docs/benchmarks.md 2b).

    No colour jitter unless asked for: `create_transform`'s default (0.4, off with an auto-augment policy)
    would make images decoded here augment otherwise than the same data held in memory or decoded on the GPU
    (neither jitters), and it took ~0.4 of the ~1.4 ms a 224 px training image costs a worker on a CPU."""
    from timm.data import create_transform

    kwargs: dict[str, Any] = {
        "input_size": img_size,
        "is_training": train,
        "mean": mean,
        "std": std,
        "use_prefetcher": True,  # uint8 out: normalised (and erased) on the device
    }
    if spec.get("interpolation"):
        kwargs["interpolation"] = spec["interpolation"]
    trivial = train and auto_augment in TRIVIAL_NAMES
    if train:
        kwargs.update(
            auto_augment=None if trivial else auto_augment,
            hflip=hflip,
            color_jitter=tuple(color_jitter) if isinstance(color_jitter, list | tuple) else color_jitter,
        )
    elif spec.get("crop_pct"):
        kwargs["crop_pct"] = spec["crop_pct"]
    try:
        transform = create_transform(**kwargs)
    except (AssertionError, KeyError, ValueError) as e:  # how timm refuses a policy string it cannot parse
        raise DataError(
            f"datamodule.auto_augment={auto_augment!r} is no policy timm knows ({type(e).__name__}: {e}): use e.g. "
            "rand-m9-mstd0.5-inc1, augmix-m5-w4-d2, v0, original, or trivial (TrivialAugmentWide)"
        ) from None
    if trivial:
        from torchvision.transforms import InterpolationMode, TrivialAugmentWide

        # timm has no TrivialAugment: torchvision's, where timm puts a policy (after the crop and flip, before
        # the conversion to a tensor); bilinear, as the in-memory path's batched warps
        transform.transforms.insert(-1, TrivialAugmentWide(interpolation=InterpolationMode.BILINEAR))
    posterize_to_zero_bits(transform)
    return transform


def _posterize(img: Any, bits_to_keep: int, **kwargs: Any) -> Any:
    """timm's posterize, where 0 bits kept gives a black image, as Pillow before 13 gave (and TensorFlow's
    RandAugment, which timm follows)."""
    from PIL import Image
    from timm.data.auto_augment import posterize

    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return posterize(img, bits_to_keep, **kwargs)


def posterize_to_zero_bits(transform: Any) -> None:
    """Pillow 13's `ImageOps.posterize` refuses to keep 0 bits, which timm's auto-augment policies ask for:
    RandAugment's 'inc1' ops keep 4 - int(4 m / 10) bits, and `mstd0.5` draws m >= 10 (clipped to 10) in
    2.3 % of the draws around m9; with 2 of 15 ops a round, each applied with p 0.5, about one training image
    in 660 raised ValueError in a loader worker and stopped the run (the original ops at low magnitudes and
    AutoAugment's v0 policy too). The posterize ops of an auto-augment policy in `transform` get `_posterize`
    instead (timm's own above 0 bits)."""
    from timm.data.auto_augment import AugmentOp, posterize

    for op in getattr(transform, "transforms", []):
        policy = getattr(op, "ops", None) or [o for sub in getattr(op, "policy", []) for o in sub]
        for aug in policy:
            if isinstance(aug, AugmentOp) and aug.aug_fn is posterize:
                aug.aug_fn = _posterize


#: the EXIF tag of how a camera held the picture (1: as stored; 6: rotated a quarter turn, a portrait photo)
EXIF_ORIENTATION = 0x0112


def exif_orientation(data: bytes) -> int:
    """The EXIF orientation (1-8) in an image's header, 1 when there is none (`header_orientation`)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            return header_orientation(img)
    except Exception:  # PIL raises many types for bytes it cannot parse: the decoders name such files
        return 1


def header_orientation(img: Any) -> int:
    """The EXIF orientation of an opened PIL image from what its header holds (a JPEG's APP1, a WebP's EXIF
    chunk), no pixel decoded: PIL's `getexif` decodes a PNG to look behind its pixels for the tag."""
    from PIL import Image

    raw = img.info.get("exif")
    if not raw:
        return 1
    exif = Image.Exif()
    try:
        exif.load(raw)
    except Exception:  # a damaged EXIF block: the image as stored
        return 1
    value = exif.get(EXIF_ORIENTATION, 1)
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def oriented_size(h: int, w: int, orientation: int) -> tuple[int, int]:
    """(height, width) of a stored h x w image once turned upright: a quarter turn (EXIF 5-8) swaps them."""
    return (w, h) if orientation >= 5 else (h, w)


def orient(image: Tensor, orientation: int) -> Tensor:
    """A decoded image [..., H, W] turned upright by its EXIF orientation, as PIL's `ImageOps.exif_transpose`
    turns it: 2 mirrored, 3 half a turn, 4 upside down mirrored, 5 transposed, 6 a quarter turn clockwise,
    7 transverse, 8 a quarter turn counter-clockwise."""
    if orientation == 2:
        return image.flip(-1)
    if orientation == 3:
        return image.flip(-1, -2)
    if orientation == 4:
        return image.flip(-2)
    if orientation == 5:
        return image.transpose(-1, -2)
    if orientation == 6:
        return image.rot90(-1, (-2, -1))
    if orientation == 7:
        return image.flip(-1, -2).transpose(-1, -2)
    if orientation == 8:
        return image.rot90(1, (-2, -1))
    return image


def is_webp(data: bytes) -> bool:
    return data[:4] == b"RIFF" and data[8:12] == b"WEBP"


# PIL's modes of 16-bit grayscale (a 16-bit PNG or TIFF)
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


def pil_rgb(img: Any) -> Any:
    """A PIL image of any mode as 8-bit RGB. 16-bit grayscale is scaled to 8 bits (its high byte, as
    torchvision scales): PIL's own `convert("RGB")` clips it at 255, a white image for any 16-bit photo.
    32-bit pixels: integers that fit in 16 bits are read as 16-bit, others refused (ValueError)."""
    from PIL import Image

    from vitrain.data.readers.image_folders import wide_pixels

    if why := wide_pixels(img):
        raise ValueError(why)
    if img.mode in (*SIXTEEN_BIT_MODES, "I"):
        import numpy as np

        img = Image.fromarray((np.asarray(img).astype(np.uint16) >> 8).astype(np.uint8))
    return img.convert("RGB")


def to_uint8(image: Tensor) -> Tensor:
    """A decoded image as uint8: torchvision decodes a 16-bit PNG to uint16, scaled here to 8 bits."""
    if image.dtype == torch.uint16:
        return (image.to(torch.int32) >> 8).to(torch.uint8)  # torch has few uint16 ops
    return image


def decode_pil(data: bytes, upright: bool = True) -> Any:
    """Encoded bytes -> RGB PIL image, upright (its EXIF orientation applied: a phone's portrait photo is
    stored landscape with the tag; `upright=False`: as stored); grayscale (16-bit too), palette, RGBA, CMYK
    converted."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data)) as img:
        if upright and header_orientation(img) != 1:  # from the header, as torchvision's decoders read it
            return pil_rgb(ImageOps.exif_transpose(img))  # decodes the pixels
        return pil_rgb(img)  # (a TIFF: PIL's reader turns it itself)


def decode_tensor(data: bytes, upright: bool = True) -> Tensor:
    """Encoded bytes -> uint8 RGB tensor (3, H, W), upright as `decode_pil` turns it (`upright=False`: as
    stored), by torchvision's decoders (libjpeg-turbo, libpng, libwebp, giflib; grayscale, palette, alpha and
    CMYK converted; a GIF's first frame; a 16-bit PNG scaled to 8 bits), PIL's for the rest (BMP, TIFF).
    torchvision applies a JPEG's and a PNG's EXIF orientation itself, not a WebP's: that one is read from the
    header here."""
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.functional import pil_to_tensor

    blob = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    try:
        image = decode_image(blob, mode=ImageReadMode.RGB, apply_exif_orientation=upright)
    except RuntimeError:  # "Unsupported image file", or bytes PIL may still read
        image = None
    if image is not None and image.dtype in (torch.uint8, torch.uint16):
        image = to_uint8(image[0] if image.ndim == 4 else image)
        return orient(image, exif_orientation(data)).contiguous() if upright and is_webp(data) else image
    return pil_to_tensor(decode_pil(data, upright))


class TensorPipeline:
    """timm's per-sample transform run on uint8 tensors that torchvision decoded: the same ops and random
    draws (timm's crop box from `random`, torchvision's flip from torch: the per-sample seeding covers both),
    resized by torchvision's v2 kernels, which antialias uint8 images with vectorised code where PIL's
    resampling is scalar. On one EPYC core, decode + crop + resize + flip took 304 us against 706 with PIL
    for a 224 px JPEG, 491 against 1,008 for a 400x350 photo; with RandAugment after the crop (on a PIL
    image of it) 1.13-1.22x (docs/benchmarks.md 2b). Pixels within 2 levels of PIL's (the same bicubic
    antialiasing, rounded elsewhere; tests/test_worker_transform.py)."""

    decode = staticmethod(decode_tensor)

    def __init__(self, ops: list[Callable[[Tensor], Tensor]]) -> None:
        self.ops = ops

    def __call__(self, image: Tensor) -> Tensor:
        for op in self.ops:
            image = op(image)
        return image

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.ops})"


class _OnTensors:
    """One op of timm's transform (`op`: its parameters and draws) as run on tensors."""

    def __init__(self, op: Any) -> None:
        self.op = op

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.op})"


class _ResizedCrop(_OnTensors):
    """timm's RandomResizedCropAndInterpolation: its own crop draw, torchvision's v2 resize."""

    def __call__(self, image: Tensor) -> Tensor:
        from torchvision.transforms.v2 import functional as F

        i, j, h, w = self.op.get_params(image, self.op.scale, self.op.ratio)
        return F.resized_crop(image, i, j, h, w, list(self.op.size), self.op.interpolation, antialias=True)


class _Resize(_OnTensors):
    """torchvision's Resize (the evaluation resize timm builds) through the v2 kernel."""

    def __call__(self, image: Tensor) -> Tensor:
        from torchvision.transforms.v2 import functional as F

        size = [self.op.size] if isinstance(self.op.size, int) else list(self.op.size)
        return F.resize(image, size, self.op.interpolation, max_size=self.op.max_size, antialias=True)


class _OnPil(_OnTensors):
    """The ops after the crop that need PIL images (an auto-augment policy, colour jitter): the cropped tensor
    to a PIL image and back (~0.1 ms at 224 px); the resize before them, the costly part, stays on tensors.
    The same ops in the same order draw what they draw on the PIL path."""

    def __call__(self, image: Tensor) -> Tensor:
        from torchvision.transforms.functional import pil_to_tensor, to_pil_image

        pil = to_pil_image(image)
        for op in self.op:
            pil = op(pil)
        return pil_to_tensor(pil)


def on_tensors(transform: Any) -> TensorPipeline | None:
    """`transform` (timm's Compose) as a TensorPipeline: its resize and crop (and flips) on tensors, the ops
    after them that need PIL images (auto-augment, colour jitter) on a PIL image of the cropped result. None
    where the first op has no tensor form here: timm's 'random' interpolation (the mode drawn per image), a
    resize torchvision's tensor kernels lack (box, hamming, lanczos), or a transform of your own."""
    from timm.data.transforms import MaybePILToTensor, RandomResizedCropAndInterpolation
    from torchvision import transforms as T
    from torchvision.transforms import InterpolationMode

    resizes = (InterpolationMode.NEAREST, InterpolationMode.BILINEAR, InterpolationMode.BICUBIC)
    ops: list[Callable[[Tensor], Tensor]] = []
    steps = [op for op in getattr(transform, "transforms", [None]) if not isinstance(op, MaybePILToTensor)]
    for i, op in enumerate(steps):
        if type(op) is RandomResizedCropAndInterpolation and op.interpolation in resizes:
            ops.append(_ResizedCrop(op))
        elif type(op) is T.Resize and op.interpolation in resizes:
            ops.append(_Resize(op))
        elif type(op) in (T.CenterCrop, T.RandomHorizontalFlip, T.RandomVerticalFlip):
            ops.append(op)  # torchvision's, for tensors as for PIL images
        elif i == 0:
            return None
        else:
            ops.append(_OnPil(steps[i:]))
            break
    return TensorPipeline(ops)


def decode_file(transform: Any, path: str) -> Tensor:
    """An image file through an evaluation `transform` (no random draw: nothing to seed)."""
    return transform(decode_for(transform, Path(path).read_bytes()))


def decode_for(transform: Any, data: bytes) -> Any:
    """The image `transform` takes: a tensor for a TensorPipeline, else a PIL image (a `build_transform` of
    your own, or timm's with a resize that has no tensor form here)."""
    return transform.decode(data) if isinstance(transform, TensorPipeline) else decode_pil(data)
