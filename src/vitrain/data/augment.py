"""Batch-wise augmentation and normalisation on the training device: a few kernels per op for the whole
batch instead of per-image Python in loader workers.

A batch costs a fixed number of device ops whatever its size (a few per op group of RandomAugment, where ops
that share a kernel form one group; none per image), and nothing is read back from the device. Every random
draw but the erasing noise is made on the host, and what follows from the draws (which images go where, each
image's matrix, factor or box) is worked out there on vectors of the batch's size, then sent to the device in
one copy without waiting. The draws come from generators seeded by the batch's own seed where it has one (an
in-memory training batch: `sampling.batch_seed`, so a thread can augment it ahead of the training thread and
a resumed run gets it again), else from torch's global generators (seeded by the run's seed, restored on
resume). On a GPU each device op is a kernel launch by the training thread; the host's small CPU ops cost
less than the launches they replace. Hence our random erasing instead of timm's (a Python loop over the
images) and our autocontrast instead of torchvision's (a masked assignment)."""

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


def random_crop_flip(
    x: Tensor, padding: int, flip_p: float = 0.5, generator: torch.Generator | None = None
) -> Tensor:
    """Per sample: a random HxW window of the image zero-padded by `padding`, mirrored left-right with
    probability `flip_p` (torchvision's RandomCrop(padding=p) then RandomHorizontalFlip(p), per image).

    One gather for the whole batch, without building the padded batch: the shifts and flips are drawn on the
    host (from `generator`, else torch's global CPU generator, as every draw here), which works out the source
    row and column of each output row and column and whether it lies in the padding; the device adds them
    into each output pixel's source, gathers, and zeroes the padding: 6 device ops, whatever the batch. About
    twice as fast on the CPU as pad + unfold-crop + where-flip (docs/benchmarks.md, data pipeline).
    """
    b, c, h, w = x.shape
    if padding <= 0 and flip_p <= 0:
        return x
    g = generator
    rows = torch.randint(-padding, padding + 1, (b, 1), generator=g) + torch.arange(h)  # [B,H] source rows
    cols = torch.randint(-padding, padding + 1, (b, 1), generator=g) + torch.arange(w)  # [B,W] source columns
    cols = torch.where(torch.rand(b, 1, generator=g) < flip_p, cols.flip(-1), cols)
    if padding <= 0:  # a flip alone: each row gathers its image's columns, reversed or not (2 device ops)
        return x.gather(3, to_device(cols, x.device)[:, None, None, :].expand(b, c, h, w))
    inside = torch.cat([(rows >= 0) & (rows < h), (cols >= 0) & (cols < w)], 1).to(torch.uint8)
    rows, cols = to_device(torch.cat([rows.clamp(0, h - 1) * w, cols.clamp(0, w - 1)], 1), x.device).split(
        [h, w], 1
    )
    source = (rows[:, :, None] + cols[:, None, :]).view(b, 1, h * w).expand(b, c, h * w)
    out = x.reshape(b, c, h * w).gather(2, source).view(b, c, h, w)
    # the padding zeroed by a product with a 0/1 mask: on the CPU ~10x faster than a broadcast masked_fill_
    in_rows, in_cols = to_device(inside, x.device).split([h, w], 1)
    return out.mul_((in_rows[:, :, None] * in_cols[:, None, :])[:, None])


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
# magnitude for the whole batch. Here every image draws its own op and magnitude. The images are sorted by
# kernel: ops that share one run as one batched call (the five affine warps: one grid_sample with a matrix per
# image; the three blends against a degenerate image). Every image's parameters (its matrix, blend factor,
# threshold, bit mask) follow from its magnitude and its op's coefficients in a few vector ops on the host,
# for all ops at once; they reach the device in one copy with the sorted order. On a GPU each device op is a
# kernel launch by the training thread: a round of RandAugment launches ~70 kernels instead of the ~150 it
# took when the device worked out the parameters (tests/test_augment.py counts them). uint8 in, uint8 out.

