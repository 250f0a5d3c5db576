"""The on-device batch augmentation (vitrain/data/augment.py): the ops' semantics against PIL, torchvision and
timm, and its cost per batch (kernels that do not grow with the batch, no value read back from the device)."""

import math
import random
import sys
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image, ImageOps
from timm.data.random_erasing import RandomErasing
from torch.profiler import ProfilerActivity, profile

from vitrain.compat import TorchDispatchMode
from vitrain.data.augment import (
    OPS,
    RAND_RANGES,
    BatchTransform,
    RandomAugment,
    erasing_boxes,
    random_erasing,
)
from vitrain.utils.measuring import DeviceOps


def _edge_cases(n: int, size: int = 24) -> torch.Tensor:
    """uint8 images: random, low-contrast, constant, two-valued, one flat channel, 0 and 255 only."""
    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
    x[1] = torch.randint(100, 108, (3, size, size), dtype=torch.uint8, generator=g)
    x[2] = 77
    x[3] = torch.where(torch.rand(3, size, size, generator=g) < 0.3, 40, 200).to(torch.uint8)
    x[4, 1] = 13
    x[5] = torch.where(torch.rand(3, size, size, generator=g) < 0.99, 0, 255).to(torch.uint8)
    x[6, :, 0, 0] = 9  # one pixel differs from a constant image
    x[6, :, 1:] = 250
    return x


def test_equalize_is_pils():
    """Equalize is torchvision's v2 `equalize`, batched already (one scatter_add for all histograms, the
    `step == 0` case a `torch.where`): pinned here to PIL's algorithm, the reference timm's RandAugment uses."""
    x = _edge_cases(16)
    out = OPS["Equalize"](x, torch.zeros(len(x)), RAND_RANGES)
    for image, result in zip(x, out, strict=True):
        pil = ImageOps.equalize(Image.fromarray(image.permute(1, 2, 0).numpy()))
        assert torch.equal(result, torch.from_numpy(np.asarray(pil)).permute(2, 0, 1))


def test_autocontrast_is_torchvisions():
    x = _edge_cases(16)
    assert torch.equal(OPS["AutoContrast"](x, torch.zeros(len(x)), RAND_RANGES), TF.autocontrast(x))


# --- random erasing ----------------------------------------------------------------------------------------


