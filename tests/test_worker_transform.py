"""The loader workers' per-sample transform on uint8 tensors (`vitrain.data.transforms.on_tensors`): the same
crop and flip as timm's transform on PIL images for the same per-sample seed, pixels within rounding, every
image format the PIL path reads, and PIL's path wherever an op needs PIL images."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision.transforms.functional import pil_to_tensor

from vitrain.data.sampling import sample_seed, seeded_sample
from vitrain.data.transforms import (
    TensorPipeline,
    decode_for,
    decode_pil,
    decode_tensor,
    on_tensors,
    timm_transform,
)

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


@pytest.fixture(scope="module")
def photos(real_cifar10_cache: tuple[Path, Path]) -> list[bytes]:
    """16 real CIFAR-10 training JPEGs upscaled to photo-like sizes (landscape and portrait), JPEG quality 90."""
    _, archive = real_cifar10_cache
    out: list[bytes] = []
    with tarfile.open(archive, "r|gz") as tar:  # the first files of the stream: no full unpacking
        for member in tar:
            if member.isfile() and "/train/" in f"/{member.name}" and member.name.endswith(".jpg"):
                image = Image.open(io.BytesIO(tar.extractfile(member).read())).convert("RGB")
                size = (120, 96) if len(out) % 2 else (80, 104)
                buffer = io.BytesIO()
                image.resize(size, Image.BICUBIC).save(buffer, "JPEG", quality=90)
                out.append(buffer.getvalue())
                if len(out) == 16:
                    break
    assert len(out) == 16
    return out


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_tensor_path_draws_what_the_pil_path_draws(photos: list[bytes], train: bool):
    """timm's transform for a ViT (bicubic, crop_pct 0.875) on PIL images and as a TensorPipeline, each image
    under the same per-sample seed: the same crop box and flip (a wrong box or a flip on one side only would
    move most pixels by tens of levels), the pixels within 2 levels (the decoders and the resize round
    differently); both uint8, the model's size."""
    spec = {"interpolation": "bicubic", "crop_pct": 0.875}
    pil = timm_transform(train, 64, MEAN, STD, spec)
    tensors = on_tensors(pil)
    assert isinstance(tensors, TensorPipeline)
    flips = []
    for index, data in enumerate(photos):
        seed = sample_seed(7, 0, index)
        with seeded_sample(seed):
            a = pil(decode_for(pil, data))
        with seeded_sample(seed):
            b = tensors(decode_for(tensors, data))
        assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape == (3, 64, 64)
        diff = (a.int() - b.int()).abs()
        assert diff.max() <= 2 and diff.float().mean() < 0.5, (index, diff.max(), diff.float().mean())
        flips.append(torch.equal(b, b.flip(-1)))
    if train:  # the crops differ image by image (a fixed box would make every draw the same)
        with seeded_sample(sample_seed(7, 0, 0)):
            first = tensors(decode_tensor(photos[0]))
        with seeded_sample(sample_seed(7, 1, 0)):  # the next epoch's draw for the same image
            assert not torch.equal(first, tensors(decode_tensor(photos[0])))


def test_pil_path_where_an_op_needs_pil_images():
    """Auto-augment, colour jitter, timm's 'random' interpolation and resizes torchvision has no tensor kernel
    for stay on PIL images; the default crop-and-flip and the evaluation resize-and-crop run on tensors."""
    spec = {"interpolation": "bicubic"}
    assert on_tensors(timm_transform(True, 32, MEAN, STD, spec, "rand-m9-mstd0.5-inc1")) is None
    assert on_tensors(timm_transform(True, 32, MEAN, STD, spec, color_jitter=0.4)) is None
    assert on_tensors(timm_transform(True, 32, MEAN, STD, {"interpolation": "random"})) is None
    assert on_tensors(timm_transform(False, 32, MEAN, STD, {"interpolation": "lanczos"})) is None
    assert isinstance(on_tensors(timm_transform(True, 32, MEAN, STD, {})), TensorPipeline)  # timm's bilinear
    assert isinstance(on_tensors(timm_transform(False, 32, MEAN, STD, spec)), TensorPipeline)
    assert on_tensors(lambda image: image) is None  # a `build_transform` of your own: PIL images, as before


def _encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def test_decode_tensor_reads_what_pil_reads():
    """torchvision's decoders for JPEG/PNG/WebP/GIF, PIL's for the rest (BMP, TIFF) and for what torchvision
    hands out otherwise (16-bit PNG as uint16, an animated GIF's frames): always uint8 RGB (3, H, W), the
    pixels of PIL's `convert("RGB")` for lossless formats."""
    torch.manual_seed(0)
    rgb = Image.fromarray(torch.randint(0, 256, (10, 14, 3), dtype=torch.uint8).numpy(), "RGB")
    gray = rgb.convert("L")
    cases = {
        "png": _encoded(rgb, "PNG"),
        "png_gray": _encoded(gray, "PNG"),
        "png_rgba": _encoded(rgb.convert("RGBA"), "PNG"),
        "png_palette": _encoded(rgb.convert("P"), "PNG"),
        "png_16bit": _encoded(
            Image.fromarray((torch.arange(140).reshape(10, 14) * 400).numpy().astype("uint16")), "PNG"
        ),
        "bmp": _encoded(rgb, "BMP"),
        "tiff": _encoded(rgb, "TIFF"),
        "webp_lossless": _encoded(rgb, "WEBP", lossless=True),
        "gif_animated": _encoded(rgb.convert("P"), "GIF", save_all=True, append_images=[gray.convert("P")]),
    }
    for name, data in cases.items():
        got = decode_tensor(data)
        assert got.dtype == torch.uint8 and got.shape == (3, 10, 14), name
        assert torch.equal(got, pil_to_tensor(decode_pil(data))), name
    for name, data in {
        "jpeg": _encoded(rgb, "JPEG", quality=95),
        "jpeg_gray": _encoded(gray, "JPEG"),
    }.items():
        got = decode_tensor(data)
        assert got.shape == (3, 10, 14), name
        assert (got.int() - pil_to_tensor(decode_pil(data)).int()).abs().max() <= 2, name
    with pytest.raises(Exception):  # noqa: B017 - PIL's own error for bytes no decoder reads
        decode_tensor(b"not an image at all")
