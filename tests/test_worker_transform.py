"""The loader workers' per-sample transform on uint8 tensors (`vitrain.data.transforms.on_tensors`): the same
crop, flip and auto-augment draws as timm's transform on PIL images for the same per-sample seed, pixels
within rounding, every image format the PIL path reads; and timm's RandAugment kept from stopping a run."""

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


@pytest.mark.parametrize(
    ("train", "auto_augment"),
    [(True, None), (False, None), (True, "rand-m9-mstd0.5-inc1")],
    ids=["train", "eval", "train_randaugment"],
)
def test_tensor_path_draws_what_the_pil_path_draws(
    photos: list[bytes], train: bool, auto_augment: str | None
):
    """timm's transform for a ViT (bicubic, crop_pct 0.875) on PIL images and as a TensorPipeline, each image
    under the same per-sample seed: the same crop box, flip and RandAugment ops (a wrong box or op, or a flip
    on one side only, would move most pixels by tens of levels), the pixels within 2 levels (the decoders and
    the resize round differently; RandAugment's thresholds may carry a level's difference further, so there
    only the mean is bounded); both uint8, the model's size."""
    spec = {"interpolation": "bicubic", "crop_pct": 0.875}
    pil = timm_transform(train, 64, MEAN, STD, spec, auto_augment)
    tensors = on_tensors(pil)
    assert isinstance(tensors, TensorPipeline)
    for index, data in enumerate(photos):
        seed = sample_seed(7, 0, index)
        with seeded_sample(seed):
            a = pil(decode_for(pil, data))
        with seeded_sample(seed):
            b = tensors(decode_for(tensors, data))
        assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape == (3, 64, 64)
        diff = (a.int() - b.int()).abs()
        assert diff.float().mean() < 0.5, (index, diff.max(), diff.float().mean())
        assert auto_augment or diff.max() <= 2, (index, diff.max())
    if train:  # the crops differ image by image (a fixed box would make every draw the same)
        with seeded_sample(sample_seed(7, 0, 0)):
            first = tensors(decode_tensor(photos[0]))
        with seeded_sample(sample_seed(7, 1, 0)):  # the next epoch's draw for the same image
            assert not torch.equal(first, tensors(decode_tensor(photos[0])))


def test_which_ops_run_on_tensors():
    """The resize and crop (and flips) run on tensors; auto-augment and colour jitter after them on a PIL
    image of the crop; timm's 'random' interpolation, resizes torchvision has no tensor kernel for, and a
    transform of your own stay on PIL images throughout."""
    spec = {"interpolation": "bicubic"}

    def kinds(pipeline: TensorPipeline) -> list[str]:
        return [type(op).__name__ for op in pipeline.ops]

    assert kinds(on_tensors(timm_transform(True, 32, MEAN, STD, spec))) == [
        "_ResizedCrop",
        "RandomHorizontalFlip",
    ]
    assert kinds(on_tensors(timm_transform(False, 32, MEAN, STD, spec))) == ["_Resize", "CenterCrop"]
    for extra in ({"auto_augment": "rand-m9-mstd0.5-inc1"}, {"color_jitter": 0.4}):
        pipeline = on_tensors(timm_transform(True, 32, MEAN, STD, spec, **extra))
        assert kinds(pipeline) == ["_ResizedCrop", "RandomHorizontalFlip", "_OnPil"], extra
    assert isinstance(on_tensors(timm_transform(True, 32, MEAN, STD, {})), TensorPipeline)  # timm's bilinear
    assert on_tensors(timm_transform(True, 32, MEAN, STD, {"interpolation": "random"})) is None
    assert on_tensors(timm_transform(False, 32, MEAN, STD, {"interpolation": "lanczos"})) is None
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
        "jpeg_cmyk": _encoded(
            rgb.convert("CMYK"), "JPEG", quality=95
        ),  # Adobe's inverted CMYK, as PIL writes
    }.items():
        got = decode_tensor(data)
        assert got.shape == (3, 10, 14), name
        assert (got.int() - pil_to_tensor(decode_pil(data)).int()).abs().max() <= 2, name
    with pytest.raises(Exception):  # noqa: B017 - PIL's own error for bytes no decoder reads
        decode_tensor(b"not an image at all")