# what an op's parameters are made of: per unit of signed magnitude, degrees of rotation, shear, shift (of
# the image's size), enhance factor, and posterize's bits per unit of magnitude; plus a blend's degenerate
# image as gray x its grayscale + mean x its mean gray level. An op names the ones it uses (a `ranges` key,
# or a number), the others are 0.
COEFFICIENTS = ("rotate", "shear_x", "shear_y", "shift_x", "shift_y", "enhance", "posterize", "gray", "mean")
# each image's parameters: columns THETA an affine matrix (normalised coordinates, output -> input); FACTOR,
# GRAY, MEAN a blend; SOLARIZE the threshold; KEEP posterize's mask of the bits it keeps
THETA, FACTOR, GRAY, MEAN, SOLARIZE, KEEP = slice(0, 6), 6, 7, 8, 9, 10
PARAMS = 11
_KEEP_BITS = torch.tensor([256.0 - 2 ** (8 - bits) for bits in range(9)])  # exact: a table, not a float pow


def _signed(m: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Half of the images take the negative magnitude (rotate left or right, shear either way)."""
    return torch.where(torch.rand(m.shape, dtype=m.dtype, generator=generator) < 0.5, -m, m)


def op_params(coefficients: Tensor, m: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """[n, PARAMS]: each image's parameters from its op's coefficients ([n, len(COEFFICIENTS)]) and its
    magnitude in [0, 1], on the host. A coefficient an op leaves at 0 keeps its matrix the identity (angle
    0: cos 1, sin 0; no shear, no shift), and these sums exact (x + 0)."""
    s = _signed(m, generator)
    rotate, shear_x, shear_y, shift_x, shift_y, enhance, posterize, gray, mean = coefficients.unbind(1)
    rad = s * rotate * (math.pi / 180)
    cos, sin = rad.cos(), rad.sin()
    bits = 8 - (m * posterize).round().long()
    return torch.stack(
        [
            *(cos, s * shear_x - sin, 2 * s * shift_x, sin + s * shear_y, cos, 2 * s * shift_y),
            *(1 + s * enhance, gray, mean),
            256 - 256 * m,
            _KEEP_BITS[bits],
        ],
        dim=1,
    )


@functools.lru_cache(maxsize=16)
def _base_grid(height: int, width: int, device: torch.device) -> Tensor:
    """[1, H*W, 3]: each output pixel's normalised (x, y, 1), which `F.affine_grid` builds at every call (a
    few kernels); made once per size and device. Exact: the identity matrix times it adds only zeros."""
    xy = F.affine_grid(torch.eye(2, 3)[None], [1, 1, height, width], align_corners=False)
    return torch.cat([xy, torch.ones(1, height, width, 1)], dim=-1).view(1, height * width, 3).to(device)


def _warp(x: Tensor, p: Tensor) -> Tensor:
    """Each image through its own affine matrix, nearest pixel, zeros outside: affine_grid's arithmetic (one
    batched matmul) on the cached base grid, then one grid_sample."""
    n, _, h, w = x.shape
    theta = p[:, THETA].reshape(n, 2, 3)
    grid = torch.bmm(_base_grid(h, w, x.device).expand(n, -1, -1), theta.transpose(1, 2))
    out = F.grid_sample(
        x.float(), grid.view(n, h, w, 2), mode="nearest", padding_mode="zeros", align_corners=False
    )
    return out.to(x.dtype)


def _blend(x: Tensor, degenerate: Tensor, factor: Tensor) -> Tensor:
    """PIL ImageEnhance: degenerate + factor * (image - degenerate), rounded; `factor` [n,1,1,1]."""
    return torch.sub(x, degenerate).mul_(factor).add_(degenerate).clamp_(0, 255).round_().to(torch.uint8)


def _column(p: Tensor, k: int) -> Tensor:
    return p[:, k, None, None, None]  # [n,1,1,1]: per image, broadcast over its pixels


def _blends(x: Tensor, p: Tensor) -> Tensor:
    """Color (a blend with the grayscale image), Contrast (with its mean gray level), Brightness (black)."""
    gray = TF.rgb_to_grayscale(x).float()
    level = gray.mean(dim=(1, 2, 3), keepdim=True)
    degenerate = torch.addcmul(gray * _column(p, GRAY), level, _column(p, MEAN))
    return _blend(x, degenerate, _column(p, FACTOR))


@functools.lru_cache(maxsize=8)
def _smooth_kernel(device: torch.device) -> Tensor:
    """PIL's SMOOTH kernel, made once per device (`torch.tensor(..., device=cuda)` copies and waits)."""
    return torch.tensor([[1.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 1.0]]).div_(13).to(device)


