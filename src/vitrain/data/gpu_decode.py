"""Decode a batch of JPEGs on the GPU (nvJPEG via `torchvision.io.decode_jpeg(list, device="cuda")`) and
augment it there: random-resized crop and flip per image, then normalise as one batch.

Where many CPU loader workers cannot keep a fast GPU fed (ImageNet at 224 px needs ~1-2k images/s per GPU),
decoding is the largest CPU cost per image; nvJPEG moves it to the GPU. It runs in the training process
(the datamodules' `on_before_batch_transfer`, `datamodule.decode_device=cuda`), the workers read bytes.
Images that are not JPEG (PNG, WebP) are decoded on the CPU and moved. The same code runs with
`device="cpu"` (tests).

The loader workers also draw each training image's crop box and flip (`encoded_sample`: `draw_crop` from the
sample's (seed, epoch, index) seed and the size in the image's header, no pixel decoded) and send them with
the bytes (`EncodedBatch`), for image folders and streaming shards alike: the crops do not depend on ranks,
workers or a resume, and the training thread draws nothing per image.

Crop, resize and flip are one batched computation (`resize_crops`), not a loop over the images: an
antialiased bilinear resize is separable, so each image's output is Wy @ img @ Wx^T per channel, with the
crop box folded into the weights (zero outside it) and a flip into the order of Wx's rows. The weights of
the whole batch are built in a few tensor ops and applied with three batched matmuls, so the kernels and the
host time per batch do not grow with the batch beyond the decode and the copies that pad the images to one
size. The per-image loop it replaces (a slice and an `F.interpolate(antialias=True)` per image) cost ~30 ms
of host time per 384-image batch on an H100, 2/3 of the whole call (nvJPEG's decode took 14 ms), on the
training thread, while the GPU waited for it.
"""

from __future__ import annotations

import io
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.io import ImageReadMode, decode_jpeg

from vitrain.data.augment import BatchTransform, RandomAugment, to_device, to_model_input
from vitrain.data.transforms import (
    decode_tensor,
    exif_orientation,
    header_orientation,
    orient,
    oriented_size,
)
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


def encoded_sample(
    data: bytes, seed: int, hflip: float, index: int
) -> tuple[Tensor, tuple[int, int, int, int], bool, int, int]:
    """A training sample for the GPU decoder, made in a loader worker: the encoded bytes as a uint8 tensor,
    with the crop box and flip of `draw_crop(h, w, seed, hflip)`, (h, w) the upright size read from the
    image's header (PIL parses it, with the EXIF orientation, which nvJPEG does not apply: the decoder turns
    the image with it; no pixel is decoded here), the sample's `index` in its dataset (to name it should its
    pixels not decode), and the orientation. Bytes PIL cannot identify raise PIL's error: the caller names
    the sample."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        w, h = img.size
        orientation = header_orientation(img)
    box, flip = draw_crop(*oriented_size(h, w, orientation), seed, hflip)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), box, flip, index, orientation


class EncodedBatch(NamedTuple):
    """A training batch for the GPU decoder as loader workers hand it over: the encoded images packed into
    one uint8 buffer (one shared-memory block and one pinned copy per batch, not one per image), their byte
    lengths, the crop box (top, left, height, width, in the upright image) and flip drawn for each, each
    one's index in its dataset and its EXIF orientation."""

    data: Tensor  # uint8 [sum of lengths]
    lengths: Tensor  # int64 [B]
    boxes: Tensor  # int64 [B,4]
    flips: Tensor  # bool [B]
    indices: Tensor  # int64 [B]
    orientations: Tensor  # int64 [B]: EXIF, 1 (as stored) to 8

    def blobs(self) -> list[Tensor]:
        """Each image's bytes: views into `data`, no copy."""
        return list(self.data.split(self.lengths.tolist()))


def collate_encoded(
    batch: list[tuple[tuple[Tensor, tuple[int, ...], bool, int, int], int]],
) -> tuple[EncodedBatch, Tensor]:
    """((bytes, box, flip, index, orientation), label) samples -> (EncodedBatch, labels); module-level so
    workers can pickle it."""
    samples, labels = zip(*batch, strict=True)
    data, boxes, flips, indices, orientations = zip(*samples, strict=True)
    encoded = EncodedBatch(
        torch.cat(data),
        torch.tensor([len(d) for d in data], dtype=torch.long),
        torch.tensor(boxes, dtype=torch.long),
        torch.tensor(flips, dtype=torch.bool),
        torch.tensor(indices, dtype=torch.long),
        torch.tensor(orientations, dtype=torch.long),
    )
    return encoded, torch.tensor(labels, dtype=torch.long)