def test_a_16_bit_image_is_scaled_to_8_bits(tmp_path: Path):
    """A 16-bit PNG (microscopy, medical and scanned images) is its high byte in every decoder: the workers'
    (torchvision's uint16), PIL's (mode I;16) and the in-memory cache's. PIL's `convert("RGB")` clipped it at
    255: a 16-bit photo trained as a white image."""
    from vitrain.data.readers.decode import decode_square

    values = torch.arange(140, dtype=torch.int32).reshape(10, 14) * 400 + 100  # up to 55,700
    path = tmp_path / "sixteen.png"
    Image.fromarray(values.numpy().astype("uint16")).save(path)
    assert Image.open(path).mode == "I;16"
    expected = (values >> 8).to(torch.uint8).expand(3, -1, -1)
    data = path.read_bytes()
    assert torch.equal(decode_tensor(data), expected)
    assert torch.equal(pil_to_tensor(decode_pil(data)), expected)
    assert torch.equal(decode_square(str(path), 10, Image.NEAREST), expected[:, :, 2:12])


def test_32_bit_pixels_are_read_as_16_bit_where_they_fit_and_refused_otherwise(tmp_path: Path):
    """PIL opens a 16-bit PGM (and TIFFs of 32-bit pixels) as mode I, float TIFFs as mode F; its
    `convert("RGB")` clipped them at 255: a 16-bit PGM trained as a white image, a float one in [0, 1] as a
    black one. Integers within 16 bits are read as 16-bit; the others are refused, by name, before training."""
    from vitrain.data.readers.decode import decode_square
    from vitrain.data.readers.image_folders import unreadable

    values = torch.arange(140, dtype=torch.int32).reshape(10, 14) * 400 + 100  # up to 55,700
    pgm = tmp_path / "sixteen.pgm"
    Image.fromarray(values.numpy().astype("uint16")).save(pgm)
    assert Image.open(pgm).mode == "I"
    expected = (values >> 8).to(torch.uint8).expand(3, -1, -1)
    assert unreadable(str(pgm)) is None
    assert torch.equal(decode_tensor(pgm.read_bytes()), expected)
    assert torch.equal(decode_square(str(pgm), 10, Image.NEAREST), expected[:, :, 2:12])

    wide = tmp_path / "wide.tif"
    Image.fromarray((values * 1000).numpy()).save(wide)
    floats = tmp_path / "floats.tif"
    Image.fromarray((values / 65535).numpy().astype("float32")).save(floats)
    assert unreadable(str(wide)) == (
        "32-bit integer pixels (PIL mode I) from 100000 to 55700000 have no 8-bit scale: save the image with 8 "
        "or 16 bits per channel"
    )
    assert unreadable(str(floats)) == (
        "32-bit float pixels (PIL mode F) have no 8-bit scale: save the image with 8 or 16 bits per channel"
    )
    for path in (wide, floats):
        with pytest.raises(ValueError, match="have no 8-bit scale"):
            decode_tensor(path.read_bytes())


def test_randaugment_posterize_to_zero_bits_does_not_stop_the_run():
    """timm's 'inc1' RandAugment keeps 4 - int(4 m / 10) bits: 0 at m = 10, which `mstd0.5` draws around m9
    in 2.3 % of the draws, and Pillow 13 refuses 0 bits (ValueError in a loader worker, about one image in
    660): the template's transform keeps them as Pillow before 13 did (a black image)."""
    import random

    import numpy as np
    from timm.data import create_transform

    transform = timm_transform(True, 32, MEAN, STD, {}, "rand-m9-mstd0.5-inc1")
    (randaugment,) = [op for op in transform.transforms if type(op).__name__ == "RandAugment"]
    (posterize,) = [op for op in randaugment.ops if op.name == "PosterizeIncreasing"]
    posterize.prob, posterize.magnitude_std = 1.0, 0.0
    image = Image.new("RGB", (8, 8), (200, 100, 50))
    posterize.magnitude = 10  # 0 bits
    assert posterize(image).getextrema() == ((0, 0), (0, 0), (0, 0))
    posterize.magnitude = 5  # 2 bits: 0b11000000
    assert posterize(image).getpixel((0, 0)) == (192, 64, 0)

    def failures(t) -> int:
        random.seed(0)  # every generator the transform draws from: the count is the same each run
        np.random.seed(0)
        torch.manual_seed(0)
        count = 0
        for _ in range(3000):
            try:
                t(image)
            except ValueError:
                count += 1
        return count

    # RandAugment (its `ops`) at m9 + noise and at m0 (the original posterize keeps int(4 m / 10) bits), and
    # AutoAugment's v0 policy (its `policy`, lists of ops)
    for policy in ("rand-m9-mstd0.5-inc1", "rand-m0", "v0"):
        timm_own = create_transform(32, is_training=True, auto_augment=policy, use_prefetcher=True)
        assert failures(timm_own) > 0, policy  # the failure this guards against, on this Pillow
        assert failures(timm_transform(True, 32, MEAN, STD, {}, policy)) == 0, policy