def _sharpness(x: Tensor, p: Tensor) -> Tensor:
    """A blend with PIL's SMOOTH filter inside, the image's own border pixels at the edge (as PIL and
    torchvision)."""
    kernel = _smooth_kernel(x.device)
    c = x.shape[1]
    degenerate = x.to(torch.float32, copy=True)
    degenerate[..., 1:-1, 1:-1] = F.conv2d(degenerate, kernel.expand(c, 1, 3, 3), groups=c).round_()
    return _blend(x, degenerate, _column(p, FACTOR))


def _autocontrast(x: Tensor, p: Tensor | None = None) -> Tensor:
    """torchvision's autocontrast (each channel stretched to 0..255, a flat channel kept), bitwise, with the
    flat channels' bounds set by `masked_fill_`: torchvision assigns through a boolean mask, which reads the
    fill value on the host and, off CUDA, turns the mask into indices, a wait for the device."""
    lo, hi = x.flatten(2).aminmax(dim=-1)
    lo, hi = lo.float()[..., None, None], hi.float()[..., None, None]
    flat = hi == lo
    inv_scale = (hi - lo).mul_(1.0 / 255).masked_fill_(flat, 1.0)  # torchvision's arithmetic, same rounding
    return torch.sub(x, lo.masked_fill_(flat, 0.0)).div_(inv_scale).clamp_(0, 255).to(torch.uint8)


@dataclass(frozen=True)
class Op:
    """An op: `kernel(images, params)` runs where the uint8 images are, with their rows of `op_params`
    there; `uses` names its coefficients (COEFFICIENTS), each a `ranges` key or a number."""

    kernel: Callable[[Tensor, Tensor], Tensor]
    uses: tuple[tuple[str, str | float], ...] = ()

    def coefficients(self, ranges: dict[str, float]) -> list[float]:
        uses = dict(self.uses)
        values = {k: ranges[v] if isinstance(v, str) else v for k, v in uses.items()}
        return [float(values.get(k, 0.0)) for k in COEFFICIENTS]

    def __call__(self, x: Tensor, m: Tensor, ranges: dict[str, float]) -> Tensor:
        """This op alone on every image of `x`, magnitudes `m` on the CPU."""
        coefficients = torch.tensor([self.coefficients(ranges)]).expand(len(m), -1)
        return self.kernel(x, to_device(op_params(coefficients, m), x.device))