class UndecodableImage(DataError):
    """An image whose header reads but whose pixels do not decode (a damaged file): its place in the batch,
    for the datamodule to name the file or sample (`decode_batch`)."""

    def __init__(self, position: int, reason: str) -> None:
        super().__init__(f"image {position} of the batch cannot be decoded ({reason})")
        self.position, self.reason = position, reason


def decode_batch(
    decoder: GpuDecoder, batch: EncodedBatch, undecodable: Callable[[int, str], DataError]
) -> Tensor:
    """A training batch from the loader workers, decoded and augmented as they drew it; a damaged image
    raises `undecodable(its index in the dataset, the decoder's reason)`: one line that names it."""
    return decoder.finish(crop_batch(decoder, batch, undecodable), train=True)


def crop_batch(
    decoder: GpuDecoder, batch: EncodedBatch, undecodable: Callable[[int, str], DataError]
) -> Tensor:
    """`decode_batch` up to the crops (decoded, cropped, resized, flipped; float 0-255): the part that draws
    nothing, which a thread of its own may run ahead (vitrain/data/decode_ahead.py)."""
    try:
        return decoder.crops(batch.blobs(), batch.boxes, batch.flips, batch.orientations)
    except UndecodableImage as err:
        raise undecodable(int(batch.indices[err.position]), err.reason) from None


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


# Padded images converted to float at once, in elements: 2**28 floats (1 GiB). A batch of photos fits (384 of
# 500 x 500 px after padding: 288M, just over; 256 of them: 192M); one with a few huge images among them is
# resized in chunks of consecutive images, so the padding to the largest stays bounded.
MAX_PADDED = 2**28


def resize_weights(
    start: Tensor, length: Tensor, size: int, n_src: int, flip: Tensor | None = None
) -> Tensor:
    """Antialiased bilinear resampling weights along one axis, float32 [B, size, n_src]: row i of image b
    holds the weights of its output pixel i over source pixels 0..n_src-1, zero outside its crop
    [start, start + length) (int [B] tensors, on the device that gets the weights).

    The weights of `F.interpolate(crop, mode="bilinear", antialias=True, align_corners=False)` (aten's
    `_compute_weights_aa`, after PIL's ImagingResample): scale = length / size; output pixel i is centred at
    (i + 0.5) * scale in the crop; the triangle filter max(0, 1 - |d|) is stretched by max(scale, 1) (wider
    when shrinking: the antialiasing); source pixel j (centre j + 0.5) weighs filter((j + 0.5 - centre) /
    max(scale, 1)); a row sums to 1. `flip` (bool [B]): that image's rows in reverse order, its output
    mirrored."""
    device = start.device
    length = length.to(torch.float32)
    scale = (length / size)[:, None, None]  # crop pixels per output pixel, [B,1,1]
    invscale = 1.0 / scale.clamp(min=1.0)
    i = torch.arange(size, device=device, dtype=torch.float32)
    if flip is not None:
        i = torch.where(flip[:, None], size - 1 - i, i)  # [B,S]
    center = scale * (i[..., None] + 0.5)  # [B,S,1]
    src = torch.arange(n_src, device=device, dtype=torch.float32) - start[:, None]  # crop coordinates, [B,N]
    # outside the crop (the rest of the image and the padding): an infinite distance, a weight of 0
    src = torch.where((src >= 0) & (src < length[:, None]), src, math.inf)
    w = (src[:, None, :] - center).add_(0.5).mul_(invscale).abs_().neg_().add_(1.0).clamp_(min=0.0)
    return w.div_(w.sum(-1, keepdim=True))