def _erased(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """[B,H,W] pixels changed in any channel."""
    return (out != x).any(dim=1)


def _share_and_area(erased: torch.Tensor) -> tuple[float, float]:
    """(share of images erased, mean erased share of an erased image's pixels)."""
    hit = erased.any(dim=(1, 2))
    return hit.float().mean().item(), erased[hit].float().mean().item()


def test_random_erasing_erases_a_share_p_of_the_images_as_timm():
    """Same share of erased images and same box sizes as timm's RandomErasing(mode="pixel") on images of the
    same size (timm draws from Python's `random`, ours from torch's generator: statistics, not values)."""
    n, size, p = 3000, 16, 0.25
    x = torch.zeros(n, 3, size, size)
    torch.manual_seed(0)
    ours = _share_and_area(_erased(x, random_erasing(x.clone(), p)))
    random.seed(0)
    timm = _share_and_area(_erased(x, RandomErasing(probability=p, mode="pixel", device="cpu")(x.clone())))
    assert abs(ours[0] - p) < 0.03 and abs(timm[0] - p) < 0.03
    assert 0.1 < ours[1] < 0.25 and abs(ours[1] - timm[1]) < 0.02  # a box of 2 % to 1/3 of the image


def test_each_erased_box_is_a_rectangle_within_timms_bounds():
    n, height, width = 2000, 20, 28
    x = torch.randn(n, 3, height, width)  # before the seed: the noise drawn after the boxes must differ
    torch.manual_seed(1)
    boxes = erasing_boxes(n, height, width, 1.0)
    image, top, left, h, w = boxes.T
    assert len(boxes) > 0.95 * n and image.unique().numel() == len(boxes)  # at most one box per image
    assert (top >= 0).all() and (top + h <= height).all() and (left >= 0).all() and (left + w <= width).all()
    assert (h < height).all() and (w < width).all()
    # timm's area (2 % to 1/3) and aspect (0.3 to 1/0.3) before h and w are rounded to whole pixels
    area = height * width
    assert ((h + 0.5) * (w + 0.5) >= 0.02 * area).all() and ((h - 0.5) * (w - 0.5) <= area / 3).all()
    assert ((h + 0.5) / (w - 0.5) >= 0.3).all() and ((h - 0.5) / (w + 0.5) <= 1 / 0.3).all()
    # the pixels changed are exactly the drawn boxes, in every channel, and nothing else
    torch.manual_seed(1)
    out = random_erasing(x.clone(), 1.0)
    expected = torch.zeros(n, height, width, dtype=torch.bool)
    for i, t, lft, bh, bw in boxes.tolist():
        expected[i, t : t + bh, lft : lft + bw] = True
    assert torch.equal(_erased(x, out), expected)
    assert torch.equal((out != x).all(dim=1), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_erasing_keeps_dtype_and_device_and_the_other_pixels(dtype: torch.dtype):
    x = torch.randn(64, 3, 16, 16).to(dtype)
    torch.manual_seed(2)
    out = random_erasing(x.clone(), 0.5)
    assert out.dtype == dtype and out.device == x.device and out.shape == x.shape
    erased = _erased(x, out)
    assert 0 < erased.any(dim=(1, 2)).sum() < len(x)
    assert torch.equal(out.masked_fill(erased[:, None], 0), x.masked_fill(erased[:, None], 0))
    assert torch.equal(random_erasing(x.clone(), 0.0), x)


def test_the_same_seed_gives_the_same_batch():
    transform = BatchTransform(32, (0.5,) * 3, (0.25,) * 3, auto_augment="rand-m9-n2-mstd0.5", re_prob=0.25)
    x = torch.randint(0, 256, (32, 3, 32, 32), dtype=torch.uint8)
    runs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        runs.append(transform(x, train=True))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


# --- cost per batch ----------------------------------------------------------------------------------------

READS = ("aten::_local_scalar_dense", "aten::nonzero")  # `item` reaches the dispatcher as the first
HOST_DRAWS = ("sample", "erasing_boxes")  # the functions of vitrain/data/augment.py that draw on the host


class _Reads(TorchDispatchMode):
    """Each read of a tensor's value on the host (READS) with the names of the Python functions on the stack
    as it was made. (The profiler's Python frames, used for this before, are missing from torch 2.11's
    profile, the GPU image's torch.)"""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, list[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in READS:
            frame, names = sys._getframe(1), []
            while frame is not None:
                names.append(frame.f_code.co_name)
                frame = frame.f_back
            self.reads.append((func._schema.name, names))
        return func(*args, **(kwargs or {}))


def _profile(fn: Callable[[], object]) -> list:
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        fn()
    return [e for e in prof.events() if e.name.startswith("aten::")]


@pytest.mark.parametrize("spec", ["rand-m9-n2-mstd0.5", "trivial"])
def test_batch_transform_kernels_do_not_grow_with_the_batch(spec: str, monkeypatch: pytest.MonkeyPatch):
    """The aten ops one training batch issues: a few per op group (RandomAugment runs each group of images that
    drew the same op as one call), none per image, and no read of a value outside the host-side draws.

    A larger batch may hold op groups a smaller one lacks: those are allowed a bounded number of ops each.
    From 64 to 512 images nearly every group is in both, so an op issued per image (448 more) would show.

    On the CPU the batch's tensors cannot be told from the host's (both are CPU tensors), so a read
    (`item`, `_local_scalar_dense`, `nonzero`) is told apart by the Python function that made it: only the
    host-side draws (`RandomAugment.sample`, `erasing_boxes`) may read. That a device value is never read is
    the meta-device test's (test_recipes.py: reading a meta tensor fails); only a GPU counts real syncs
    (`torch.cuda.set_sync_debug_mode`, bench/gpu_check.py's `recipes` check).
    """
    groups: list[set[int]] = []  # the op groups of each RandomAugment round
    apply = RandomAugment.apply

    def recording_apply(self: RandomAugment, x: torch.Tensor, ops: torch.Tensor, mag: torch.Tensor, *rest):
        groups.append(set(ops.tolist()))
        return apply(self, x, ops, mag, *rest)

    monkeypatch.setattr(RandomAugment, "apply", recording_apply)
    transform = BatchTransform(32, (0.5,) * 3, (0.25,) * 3, auto_augment=spec, re_prob=0.25)
    transform(torch.zeros(4, 3, 32, 32, dtype=torch.uint8), train=True)  # made once: cached constants
    ops, rounds = {}, {}
    for batch in (8, 64, 512):
        x = torch.randint(0, 256, (batch, 3, 32, 32), dtype=torch.uint8)
        torch.manual_seed(0)
        groups.clear()
        events = _profile(lambda x=x: transform(x, train=True))
        ops[batch], rounds[batch] = Counter(e.name for e in events), list(groups)
        torch.manual_seed(0)
        with _Reads() as reads:
            transform(x, train=True)
        stray = [(name, stack[:4]) for name, stack in reads.reads if not set(stack) & set(HOST_DRAWS)]
        assert not stray, stray
        # the host-side draws do read: the check sees reads
        assert any(set(stack) & set(HOST_DRAWS) for _, stack in reads.reads)
    for small, large in ((8, 64), (64, 512)):
        new = sum(
            len(b - a) for a, b in zip(rounds[small], rounds[large], strict=True)
        )  # groups only in large
        # a group issues at most about 120 aten ops (Rotate, nested ones counted), no name more than 20 times
        assert ops[large].total() <= ops[small].total() + 200 * new + 10, (small, large, new)
        for name, count in ops[large].items():
            assert count <= ops[small][name] + 25 * new + 5, (name, small, large, new)


# --- ops that share a kernel: one batched call --------------------------------------------------------------


def _reference_warp(x: torch.Tensor, theta: list[list[float]]) -> torch.Tensor:
    """One image through a 2x3 matrix with torch's own affine_grid, nearest pixel (what `_warp` computes)."""
    grid = torch.nn.functional.affine_grid(torch.tensor([theta]), list(x.shape), align_corners=False)
    out = torch.nn.functional.grid_sample(x.float(), grid, mode="nearest", align_corners=False)
    return out.to(torch.uint8)


def _reference_blend(x: torch.Tensor, degenerate: torch.Tensor, factor: float) -> torch.Tensor:
    return (degenerate + factor * (x.float() - degenerate)).clamp(0, 255).round().to(torch.uint8)


def _gray(x: torch.Tensor) -> torch.Tensor:
    return TF.rgb_to_grayscale(x).float()


# each op written out on its own, for one image and a signed magnitude s (RandAugment's ranges), independently
# of op_params' coefficient table: what the table must reproduce
REFERENCES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "Rotate": lambda x, s: _reference_warp(
        x,
        [
            [math.cos(math.radians(30 * s)), -math.sin(math.radians(30 * s)), 0.0],
            [math.sin(math.radians(30 * s)), math.cos(math.radians(30 * s)), 0.0],
        ],
    ),
    "ShearX": lambda x, s: _reference_warp(x, [[1.0, 0.3 * s, 0.0], [0.0, 1.0, 0.0]]),
    "ShearY": lambda x, s: _reference_warp(x, [[1.0, 0.0, 0.0], [0.3 * s, 1.0, 0.0]]),
    "TranslateX": lambda x, s: _reference_warp(x, [[1.0, 0.0, 0.9 * s], [0.0, 1.0, 0.0]]),
    "TranslateY": lambda x, s: _reference_warp(x, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.9 * s]]),
    "Color": lambda x, s: _reference_blend(x, _gray(x), 1 + 0.9 * s),
    "Contrast": lambda x, s: _reference_blend(x, _gray(x).mean(), 1 + 0.9 * s),
    "Brightness": lambda x, s: _reference_blend(x, torch.zeros(()), 1 + 0.9 * s),
    # torchvision's blend truncates where PIL (and ours) rounds: within one level
    "Sharpness": lambda x, s: TF.adjust_sharpness(x, 1 + 0.9 * s),
    "Solarize": lambda x, s: torch.where(x.float() >= 256 - 256 * abs(s), 255 - x, x),
    "Posterize": lambda x, s: x & (256 - 2 ** round(4 * abs(s))),
}


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_each_op_does_what_its_name_says(sign: float, monkeypatch: pytest.MonkeyPatch):
    """Each op of RandAugment against its reference written out above: the warps move at most a few pixels
    across a rounding boundary of the nearest pixel (the matrix made in float32 against float64), the blends
    at most one level."""
    from vitrain.data import augment

    monkeypatch.setattr(augment, "_signed", lambda m, generator=None: m * sign)
    x = _edge_cases(12, size=32)
    for name, reference in REFERENCES.items():
        for i, m in enumerate((0.3, 0.7, 1.0)):
            image = x[i * 4 : i * 4 + 4]
            got = OPS[name](image, torch.full((4,), m), RAND_RANGES)
            want = torch.cat([reference(image[k : k + 1], sign * m) for k in range(4)])
            if name.startswith(("Rotate", "Shear", "Translate")):
                assert (got != want).any(dim=1).float().mean() < 0.01, (name, m)
            else:
                assert (got.int() - want.int()).abs().max() <= 1, (name, m)
            assert not torch.equal(got, image), (name, m)


