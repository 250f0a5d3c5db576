"""Decode a batch of JPEGs on the GPU (nvJPEG via `torchvision.io.decode_jpeg(list, device="cuda")`) and
augment it there: random-resized crop and flip per image, then normalise as one batch.

Where many CPU loader workers cannot keep a fast GPU fed (ImageNet at 224 px needs ~1-2k images/s per GPU),
decoding is the largest CPU cost per image; nvJPEG moves it to the GPU. It runs in the training process
(`StreamingDataModule.on_before_batch_transfer`), the workers only read bytes. Images that are not JPEG
(PNG, WebP) are decoded on the CPU and moved. The same code runs with `device="cpu"` (tests).
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

from vitrain.data.augment import to_device, to_model_input

JPEG_MAGIC = (0xFF, 0xD8)


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


class GpuDecoder:
    """list of encoded images (uint8 1-D CPU tensors) -> normalised float [B,3,S,S] on `device`."""

    def __init__(
        self,
        img_size: int,
        mean: Sequence[float],
        std: Sequence[float],
        hflip: float = 0.5,
        device: str | torch.device = "cuda",
        seed: int | None = None,
    ) -> None:
        self.img_size, self.mean, self.std, self.hflip = img_size, tuple(mean), tuple(std), hflip
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(random.randrange(2**62) if seed is None else seed)

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

    def __call__(self, blobs: list[Tensor], train: bool = True) -> Tensor:
        images = self.decode(blobs)
        s = self.img_size
        crops = []
        for img in images:
            _, h, w = img.shape
            if train:
                top, left, ch, cw = rrc_box(h, w, self.generator)
            else:  # the centred square of the short side
                side = min(h, w)
                top, left, ch, cw = (h - side) // 2, (w - side) // 2, side, side
            crop = img[None, :, top : top + ch, left : left + cw].float()
            crops.append(
                F.interpolate(crop, size=(s, s), mode="bilinear", align_corners=False, antialias=True)
            )
        x = torch.cat(crops).clamp_(0, 255)
        if train and self.hflip > 0:
            flip = to_device(torch.rand(len(images), generator=self.generator) < self.hflip, self.device)
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        return to_model_input(x, s, self.mean, self.std)


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