def resize_crops(images: list[Tensor], boxes: Tensor, size: int, flips: Tensor | None = None) -> Tensor:
    """Each image's crop box resized to size x size (bilinear, antialiased) and mirrored where `flips`:
    float32 0..255 [B,3,size,size] on the images' device, what a slice, `F.interpolate(mode="bilinear",
    antialias=True, align_corners=False)` and `flip(-1)` per image give (to float rounding), in a few
    batched ops.

    `images` uint8 [3,h,w], any sizes; `boxes` int [B,4] (top, left, height, width) and `flips` bool [B] or
    None, on the CPU (one copy to the device for both). A box reaching past its image's edge is cut at it, as
    a slice cuts it; one that leaves nothing is refused.

    The resize is separable: out = Wy @ img @ Wx^T per channel (`resize_weights`: the crop is folded into the
    weights, the flip into Wx's row order), as three batched matmuls over the images padded to one size
    (one `torch.stack` when all have the same size, a copy per image when not; the padding's values never
    matter, its weights are 0).

    Costs, B=384 images padded to 500 x 500, S=224: the float copy of the batch 1.15 GB (2 chunks under
    MAX_PADDED), Wy and Wx 172 MB each, the rows resized 516 MB, the output 231 MB; 2·B·3·H·S·(W + S) =
    187 GFLOP (400 x 350: 118 GFLOP), ~3-4 ms at an H100's fp32 rate and under 1 ms as TF32 (estimates, not
    measured). Dense matmuls do 50-100x the multiply-adds of a banded resize: nothing to a GPU, much to a
    CPU (the decoder on `device="cpu"`, tests: 384 photos of 400 x 350 px in 1.2 s, the per-image loop 0.5 s).

    The matmuls run at torch's float32 matmul precision, left alone here (process-wide state): in IEEE fp32
    the pixels are the per-image resize's to ~1e-4 of a level; under TF32 (training on GPUs sets it,
    `training.use_tensor_cores_for_fp32`) the operands round to a 10-bit mantissa: 0.03 of a level (of 255)
    off on average, ~0.2 at most (emulated on the CPU), where nvJPEG's pixels differ from libjpeg's by ~1.
    """
    device = images[0].device
    sizes = torch.tensor([tuple(img.shape[-2:]) for img in images], dtype=torch.long)  # [B,2] (h, w)
    boxes = boxes.to("cpu", torch.long)
    corner = boxes[:, :2]
    extent = torch.minimum(boxes[:, 2:], sizes - corner)  # cut at the image's edge, as a slice does
    if bool((corner < 0).any()) or bool((extent <= 0).any()):
        bad = int(((corner < 0).any(1) | (extent <= 0).any(1)).nonzero()[0])
        raise DataError(
            f"crop box {boxes[bad].tolist()} (top, left, height, width) is outside its image of "
            f"{sizes[bad].tolist()} px"
        )
    columns = [corner, extent] if flips is None else [corner, extent, flips.to("cpu", torch.long)[:, None]]
    params = to_device(torch.cat(columns, 1), device)  # one copy: [B, 4 or 5]
    chunks, first, hmax, wmax = [], 0, 0, 0  # consecutive images whose padded float copy fits MAX_PADDED
    for k, (h, w) in enumerate(sizes.tolist()):
        hnew, wnew = max(hmax, h), max(wmax, w)
        if k > first and (k + 1 - first) * 3 * hnew * wnew > MAX_PADDED:
            chunks.append((first, k, hmax, wmax))
            first, hnew, wnew = k, h, w
        hmax, wmax = hnew, wnew
    chunks.append((first, len(images), hmax, wmax))
    out = [_resize_chunk(images[a:b], params[a:b], size, h, w) for a, b, h, w in chunks]
    return out[0] if len(out) == 1 else torch.cat(out)


def _resize_chunk(images: list[Tensor], params: Tensor, size: int, h: int, w: int) -> Tensor:
    """`resize_crops` for images padded to h x w; `params` [B,4|5] on their device."""
    n = len(images)
    if all(img.shape == images[0].shape for img in images):
        x = torch.stack(images)
    else:
        x = images[0].new_empty((n, 3, h, w))  # uint8: whatever it holds is finite, and weighs 0
        for dst, img in zip(x.unbind(0), images, strict=True):
            dst[:, : img.shape[-2], : img.shape[-1]].copy_(img)
    x = x.float()
    flip = params[:, 4].bool() if params.shape[1] > 4 else None
    wy = resize_weights(params[:, 0], params[:, 2], size, h)  # [B,S,H]
    wx = resize_weights(params[:, 1], params[:, 3], size, w, flip)  # [B,S,W]
    rows = torch.bmm(x.view(n, 3 * h, w), wx.transpose(1, 2)).view(n, 3, h, size)  # every row resized
    out = x.new_empty((n, 3, size, size))
    for c in range(3):  # Wy @ rows per channel, written in place (a broadcast matmul would copy Wy 3 times)
        torch.bmm(wy, rows[:, c], out=out[:, c])
    return out.clamp_(0, 255)