def test_ops_that_share_a_kernel_run_as_one_call():
    """A round of RandAugment's 13 ops makes 7 batched calls: the five warps one, the three blends one."""
    policy = RandomAugment.from_name("rand-m9-n2-mstd0.5")
    assert len(policy.ops) == 13 and len(policy._kernels) == 7
    kernel = {name: OPS[name].kernel for name in policy.ops}
    assert len({kernel[n] for n in ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY")}) == 1
    assert len({kernel[n] for n in ("Color", "Contrast", "Brightness")}) == 1


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_round_gives_each_image_its_drawn_op(sign: float, monkeypatch: pytest.MonkeyPatch):
    """`RandomAugment.apply`: images sorted by kernel (ops that share one in one call, each image with its own
    parameters), each given back in its place, bitwise what its op and magnitude give it alone."""
    from vitrain.data import augment

    monkeypatch.setattr(augment, "_signed", lambda m, generator=None: m * sign)
    policy = RandomAugment.from_name("trivial")
    x = _edge_cases(40)
    ops = torch.arange(40) % len(policy.ops)
    mag = torch.rand(40, generator=torch.Generator().manual_seed(1))
    got = policy.apply(x, ops, mag)
    for i in range(40):
        alone = OPS[policy.ops[int(ops[i])]](x[i : i + 1], mag[i : i + 1], policy.ranges)
        assert torch.equal(got[i : i + 1], alone), policy.ops[int(ops[i])]


@pytest.mark.parametrize(
    ("spec", "re_prob", "most"),
    [(None, 0.0, 10), (None, 0.25, 18), ("trivial", 0.25, 96), ("rand-m9-n2-mstd0.5", 0.25, 170)],
)
def test_device_ops_per_batch(spec: str | None, re_prob: float, most: int):
    """Device ops of one training batch of 384 (every op group of RandomAugment present): the seed's crop,
    flip and normalisation 9 (27 when drawn on the device), with erasing 16; RandAugment's two rounds and
    erasing 156, TrivialAugment's round and erasing 86 (345 and 197 when the device worked out the
    parameters). The bounds leave a few ops of room, and fail on an op per image or per op. The same with
    the batch's own seed (in-memory training batches): its generators are host objects, no device op."""
    transform = BatchTransform(32, (0.5,) * 3, (0.25,) * 3, auto_augment=spec, re_prob=re_prob)
    x = torch.empty(384, 3, 32, 32, dtype=torch.uint8, device="meta")
    torch.manual_seed(0)
    transform(x, train=True)  # made once: cached constants
    with DeviceOps() as counted:
        transform(x, train=True)
    assert counted.total <= most, counted.ops
    with DeviceOps() as seeded:
        transform(x, train=True, seed=0)
    assert seeded.total <= most, seeded.ops
