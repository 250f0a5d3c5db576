"""Batch-wise augmentation and normalisation on the training device: one kernel per op for the whole
batch instead of per-image Python in loader workers.

A batch costs a fixed number of kernels whatever its size (a few per op group of RandomAugment, where ops
that differ only in a parameter form one group; none per image), and nothing is read back from the device:
each random decision the host needs (the op of each image, which images are erased and where) is drawn on
the CPU from torch's global generator, seeded by the run's seed and restored on resume, then sent to the
device without waiting. Hence our random erasing instead of timm's
(a Python loop over the images) and our autocontrast instead of torchvision's (a masked assignment)."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF
from torch import Tensor

from vitrain.errors import DataError


def random_crop_flip(x: Tensor, padding: int, flip_p: float = 0.5) -> Tensor:
    """Per sample: a random HxW window of the image zero-padded by `padding`, mirrored left-right with
    probability `flip_p` (torchvision's RandomCrop(padding=p) then RandomHorizontalFlip(p), per image).

    One gather for the whole batch: the source pixel of every output pixel is computed from the sample's
    shift (and flip) without building the padded batch; pixels that fall in the padding are zeroed. About
    twice as fast on the CPU as pad + unfold-crop + where-flip (docs/benchmarks.md, data pipeline).
    """
    b, c, h, w = x.shape
    if padding <= 0 and flip_p <= 0:
        return x
    dy = torch.randint(-padding, padding + 1, (b, 1), device=x.device)
    dx = torch.randint(-padding, padding + 1, (b, 1), device=x.device)
    flip = torch.rand(b, 1, device=x.device) < flip_p
    rows = dy + torch.arange(h, device=x.device)  # [B,H] source row of each output row
    cols = dx + torch.arange(w, device=x.device)  # [B,W] source column of each output column
    cols = torch.where(flip, cols.flip(-1), cols)
    inside = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]  # [B,H,W]
    source = rows.clamp(0, h - 1)[:, :, None] * w + cols.clamp(0, w - 1)[:, None, :]
    out = x.reshape(b, c, h * w).gather(2, source.view(b, 1, h * w).expand(b, c, h * w)).view(b, c, h, w)
    return out.masked_fill_(~inside[:, None], 0) if padding > 0 else out


def to_model_input(x: Tensor, img_size: int, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """uint8 [B,3,H,W] -> normalised float32 [B,3,img_size,img_size].

    Normalised before resizing: both are linear per channel (bilinear weights sum to 1), so the result is
    the same, and upsampling 32 px to 224 px makes the normalisation 49x cheaper at the small size.
    """
    scale, shift = _affine(tuple(mean), tuple(std), x.device)
    out = x.float().mul_(scale).add_(shift)
    if out.shape[-1] != img_size or out.shape[-2] != img_size:
        shrink = img_size < max(out.shape[-2:])  # antialias only matters (and only costs) when downsampling
        out = F.interpolate(
            out, size=(img_size, img_size), mode="bilinear", align_corners=False, antialias=shrink
        )
    return out


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A CPU tensor on `device` without waiting: through pinned memory to a GPU (a plain copy from pageable
    memory waits for the GPU's queue to drain)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=16)
def _affine(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """(x / 255 - mean) / std as x * scale + shift; made once per device (a copy to a GPU every batch
    would wait for the GPU)."""
    std_t = torch.tensor(std, dtype=torch.float32)
    scale = 1.0 / (255.0 * std_t)
    shift = -torch.tensor(mean, dtype=torch.float32) / std_t
    return scale.view(1, -1, 1, 1).to(device), shift.view(1, -1, 1, 1).to(device)


# --- RandAugment / TrivialAugment, per image, batch-wise ---------------------------------------------------
#
# torchvision's and timm's RandAugment draw one op per call: applied to a batch tensor that is one op and one
# magnitude for the whole batch. Here every image draws its own op and magnitude; the batch is grouped by op
# and each group runs as one batched call with a magnitude per image (affine ops: one grid_sample with a
# matrix per image). uint8 in, uint8 out.


def _blend(x: Tensor, degenerate: Tensor, factor: Tensor) -> Tensor:
    """PIL ImageEnhance: degenerate + factor * (image - degenerate), per image factor."""
    f = factor.view(-1, 1, 1, 1)
    return (degenerate + f * (x.float() - degenerate)).clamp_(0, 255).round_().to(torch.uint8)


def _gray(x: Tensor) -> Tensor:
    return TF.rgb_to_grayscale(x).float()


def _warp(x: Tensor, theta: Tensor) -> Tensor:
    """A 2x3 matrix per image (normalised coordinates, output -> input), nearest pixel, zeros outside."""
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x.float(), grid, mode="nearest", padding_mode="zeros", align_corners=False).to(
        x.dtype
    )


def _matrix(n: int, device: torch.device, **entries: Tensor) -> Tensor:
    theta = torch.zeros(n, 2, 3, device=device)
    theta[:, 0, 0] = theta[:, 1, 1] = 1.0
    for key, value in entries.items():
        theta[:, int(key[1]), int(key[2])] = value
    return theta


def _rotate(x: Tensor, degrees: Tensor) -> Tensor:
    rad = degrees * (math.pi / 180)
    cos, sin = rad.cos(), rad.sin()
    return _warp(x, _matrix(len(x), x.device, m00=cos, m01=-sin, m10=sin, m11=cos))


@functools.lru_cache(maxsize=8)
def _smooth_kernel(device: torch.device) -> Tensor:
    """PIL's SMOOTH kernel, made once per device (`torch.tensor(..., device=cuda)` copies and waits)."""
    return torch.tensor([[1.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 1.0]]).div_(13).to(device)


def _sharpness_degenerate(x: Tensor) -> Tensor:
    """PIL's SMOOTH filter inside, the image's own border pixels at the edge (as PIL and torchvision)."""
    kernel = _smooth_kernel(x.device)
    c = x.shape[1]
    out = x.to(torch.float32, copy=True)
    smooth = F.conv2d(out, kernel.expand(c, 1, 3, 3), groups=c)
    out[..., 1:-1, 1:-1] = smooth.round_()
    return out


def _autocontrast(x: Tensor) -> Tensor:
    """torchvision's autocontrast (each channel stretched to 0..255, a flat channel kept), bitwise, with
    `torch.where` for flat channels: torchvision assigns through a boolean mask, which reads the fill value on
    the host and, off CUDA, turns the mask into indices, a wait for the device."""
    lo, hi = x.flatten(2).aminmax(dim=-1)
    lo, hi = lo.float()[..., None, None], hi.float()[..., None, None]
    flat = hi == lo
    inv_scale = torch.where(flat, 1.0, (hi - lo).mul_(1.0 / 255))  # torchvision's arithmetic, same rounding
    return x.float().sub_(torch.where(flat, 0.0, lo)).div_(inv_scale).clamp_(0, 255).to(torch.uint8)


def _posterize(x: Tensor, bits: Tensor) -> Tensor:
    keep = (255 - (2 ** (8 - bits) - 1)).to(torch.uint8).view(-1, 1, 1, 1)  # mask of the top `bits` bits
    return x & keep


def _signed(m: Tensor) -> Tensor:
    """Half of the images take the negative magnitude (rotate left or right, shear either way)."""
    return torch.where(torch.rand_like(m) < 0.5, -m, m)


# op(images, magnitude in [0, 1] per image, ranges) -> images; `ranges` scales the magnitude per policy
_Op = Callable[[Tensor, Tensor, dict[str, float]], Tensor]
OPS: dict[str, _Op] = {
    "Identity": lambda x, m, r: x,
    "AutoContrast": lambda x, m, r: _autocontrast(x),
    # torchvision's v2 equalize is batched already: one scatter_add for all histograms, no read of the step
    "Equalize": lambda x, m, r: TF.equalize(x),
    "Rotate": lambda x, m, r: _rotate(x, _signed(m) * r["rotate"]),
    "Solarize": lambda x, m, r: torch.where(x.float() >= (256 - 256 * m).view(-1, 1, 1, 1), 255 - x, x),
    "Posterize": lambda x, m, r: _posterize(x, (8 - (m * r["posterize"]).round()).long()),
    "Color": lambda x, m, r: _blend(x, _gray(x), 1 + _signed(m) * r["enhance"]),
    "Contrast": lambda x, m, r: _blend(
        x, _gray(x).mean(dim=(1, 2, 3), keepdim=True), 1 + _signed(m) * r["enhance"]
    ),
    "Brightness": lambda x, m, r: _blend(
        x, torch.zeros_like(x, dtype=torch.float32), 1 + _signed(m) * r["enhance"]
    ),
    "Sharpness": lambda x, m, r: _blend(x, _sharpness_degenerate(x), 1 + _signed(m) * r["enhance"]),
    "ShearX": lambda x, m, r: _warp(x, _matrix(len(x), x.device, m01=_signed(m) * r["shear"])),
    "ShearY": lambda x, m, r: _warp(x, _matrix(len(x), x.device, m10=_signed(m) * r["shear"])),
    # normalised coordinates span 2: a shift of fraction t of the image is 2t
    "TranslateX": lambda x, m, r: _warp(x, _matrix(len(x), x.device, m02=2 * _signed(m) * r["translate"])),
    "TranslateY": lambda x, m, r: _warp(x, _matrix(len(x), x.device, m12=2 * _signed(m) * r["translate"])),
}

# RandAugment (timm's rand-* ops and ranges: rotate 30 deg, shear 0.3, translate 45 %, enhance 0.9; posterize
# as torchvision's, 8 bits down to 4 with the magnitude, where timm's ops keep 0-4 bits: its original ops 0 up
# to 4, its `inc1` ops 4 down to 0); TrivialAugmentWide (Mueller & Hutter 2021: wider ranges, identity among
# the ops)
RAND_RANGES = {"rotate": 30.0, "shear": 0.3, "translate": 0.45, "enhance": 0.9, "posterize": 4.0}
TRIVIAL_RANGES = {"rotate": 135.0, "shear": 0.99, "translate": 0.32, "enhance": 0.99, "posterize": 6.0}
RAND_OPS = [name for name in OPS if name != "Identity"]
#: the `auto_augment` names of TrivialAugmentWide, on every path (the workers run torchvision's: transforms.py)
TRIVIAL_NAMES = ("trivial", "trivialaugment", "ta_wide")
TRIVIAL_OPS = list(OPS)


# Ops that differ only in a per-image parameter run as one batched call, a family: the affine warps as one
# grid_sample with each image's own matrix, the blends against a degenerate image as one blend. Each image's
# result is bitwise its own op's (tests/test_augment.py); a round of RandAugment makes 8 groups instead of 14,
# about a third fewer kernel launches per batch (each a few microseconds of the training thread on a GPU).
def _warps(x: Tensor, which: Tensor, m: Tensor, r: dict[str, float]) -> Tensor:
    """Rotate, ShearX, ShearY, TranslateX, TranslateY (`which`: each image's index in WARPS)."""
    s = _signed(m)
    rad = s * r["rotate"] * (math.pi / 180)
    cos, sin = rad.cos(), rad.sin()
    shear, shift = s * r["shear"], 2 * s * r["translate"]
    rotate, shear_x, shear_y, shift_x, shift_y = (which == k for k in range(len(WARPS)))
    diagonal = torch.where(rotate, cos, 1.0)
    theta = torch.stack(
        [
            diagonal,
            torch.where(rotate, -sin, torch.where(shear_x, shear, 0.0)),
            torch.where(shift_x, shift, 0.0),
            torch.where(rotate, sin, torch.where(shear_y, shear, 0.0)),
            diagonal,
            torch.where(shift_y, shift, 0.0),
        ],
        dim=-1,
    )
    return _warp(x, theta.view(-1, 2, 3))


def _blends(x: Tensor, which: Tensor, m: Tensor, r: dict[str, float]) -> Tensor:
    """Color, Contrast, Brightness (`which`: each image's index in BLENDS): each image blended with its
    grayscale image, its mean gray level, or black."""
    gray = _gray(x)
    per_image = which.view(-1, 1, 1, 1)
    degenerate = torch.where(
        per_image == 0, gray, torch.where(per_image == 1, gray.mean(dim=(1, 2, 3), keepdim=True), 0.0)
    )
    return _blend(x, degenerate, 1 + _signed(m) * r["enhance"])


WARPS = ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY")
BLENDS = ("Color", "Contrast", "Brightness")
# family(images, index of each image's op among the members, magnitude, ranges) -> images
_Family = Callable[[Tensor, Tensor, Tensor, dict[str, float]], Tensor]
FAMILIES: dict[tuple[str, ...], _Family] = {WARPS: _warps, BLENDS: _blends}


@dataclass
class RandomAugment:
    """Per image: `num_ops` ops in a row, each drawn from `ops` with its own magnitude (0..1 of the range).

    RandAugment: magnitude `magnitude` (0..10, timm's scale) plus Gaussian noise of `magnitude_std` per
    image; TrivialAugment: one op, magnitude uniform in [0, 1].
    """

    ops: list[str]
    ranges: dict[str, float]
    num_ops: int = 2
    magnitude: float | None = 9.0  # None: uniform
    magnitude_std: float = 0.5
    # one batched call per group: a lone op, or a family (then True: it takes each image's member index)
    _groups: list[tuple[_Op | _Family, bool]] = field(init=False, repr=False)
    # per op index: its group, and its index among its family's members (0 for a lone op)
    _group_of: Tensor = field(init=False, repr=False)
    _member_of: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        keys: list[str | tuple[str, ...]] = []
        group_of, member_of = [], []
        for name in self.ops:
            family = next((members for members in FAMILIES if name in members), None)
            key = family or name
            if key not in keys:
                keys.append(key)
            group_of.append(keys.index(key))
            member_of.append(family.index(name) if family else 0)
        self._groups = [(FAMILIES[k], True) if isinstance(k, tuple) else (OPS[k], False) for k in keys]
        self._group_of, self._member_of = torch.tensor(group_of), torch.tensor(member_of)

    @classmethod
    def from_name(cls, spec: str) -> RandomAugment:
        """timm's policy strings: `rand-m9-n2-mstd0.5` (RandAugment) or `trivial` (TrivialAugmentWide)."""
        if spec in TRIVIAL_NAMES:
            return cls(TRIVIAL_OPS, TRIVIAL_RANGES, num_ops=1, magnitude=None, magnitude_std=0.0)
        parts = spec.split("-")
        if parts[0] != "rand":
            raise DataError(
                f"datamodule.auto_augment={spec!r}: use 'rand-m9-n2-mstd0.5' (RandAugment, timm's syntax) "
                "or 'trivial' (TrivialAugmentWide)"
            )
        options = {"m": 9.0, "n": 2.0, "mstd": 0.5}
        for part in parts[1:]:
            key = re.match(r"[a-z]+", part)
            try:
                options[key.group(0)] = float(part[key.end() :])  # type: ignore[union-attr]
            except (AttributeError, ValueError):
                raise DataError(f"datamodule.auto_augment={spec!r}: cannot read {part!r}") from None
        unknown = set(options) - {"m", "n", "mstd"}
        if unknown:
            raise DataError(
                f"datamodule.auto_augment={spec!r}: unknown option {sorted(unknown)[0]!r} (m, n, mstd)"
            )
        return cls(
            RAND_OPS,
            RAND_RANGES,
            num_ops=int(options["n"]),
            magnitude=options["m"],
            magnitude_std=options["mstd"],
        )

    def sample(self, batch: int) -> tuple[Tensor, Tensor]:
        """(op index, magnitude in [0, 1]) for each image, drawn on the CPU (torch's global CPU generator):
        `apply` counts the images per op on the host, which for ops drawn on a GPU would be a copy back and
        a wait for the GPU at every batch."""
        ops = torch.randint(len(self.ops), (batch,))
        if self.magnitude is None:
            mag = torch.rand(batch)
        else:
            mag = self.magnitude + self.magnitude_std * torch.randn(batch)
            mag = (mag / 10).clamp_(0, 1)  # timm's magnitude scale: 10 = the full range
        return ops, mag

    def __call__(self, x: Tensor) -> Tensor:
        for _ in range(self.num_ops):
            x = self.apply(x, *self.sample(len(x)))
        return x

    def apply(self, x: Tensor, ops: Tensor, mag: Tensor) -> Tensor:
        """Each image through its own op (`ops`, indices into `self.ops`, and `mag` on the CPU): grouped by
        op, or by family, one batched call per group."""
        group = self._group_of[ops]
        order = group.argsort()
        counts = torch.bincount(group, minlength=len(self._groups)).tolist()
        # one copy to the device for what the groups need per image: magnitude and index among the members
        order = to_device(order, x.device)
        per_image = to_device(torch.stack([mag, self._member_of[ops].to(mag.dtype)]), x.device)
        out = torch.empty_like(x)
        start = 0
        for (fn, family), count in zip(self._groups, counts, strict=True):
            if count:
                idx = order[start : start + count]
                m, which = per_image.index_select(1, idx).unbind(0)
                images = x.index_select(0, idx)
                result = fn(images, which.long(), m, self.ranges) if family else fn(images, m, self.ranges)
                out.index_copy_(0, idx, result)
                start += count
        return out


def flip_probability(value: object) -> float:
    """`datamodule.hflip`: true (half the images), false (none) or a probability in [0, 1]."""
    if isinstance(value, bool):
        return 0.5 if value else 0.0
    if isinstance(value, int | float) and 0.0 <= value <= 1.0:
        return float(value)
    raise DataError(
        f"datamodule.hflip={value!r}: use true (half the images), false (none) or a probability between 0 and 1"
    )


@dataclass
class BatchTransform:
    """What the datamodule applies after a batch reaches the device; random ops draw from torch's global RNG."""

    img_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_padding: int = 4
    hflip: bool | float = True  # True: half the images; a number: that probability
    # timm's option names: "rand-m9-n2-mstd0.5" | "trivial" | None; random-erasing probability per image
    auto_augment: str | None = None
    re_prob: float = 0.0
    _augment: RandomAugment | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.auto_augment:
            self._augment = RandomAugment.from_name(self.auto_augment)
        if not 0.0 <= self.re_prob <= 1.0:
            raise DataError(f"datamodule.re_prob={self.re_prob} must be between 0 and 1")

    @property
    def flip_p(self) -> float:
        return flip_probability(self.hflip)

    def __call__(self, x: Tensor, train: bool) -> Tensor:
        if train:
            x = random_crop_flip(x, self.crop_padding, self.flip_p)
            if self._augment is not None:
                x = self._augment(x)
        x = to_model_input(x, self.img_size, self.mean, self.std)
        if train and self.re_prob > 0:
            x = random_erasing(x, self.re_prob)
        return x


# --- random erasing, batch-wise ----------------------------------------------------------------------------
#
# timm's RandomErasing(mode="pixel") (the DeiT recipe): per image with probability p, a box of 2 % to 1/3 of the
# image, aspect log-uniform in 0.3..1/0.3, up to 10 tries to fit one, filled with normal noise after
# normalisation. Ours, not timm's: timm loops over the images of a batch in Python, kernels per erased image.

ERASE_AREA = (0.02, 1 / 3)
ERASE_LOG_ASPECT = (math.log(0.3), -math.log(0.3))
ERASE_ATTEMPTS = 10


def erasing_boxes(batch: int, height: int, width: int, prob: float) -> Tensor:
    """[k, 5] int64 rows (image, top, left, box height, box width), one per image to erase, drawn on the CPU
    (torch's global CPU generator, as `RandomAugment.sample`): the host knows k without asking the device.

    timm's draws, batched: every image makes its 10 tries at once and keeps the first that fits; an image
    whose 10 tries all fail is not erased, as in timm."""
    erase = torch.rand(batch) < prob
    area = torch.empty(batch, ERASE_ATTEMPTS).uniform_(*ERASE_AREA).mul_(height * width)
    aspect = torch.empty(batch, ERASE_ATTEMPTS).uniform_(*ERASE_LOG_ASPECT).exp_()
    h = (area * aspect).sqrt_().round_().long()  # round half to even, as Python's round in timm
    w = (area / aspect).sqrt_().round_().long()
    fits = (h < height) & (w < width)
    first = fits.byte().argmax(dim=1, keepdim=True)  # the first try that fits
    h, w = h.gather(1, first).squeeze(1), w.gather(1, first).squeeze(1)
    image = (erase & fits.any(dim=1)).nonzero().squeeze(1)
    h, w = h[image], w[image]
    top = torch.rand(len(image)).mul_(height - h + 1).long()  # uniform in 0..height-h, timm's randint
    left = torch.rand(len(image)).mul_(width - w + 1).long()
    return torch.stack([image, top, left, h, w], dim=1)


def random_erasing(x: Tensor, prob: float) -> Tensor:
    """Erase a box of each chosen image of the float batch `x` (in place, as timm) with per-pixel normal noise:
    the box mask is a broadcast comparison of row and column numbers on the device, and only the k erased
    images draw noise and are rewritten."""
    boxes = erasing_boxes(len(x), x.shape[-2], x.shape[-1], prob)
    if not len(boxes):
        return x
    image, top, left, h, w = to_device(boxes, x.device).unbind(1)
    rows = torch.arange(x.shape[-2], device=x.device)
    cols = torch.arange(x.shape[-1], device=x.device)
    in_rows = (rows >= top[:, None]) & (rows < (top + h)[:, None])  # [k,H]
    in_cols = (cols >= left[:, None]) & (cols < (left + w)[:, None])  # [k,W]
    inside = in_rows[:, None, :, None] & in_cols[:, None, None, :]  # [k,1,H,W]
    noise = torch.randn((len(boxes), *x.shape[1:]), dtype=x.dtype, device=x.device)
    return x.index_copy_(0, image, torch.where(inside, noise, x.index_select(0, image)))
