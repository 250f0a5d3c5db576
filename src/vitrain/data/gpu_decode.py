"""Decode a batch of JPEGs on the GPU (nvJPEG via `torchvision.io.decode_jpeg(list, device="cuda")`) and
augment it there: random-resized crop and flip per image, then normalise as one batch.

Where many CPU loader workers cannot keep a fast GPU fed (ImageNet at 224 px needs ~1-2k images/s per GPU),
decoding is the largest CPU cost per image; nvJPEG moves it to the GPU. It runs in the training process
(the datamodules' `on_before_batch_transfer`, `datamodule.decode_device=cuda`), the workers only read bytes.
Images that are not JPEG (PNG, WebP) are decoded on the CPU and moved. The same code runs with
`device="cpu"` (tests).

Streaming shards draw each crop and flip here, from a generator per rank. An image folder's workers draw
them instead (`draw_crop`, from the sample's (seed, epoch, index) seed and the size in the file's header) and
send them with the bytes (`EncodedBatch`), so its crops do not depend on ranks, workers or a resume.
"""

from __future__ import annotations

import logging
import math
import random
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

from vitrain.data.augment import BatchTransform, RandomAugment, to_device, to_model_input
from vitrain.errors import DataError

log = logging.getLogger(__name__)

JPEG_MAGIC = (0xFF, 0xD8)
DECODE_DEVICES = ("cpu", "cuda")


def is_jpeg(data: Tensor) -> bool:
    return data.numel() > 2 and int(data[0]) == JPEG_MAGIC[0] and int(data[1]) == JPEG_MAGIC[1]