OPS: dict[str, Op] = {
    "Identity": Op(lambda x, p: x),
    "AutoContrast": Op(_autocontrast),
    # torchvision's v2 equalize is batched already: one scatter_add for all histograms, no read of the step
    "Equalize": Op(lambda x, p: TF.equalize(x)),
    "Rotate": Op(_warp, (("rotate", "rotate"),)),
    "Solarize": Op(lambda x, p: torch.where(x >= _column(p, SOLARIZE), 255 - x, x)),
    "Posterize": Op(lambda x, p: x & _column(p, KEEP).to(torch.uint8), (("posterize", "posterize"),)),
    "Color": Op(_blends, (("enhance", "enhance"), ("gray", 1.0))),
    "Contrast": Op(_blends, (("enhance", "enhance"), ("mean", 1.0))),
    "Brightness": Op(_blends, (("enhance", "enhance"),)),  # degenerate: black
    "Sharpness": Op(_sharpness, (("enhance", "enhance"),)),
    "ShearX": Op(_warp, (("shear_x", "shear"),)),
    "ShearY": Op(_warp, (("shear_y", "shear"),)),
    # normalised coordinates span 2: op_params doubles the shift, a fraction of the image
    "TranslateX": Op(_warp, (("shift_x", "translate"),)),
    "TranslateY": Op(_warp, (("shift_y", "translate"),)),
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
    # one batched call per kernel; per op index: its kernel's index and its coefficients
    _kernels: list[Callable[[Tensor, Tensor], Tensor]] = field(init=False, repr=False)
    _group_of: Tensor = field(init=False, repr=False)
    _coefficients: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._kernels = []
        for name in self.ops:
            if OPS[name].kernel not in self._kernels:
                self._kernels.append(OPS[name].kernel)
        self._group_of = torch.tensor([self._kernels.index(OPS[name].kernel) for name in self.ops])
        self._coefficients = torch.tensor([OPS[name].coefficients(self.ranges) for name in self.ops])

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

    def sample(self, batch: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """(op index, magnitude in [0, 1]) for each image, drawn on the CPU (`generator`, else torch's global):
        `apply` counts the images per op on the host, which for ops drawn on a GPU would be a copy back and
        a wait for the GPU at every batch."""
        ops = torch.randint(len(self.ops), (batch,), generator=generator)
        if self.magnitude is None:
            mag = torch.rand(batch, generator=generator)
        else:
            mag = self.magnitude + self.magnitude_std * torch.randn(batch, generator=generator)
            mag = (mag / 10).clamp_(0, 1)  # timm's magnitude scale: 10 = the full range
        return ops, mag

    def __call__(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        for _ in range(self.num_ops):
            x = self.apply(x, *self.sample(len(x), generator), generator)
        return x

    def apply(self, x: Tensor, ops: Tensor, mag: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Each image through its own op (`ops`, indices into `self.ops`, and `mag`, on the CPU): sorted by
        kernel on the host, where the parameters are worked out; the parameters and the order in one copy to
        the device; one batched call per kernel; the results put back in the images' places."""
        n = len(ops)
        group = self._group_of[ops]
        order = group.argsort(stable=True)
        counts = torch.bincount(group, minlength=len(self._kernels)).tolist()
        params = op_params(self._coefficients[ops[order]], mag[order], generator)
        packed = to_device(torch.cat([params.view(-1), order.to(params.dtype)]), x.device)  # n < 2**24: exact
        params, order = packed[: n * PARAMS].view(n, PARAMS), packed[n * PARAMS :].long()
        images, results, start = x.index_select(0, order), [], 0
        for kernel, count in zip(self._kernels, counts, strict=True):
            if count:
                results.append(kernel(images[start : start + count], params[start : start + count]))
                start += count
        if not results:
            return x
        return torch.empty_like(x).index_copy_(0, order, torch.cat(results))


def flip_probability(value: object) -> float:
    """`datamodule.hflip`: true (half the images), false (none) or a probability in [0, 1]."""
    if isinstance(value, bool):
        return 0.5 if value else 0.0
    if isinstance(value, int | float) and 0.0 <= value <= 1.0:
        return float(value)
    raise DataError(
        f"datamodule.hflip={value!r}: use true (half the images), false (none) or a probability between 0 and 1"
    )


#: turns a batch's seed into its erasing noise's (a 63-bit seed stays one)
NOISE_SEED_MASK = 0x2545_F491_4F6C_DD1D


@dataclass
class BatchTransform:
    """What the datamodule applies after a batch reaches the device; random ops draw from generators seeded by
    the batch's seed when it has one, else from torch's global ones. Generators passed down, not the global
    state swapped: a thread ahead of the training thread augments while that thread draws too."""

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

    def __call__(self, x: Tensor, train: bool, seed: int | None = None) -> Tensor:
        """`seed`: the batch's own (`sampling.batch_seed`); its random ops then draw from generators seeded
        by it, not from torch's global ones, which they leave as they were."""
        host = noise = None
        if train and seed is not None:
            host = torch.Generator().manual_seed(seed)
            # the noise a stream of its own (on a CPU it would otherwise repeat the host's draws); the meta
            # device (shapes only, no values) has no generator
            if self.re_prob > 0 and x.device.type != "meta":
                noise = torch.Generator(device=x.device).manual_seed(seed ^ NOISE_SEED_MASK)
        if train:
            x = random_crop_flip(x, self.crop_padding, self.flip_p, host)
            if self._augment is not None:
                x = self._augment(x, host)
        x = to_model_input(x, self.img_size, self.mean, self.std)
        if train and self.re_prob > 0:
            x = random_erasing(x, self.re_prob, host, noise)
        return x


# --- random erasing, batch-wise ----------------------------------------------------------------------------
#
# timm's RandomErasing(mode="pixel") (the DeiT recipe): per image with probability p, a box of 2 % to 1/3 of the
# image, aspect log-uniform in 0.3..1/0.3, up to 10 tries to fit one, filled with normal noise after
# normalisation. Ours, not timm's: timm loops over the images of a batch in Python, kernels per erased image.

ERASE_AREA = (0.02, 1 / 3)
ERASE_LOG_ASPECT = (math.log(0.3), -math.log(0.3))
ERASE_ATTEMPTS = 10


def erasing_boxes(
    batch: int, height: int, width: int, prob: float, generator: torch.Generator | None = None
) -> Tensor:
    """[k, 5] int64 rows (image, top, left, box height, box width), one per image to erase, drawn on the CPU
    (`generator`, else torch's global CPU generator, as `RandomAugment.sample`): the host knows k without
    asking the device.

    timm's draws, batched: every image makes its 10 tries at once and keeps the first that fits; an image
    whose 10 tries all fail is not erased, as in timm."""
    g = generator
    erase = torch.rand(batch, generator=g) < prob
    area = torch.empty(batch, ERASE_ATTEMPTS).uniform_(*ERASE_AREA, generator=g).mul_(height * width)
    aspect = torch.empty(batch, ERASE_ATTEMPTS).uniform_(*ERASE_LOG_ASPECT, generator=g).exp_()
    h = (area * aspect).sqrt_().round_().long()  # round half to even, as Python's round in timm
    w = (area / aspect).sqrt_().round_().long()
    fits = (h < height) & (w < width)
    first = fits.byte().argmax(dim=1, keepdim=True)  # the first try that fits
    h, w = h.gather(1, first).squeeze(1), w.gather(1, first).squeeze(1)
    image = (erase & fits.any(dim=1)).nonzero().squeeze(1)
    h, w = h[image], w[image]
    top = (
        torch.rand(len(image), generator=g).mul_(height - h + 1).long()
    )  # uniform in 0..height-h, timm's randint
    left = torch.rand(len(image), generator=g).mul_(width - w + 1).long()
    return torch.stack([image, top, left, h, w], dim=1)


def random_erasing(
    x: Tensor,
    prob: float,
    generator: torch.Generator | None = None,
    noise_generator: torch.Generator | None = None,
) -> Tensor:
    """Erase a box of each chosen image of the float batch `x` (in place, as timm) with per-pixel normal
    noise: the boxes' rows and columns are worked out on the host (`generator`), the device makes each box's
    mask from them (one broadcast `and`), and only the k erased images draw noise (`noise_generator`, on
    `x`'s device) and are rewritten."""
    height, width = x.shape[-2:]
    boxes = erasing_boxes(len(x), height, width, prob, generator)
    if not len(boxes):
        return x
    image, top, left, h, w = boxes.unbind(1)
    rows, cols = torch.arange(height), torch.arange(width)
    in_rows = (rows >= top[:, None]) & (rows < (top + h)[:, None])  # [k,H]
    in_cols = (cols >= left[:, None]) & (cols < (left + w)[:, None])  # [k,W]
    in_rows, in_cols = to_device(torch.cat([in_rows, in_cols], 1), x.device).split([height, width], 1)
    inside = in_rows[:, None, :, None] & in_cols[:, None, None, :]  # [k,1,H,W]
    image = to_device(image, x.device)
    noise = torch.randn((len(boxes), *x.shape[1:]), dtype=x.dtype, device=x.device, generator=noise_generator)
    return x.index_copy_(0, image, torch.where(inside, noise, x.index_select(0, image)))