class GpuDecoder:
    """list of encoded images (uint8 1-D CPU tensors) -> normalised float [B,3,S,S] on `device`.

    Training: each image's random-resized crop and flip as the loader workers drew them (`boxes`, `flips`,
    from `encoded_sample`); then, when asked for, `auto_augment` (augment.py's RandAugment/TrivialAugment on
    the uint8 crops) and random erasing after normalisation, both drawing from the global generators as the
    in-memory path does. Evaluation: the centred square of the short side."""

    def __init__(
        self,
        img_size: int,
        mean: Sequence[float],
        std: Sequence[float],
        device: str | torch.device = "cuda",
        auto_augment: str | None = None,
        re_prob: float = 0.0,
    ) -> None:
        self.img_size, self.mean, self.std = img_size, tuple(mean), tuple(std)
        self.device = torch.device(device)
        self.augment = None
        if auto_augment or re_prob > 0:
            self.augment = BatchTransform(
                img_size, self.mean, self.std, crop_padding=0, hflip=False, auto_augment=auto_augment,
                re_prob=float(re_prob),
            )  # fmt: skip

    def decode(self, blobs: list[Tensor], orientations: Tensor | None = None) -> list[Tensor]:
        """Each image decoded on the device, upright: turned by the EXIF orientation the workers read from its
        header (`orientations`; None: read here), which nvJPEG does not apply; other formats decode as on the
        CPU path, then turn alike."""
        jpeg = [i for i, b in enumerate(blobs) if is_jpeg(b)]
        out: list[Tensor | None] = [None] * len(blobs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torchvision 0.29: "use TorchCodec"
            if jpeg:
                try:
                    decoded = decode_jpeg(
                        [blobs[i] for i in jpeg], mode=ImageReadMode.RGB, device=self.device
                    )
                except RuntimeError as err:  # one damaged image fails the batch: find it
                    raise self._undecodable(blobs, jpeg, err) from None
                for i, img in zip(jpeg, decoded, strict=True):
                    out[i] = img
            for i, blob in enumerate(blobs):
                if out[i] is None:  # PNG, WebP, GIF by torchvision, the rest by PIL, as the CPU path decodes
                    try:
                        image = decode_tensor(blob.numpy().tobytes(), upright=False)
                    except (RuntimeError, OSError, ValueError) as err:  # PIL's UnidentifiedImageError
                        raise UndecodableImage(i, _reason(err)) from None
                    out[i] = to_device(image, self.device)
        # upright by the orientation the workers read from each header (their crop boxes are in it)
        if orientations is None:
            orientations = torch.tensor([exif_orientation(b.numpy().tobytes()) for b in blobs])
        return [orient(img, o) for img, o in zip(out, orientations.tolist(), strict=True)]  # type: ignore[arg-type]

    def _undecodable(self, blobs: list[Tensor], jpeg: list[int], err: RuntimeError) -> Exception:
        """The first image of a failed batch decode that fails alone (error path only: one decode each), or
        the batch's error when none does."""
        for i in jpeg:
            try:
                decode_jpeg(blobs[i], mode=ImageReadMode.RGB, device=self.device)
            except RuntimeError as single:
                return UndecodableImage(i, _reason(single))
        return err

    def __call__(
        self,
        blobs: list[Tensor],
        train: bool = True,
        boxes: Tensor | None = None,
        flips: Tensor | None = None,
    ) -> Tensor:
        """`boxes` int [B,4] (top, left, height, width) and `flips` bool [B] or None, on the CPU: each image's
        crop and flip, drawn by the loader workers (training needs them: nothing is drawn here); evaluation
        without boxes: the centred square of the short side, no flip."""
        if train and boxes is None:
            raise ValueError("training crops come with the batch: pass each image's box (encoded_sample)")
        return self.finish(self.crops(blobs, boxes, flips), train)

    def crops(
        self,
        blobs: list[Tensor],
        boxes: Tensor | None,
        flips: Tensor | None = None,
        orientations: Tensor | None = None,
    ) -> Tensor:
        """Decoded upright, cropped to `boxes` (None: each image's centred square), resized, flipped: float
        [B,3,S,S] in 0-255. Draws nothing."""
        images = self.decode(blobs, orientations)
        if boxes is None:
            boxes = torch.tensor([centred_square(*img.shape[-2:]) for img in images])
        return resize_crops(images, boxes, self.img_size, flips)

    def finish(self, x: Tensor, train: bool) -> Tensor:
        """Crops -> model input: the random augmentation in training (from the global generators), then the
        normalisation."""
        if train and self.augment is not None:
            return self.augment(x.round_().to(torch.uint8), train=True)
        return to_model_input(x, self.img_size, self.mean, self.std)


def _reason(err: Exception) -> str:
    """torchvision's decode error without its source location ("decode_jpeg, .../decode_jpeg.cpp:171, Image
    is incomplete or truncated" -> "Image is incomplete or truncated")."""
    text = " ".join(str(err).split())
    return text.rsplit(".cpp:", 1)[-1].split(", ", 1)[-1] if ".cpp:" in text else text


def centred_square(h: int, w: int) -> tuple[int, int, int, int]:
    """The box (top, left, height, width) of the centred square of the short side."""
    side = min(h, w)
    return (h - side) // 2, (w - side) // 2, side, side


def check(device: str = "cuda", n: int = 256, size: int = 224) -> dict[str, float]:
    """For `make gpu-check`: decode `n` JPEGs of `size` px on `device` and on the CPU, compare the pixels
    (nvJPEG and libjpeg may differ by rounding); compare the batched crop + resize + flip (`resize_crops`)
    with a slice, `F.interpolate` and flip per image on `device`, on images of mixed sizes (0.5-2.5x `size`:
    up- and downscaled crops); time the batch decode + augmentation (one batched resize) on `device` and on
    the CPU."""
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
    on_device = GpuDecoder(size, (0.5,) * 3, (0.5,) * 3, device=device)
    cpu = GpuDecoder(size, (0.5,) * 3, (0.5,) * 3, device="cpu")
    diff = max(
        (a.cpu().float() - b.float()).abs().mean().item()
        for a, b in zip(on_device.decode(blobs[:8]), cpu.decode(blobs[:8]), strict=True)
    )
    g = torch.Generator().manual_seed(0)
    shapes = torch.randint(size // 2, size * 5 // 2, (32, 2), generator=g).tolist()
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g).to(device) for h, w in shapes]
    boxes = torch.tensor([rrc_box(h, w, g) for h, w in shapes])
    flips = torch.rand(len(images), generator=g) < 0.5
    batched = resize_crops(images, boxes, size, flips)
    resize_diff = 0.0
    for img, (top, left, ch, cw), flip, row in zip(images, boxes.tolist(), flips, batched, strict=True):
        crop = img[None, :, top : top + ch, left : left + cw].float()
        one = F.interpolate(crop, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        one = one[0].clamp(0, 255).flip(-1) if flip else one[0].clamp(0, 255)
        resize_diff = max(resize_diff, (one - row).abs().max().item())
    drawn = [draw_crop(size, size, i) for i in range(n)]  # as the loader workers draw them
    boxes = torch.tensor([box for box, _ in drawn])
    flips = torch.tensor([flip for _, flip in drawn])
    rates = {}
    for name, decoder in (("device", on_device), ("cpu", cpu)):
        decoder(blobs[:8], boxes=boxes[:8], flips=flips[:8])  # warm-up (nvJPEG handles, kernels)
        if decoder.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        decoder(blobs, train=True, boxes=boxes, flips=flips)
        if decoder.device.type == "cuda":
            torch.cuda.synchronize()
        rates[name] = n / (time.perf_counter() - t)
    return {
        "mean_abs_pixel_diff": diff,
        "resize_max_abs_diff": resize_diff,
        "device_images_per_s": rates["device"],
        "cpu_images_per_s": rates["cpu"],
    }


if __name__ == "__main__":  # python -m vitrain.data.gpu_decode [device]
    import sys

    result = check(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    ok = result["mean_abs_pixel_diff"] < 3.0 and result["resize_max_abs_diff"] < 0.5
    print(
        f"gpu decode: {'ok' if ok else 'FAILED'}: mean |pixel diff| vs CPU {result['mean_abs_pixel_diff']:.2f}, "
        f"batched crop+resize vs per image max |diff| {result['resize_max_abs_diff']:.2g} (of 255), "
        f"decode+augment {result['device_images_per_s']:.0f} images/s on the device, {result['cpu_images_per_s']:.0f} on the CPU"
    )
    sys.exit(0 if ok else 1)