def rrc_box(
    h: int, w: int, generator: torch.Generator, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params (top, left, height, width), drawn from `generator`."""
    area = h * w
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * torch.empty(1).uniform_(*scale, generator=generator).item()
        aspect = math.exp(torch.empty(1).uniform_(*log_ratio, generator=generator).item())
        cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            top = int(torch.randint(0, h - ch + 1, (1,), generator=generator))
            left = int(torch.randint(0, w - cw + 1, (1,), generator=generator))
            return top, left, ch, cw
    in_ratio = w / h  # fallback: central crop at the clamped ratio
    if in_ratio < ratio[0]:
        cw, ch = w, round(w / ratio[0])
    elif in_ratio > ratio[1]:
        ch, cw = h, round(h * ratio[1])
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def draw_crop(h: int, w: int, seed: int, hflip: float = 0.5) -> tuple[tuple[int, int, int, int], bool]:
    """One image's random-resized-crop box (`rrc_box`) and flip, drawn from a generator of its own seeded
    with `seed` (a loader worker passes the sample's `sample_seed(seed, epoch, index)`): the same wherever and
    whenever it is drawn, and no global generator moves."""
    generator = torch.Generator().manual_seed(seed)
    box = rrc_box(h, w, generator)
    return box, hflip > 0 and bool(torch.rand(1, generator=generator) < hflip)


class EncodedBatch(NamedTuple):
    """A training batch for the GPU decoder as loader workers hand it over: the encoded images packed into
    one uint8 buffer (one shared-memory block and one pinned copy per batch, not one per image), their byte
    lengths, and the crop box (top, left, height, width) and flip drawn for each."""

    data: Tensor  # uint8 [sum of lengths]
    lengths: Tensor  # int64 [B]
    boxes: Tensor  # int64 [B,4]
    flips: Tensor  # bool [B]

    def blobs(self) -> list[Tensor]:
        """Each image's bytes: views into `data`, no copy."""
        return list(self.data.split(self.lengths.tolist()))


def collate_encoded(
    batch: list[tuple[tuple[Tensor, tuple[int, ...], bool], int]],
) -> tuple[EncodedBatch, Tensor]:
    """((bytes, box, flip), label) samples -> (EncodedBatch, labels); module-level so workers can pickle it."""
    samples, labels = zip(*batch, strict=True)
    data, boxes, flips = zip(*samples, strict=True)
    encoded = EncodedBatch(
        torch.cat(data),
        torch.tensor([len(d) for d in data], dtype=torch.long),
        torch.tensor(boxes, dtype=torch.long),
        torch.tensor(flips, dtype=torch.bool),
    )
    return encoded, torch.tensor(labels, dtype=torch.long)


def check_decode_device(value: Any) -> None:
    if value not in DECODE_DEVICES:
        raise DataError(f"datamodule.decode_device={value!r}: choose cpu or cuda")


def check_augment(auto_augment: str | None, re_prob: float) -> None:
    """decode_device=cuda runs auto_augment and random erasing on the decoded batch (augment.py's batch ops);
    a policy those ops do not have is refused in one line."""
    if auto_augment:
        try:
            RandomAugment.from_name(auto_augment)
        except DataError as e:
            raise DataError(
                f"{e}: with datamodule.decode_device=cuda the policy runs on the GPU, which has rand-m9-n2-mstd0.5 "
                "(RandAugment) and trivial; for timm's other policies set datamodule.decode_device=cpu"
            ) from None
    if isinstance(re_prob, bool) or not isinstance(re_prob, int | float) or not 0 <= re_prob <= 1:
        raise DataError(f"datamodule.re_prob={re_prob!r} must be between 0 and 1")


def gpu_decode_device(setting: str, trainer: Any) -> torch.device | None:
    """The device that decodes training batches under `datamodule.decode_device=setting`: this process's GPU,
    or None (loader workers decode): `cpu`, or no CUDA device in this process (one warning)."""
    if setting != "cuda":
        return None
    device = trainer.strategy.root_device if trainer is not None else torch.device("cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        log.warning(
            "datamodule.decode_device=cuda: no CUDA device in this process, decoding on the CPU instead"
        )
        return None
    return device


class GpuDecoder:
    """list of encoded images (uint8 1-D CPU tensors) -> normalised float [B,3,S,S] on `device`.

    Training: a random-resized crop and flip per image, drawn from the decoder's own generator or given per
    image (`boxes`, `flips`); then, when asked for, `auto_augment` (augment.py's RandAugment/TrivialAugment on
    the uint8 crops) and random erasing after normalisation, both drawing from the global generators as the
    in-memory path does. Evaluation: the centred square of the short side."""

    def __init__(
        self,
        img_size: int,
        mean: Sequence[float],
        std: Sequence[float],
        hflip: float = 0.5,
        device: str | torch.device = "cuda",
        seed: int | None = None,
        auto_augment: str | None = None,
        re_prob: float = 0.0,
    ) -> None:
        self.img_size, self.mean, self.std, self.hflip = img_size, tuple(mean), tuple(std), hflip
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(random.randrange(2**62) if seed is None else seed)
        self.augment = None
        if auto_augment or re_prob > 0:
            self.augment = BatchTransform(
                img_size, self.mean, self.std, crop_padding=0, hflip=False, auto_augment=auto_augment,
                re_prob=float(re_prob),
            )  # fmt: skip

    def decode(self, blobs: list[Tensor]) -> list[Tensor]:
        jpeg = [i for i, b in enumerate(blobs) if is_jpeg(b)]
        out: list[Tensor | None] = [None] * len(blobs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torchvision 0.29: "use TorchCodec"
            if jpeg:
                decoded = decode_jpeg([blobs[i] for i in jpeg], mode=ImageReadMode.RGB, device=self.device)
                for i, img in zip(jpeg, decoded, strict=True):
                    out[i] = img
            for i, blob in enumerate(blobs):
                if out[i] is None:
                    out[i] = to_device(decode_image(blob, mode=ImageReadMode.RGB), self.device)
        return out  # type: ignore[return-value]

    def __call__(
        self,
        blobs: list[Tensor],
        train: bool = True,
        boxes: Tensor | None = None,
        flips: Tensor | None = None,
    ) -> Tensor:
        """`boxes` int [B,4] (top, left, height, width) and `flips` bool [B], on the CPU: each image's crop and
        flip drawn elsewhere; None: drawn here (training) or the centred square and no flip (evaluation)."""
        images = self.decode(blobs)
        if boxes is not None:
            crop_boxes = [tuple(b) for b in boxes.tolist()]
        else:
            crop_boxes = [self._box(img.shape[-2], img.shape[-1], train) for img in images]
        x = self._crops(images, crop_boxes)
        if flips is None and train and self.hflip > 0:
            flips = torch.rand(len(images), generator=self.generator) < self.hflip
        if flips is not None:
            x = torch.where(to_device(flips, self.device)[:, None, None, None], x.flip(-1), x)
        if train and self.augment is not None:
            return self.augment(x.round_().to(torch.uint8), train=True)
        return to_model_input(x, self.img_size, self.mean, self.std)

    def _box(self, h: int, w: int, train: bool) -> tuple[int, int, int, int]:
        if train:
            return rrc_box(h, w, self.generator)
        side = min(h, w)  # the centred square of the short side
        return (h - side) // 2, (w - side) // 2, side, side

    def _crops(self, images: list[Tensor], boxes: list[tuple[int, ...]]) -> Tensor:
        """Each image's box resized to S x S (bilinear, antialiased), float 0..255 [B,3,S,S]."""
        s = self.img_size
        crops = []
        for img, (top, left, ch, cw) in zip(images, boxes, strict=True):
            crop = img[None, :, top : top + ch, left : left + cw].float()
            crops.append(
                F.interpolate(crop, size=(s, s), mode="bilinear", align_corners=False, antialias=True)
            )
        return torch.cat(crops).clamp_(0, 255)


def check(device: str = "cuda", n: int = 256, size: int = 224) -> dict[str, float]:
    """For `make gpu-check`: decode `n` JPEGs of `size` px on `device` and on the CPU, compare the pixels
    (nvJPEG and libjpeg may differ by rounding) and time the batch decode + augmentation."""
    import time

    from torchvision.io import encode_jpeg

    ramp = torch.linspace(0, 255, size)
    base = torch.stack(
        [
            ramp[None, :].expand(size, size),
            ramp[:, None].expand(size, size),
            ramp.flip(0)[None].expand(size, size),
        ]
    )
    blobs = [encode_jpeg(((base + 7 * i) % 256).to(torch.uint8), quality=90) for i in range(n)]
    on_device = GpuDecoder(size, (0.5,) * 3, (0.5,) * 3, device=device, seed=0)
    cpu = GpuDecoder(size, (0.5,) * 3, (0.5,) * 3, device="cpu", seed=0)
    diff = max(
        (a.cpu().float() - b.float()).abs().mean().item()
        for a, b in zip(on_device.decode(blobs[:8]), cpu.decode(blobs[:8]), strict=True)
    )
    rates = {}
    for name, decoder in (("device", on_device), ("cpu", cpu)):
        decoder(blobs[:8])  # warm-up (nvJPEG handles, kernels)
        if decoder.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        decoder(blobs, train=True)
        if decoder.device.type == "cuda":
            torch.cuda.synchronize()
        rates[name] = n / (time.perf_counter() - t)
    return {
        "mean_abs_pixel_diff": diff,
        "device_images_per_s": rates["device"],
        "cpu_images_per_s": rates["cpu"],
    }


if __name__ == "__main__":  # python -m vitrain.data.gpu_decode [device]
    import sys

    result = check(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    ok = result["mean_abs_pixel_diff"] < 3.0
    print(
        f"gpu decode: {'ok' if ok else 'FAILED'}: mean |pixel diff| vs CPU {result['mean_abs_pixel_diff']:.2f}, "
        f"decode+augment {result['device_images_per_s']:.0f} images/s on the device, {result['cpu_images_per_s']:.0f} on the CPU"
    )
    sys.exit(0 if ok else 1)
