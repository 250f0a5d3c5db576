"""The GPU decoder's batched crop + resize + flip (vitrain/data/gpu_decode.py's `resize_crops`), on the CPU:
the same pixels as a slice, `F.interpolate(antialias=True)` and a flip per image (the loop it replaced,
kept here as the reference) for up- and downscaled crops, whole images, boxes at the edges, flips, mixed
image sizes and sizes the output does not divide; through GpuDecoder (training with the workers' boxes,
evaluation); in chunks; and a number of ops per batch that does not grow with the batch."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torchvision.io import encode_jpeg, encode_png

from vitrain.data import gpu_decode
from vitrain.data.gpu_decode import GpuDecoder, resize_crops, rrc_box
from vitrain.errors import DataError

MEAN, STD = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)


def per_image(images: list[torch.Tensor], boxes: torch.Tensor, size: int, flips=None) -> torch.Tensor:
    """The reference: the loop GpuDecoder ran before (slice, antialiased bilinear resize, clamp, flip)."""
    rows = []
    for k, (img, (top, left, h, w)) in enumerate(zip(images, boxes.tolist(), strict=True)):
        crop = img[None, :, top : top + h, left : left + w].float()
        row = F.interpolate(crop, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        row = row[0].clamp(0, 255)
        rows.append(row.flip(-1) if flips is not None and flips[k] else row)
    return torch.stack(rows)


def _images(shapes: list[tuple[int, int]], seed: int = 0) -> list[torch.Tensor]:
    """Smooth gradients plus noise: neither constant (a wrong weight shows) nor only noise."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for h, w in shapes:
        ramp = torch.linspace(0, 200, h)[:, None] + torch.linspace(0, 55, w)[None, :]
        noise = torch.randint(0, 40, (3, h, w), generator=g)
        out.append((ramp[None] + noise).clamp(0, 255).to(torch.uint8))
    return out


def _edge_boxes(h: int, w: int, size: int, g: torch.Generator) -> list[tuple[int, int, int, int]]:
    """Whole image, each corner, one pixel, a crop smaller than `size` (upscaled) and one 2-3x larger
    (downscaled) where the image allows, a thin strip, and random-resized crops."""
    boxes = [
        (0, 0, h, w),
        (0, 0, max(1, h // 3), max(1, w // 2)),
        (h - max(1, h // 2), w - max(1, w // 3), max(1, h // 2), max(1, w // 3)),  # touches bottom and right
        (h // 2, w // 2, 1, 1),
        (0, w - 1, h, 1),
    ]
    ch, cw = min(h, size // 2 + 1), min(w, size - 3)
    boxes.append(((h - ch) // 2, 0, ch, cw))  # upscaled
    ch, cw = min(h, 3 * size - 1), min(w, 2 * size + 5)
    boxes.append((h - ch, (w - cw) // 3, ch, cw))  # downscaled
    boxes += [rrc_box(h, w, g) for _ in range(3)]
    return boxes


SHAPES = [(37, 53), (120, 90), (64, 64), (5, 200), (211, 17), (96, 128), (31, 31)]


@pytest.mark.parametrize("size", [24, 31, 64])
def test_batched_resize_is_the_per_image_resize(size: int):
    """Mixed image sizes in one batch, every kind of box, flips on about half: the batched result is the
    per-image one to float rounding (relative 1e-4 of the 0..255 range, measured ~2e-5 here)."""
    g = torch.Generator().manual_seed(size)
    images, boxes = [], []
    for img in _images(SHAPES, seed=size):
        for box in _edge_boxes(*img.shape[-2:], size, g):
            images.append(img)
            boxes.append(box)
    boxes = torch.tensor(boxes)
    flips = torch.rand(len(images), generator=g) < 0.5
    scales = boxes[:, 2:].float() / size
    assert (scales < 1).any() and (scales > 2).any(), "crops are both up- and downscaled"
    for f in (flips, None, torch.zeros_like(flips)):
        torch.testing.assert_close(
            resize_crops(images, boxes, size, f), per_image(images, boxes, size, f), rtol=1e-4, atol=0.03
        )
    exact = resize_crops(images, boxes, size, flips)
    assert (exact - per_image(images, boxes, size, flips)).abs().max() < 2e-3


def test_same_size_batches_and_one_image():
    """All images of one size (the stacked, unpadded path) and a batch of one image."""
    images = _images([(48, 40)] * 6, seed=3)
    g = torch.Generator().manual_seed(3)
    boxes = torch.tensor([rrc_box(48, 40, g) for _ in images])
    flips = torch.tensor([True, False] * 3)
    torch.testing.assert_close(
        resize_crops(images, boxes, 32, flips), per_image(images, boxes, 32, flips), rtol=1e-4, atol=0.03
    )
    torch.testing.assert_close(
        resize_crops(images[:1], boxes[:1], 7), per_image(images[:1], boxes[:1], 7), rtol=1e-4, atol=0.03
    )


def test_batches_beyond_the_padding_budget_resize_in_chunks(monkeypatch: pytest.MonkeyPatch):
    """A batch whose padded float copy would pass MAX_PADDED is cut into chunks of consecutive images (a
    large image among small ones pads only its own chunk): the same pixels, in order."""
    shapes = [(30, 40)] * 5 + [(150, 170)] + [(40, 30)] * 5 + [(20, 20)]
    images = _images(shapes, seed=5)
    g = torch.Generator().manual_seed(5)
    boxes = torch.tensor([rrc_box(h, w, g) for h, w in shapes])
    flips = torch.rand(len(images), generator=g) < 0.5
    whole = resize_crops(images, boxes, 20, flips)
    chunks = []
    chunk = gpu_decode._resize_chunk

    def recording(images: list[torch.Tensor], *args):
        chunks.append(len(images))
        return chunk(images, *args)

    monkeypatch.setattr(gpu_decode, "_resize_chunk", recording)
    monkeypatch.setattr(gpu_decode, "MAX_PADDED", 3 * 150 * 170)  # the large image fills a chunk alone
    torch.testing.assert_close(resize_crops(images, boxes, 20, flips), whole, rtol=1e-5, atol=1e-3)
    assert chunks == [5, 1, 6], chunks
    torch.testing.assert_close(whole, per_image(images, boxes, 20, flips), rtol=1e-4, atol=0.03)


def test_boxes_past_the_edge_are_cut_and_empty_ones_refused():
    """A box reaching past its image is cut at the edge, as the slice in the per-image loop cut it; a box
    that leaves nothing of the image is one line."""
    images = _images([(30, 40), (25, 25)])
    boxes = torch.tensor([[10, 30, 50, 50], [0, 0, 25, 25]])
    cut = torch.tensor([[10, 30, 20, 10], [0, 0, 25, 25]])
    torch.testing.assert_close(
        resize_crops(images, boxes, 16), per_image(images, cut, 16), rtol=1e-4, atol=0.03
    )
    for bad in ([30, 0, 5, 5], [-1, 0, 5, 5], [0, 0, 0, 5]):
        with pytest.raises(
            DataError, match=r"crop box \[.*\] \(top, left, height, width\) is outside its image"
        ):
            resize_crops(images, torch.tensor([bad, [0, 0, 25, 25]]), 16)


def _blobs(images: list[torch.Tensor]) -> list[torch.Tensor]:
    """Lossless PNGs (the decode then gives back exactly `images`) and a JPEG."""
    return [encode_png(img) for img in images[:-1]] + [encode_jpeg(images[-1], quality=95)]


def test_the_decoder_resizes_given_boxes_and_centres_in_eval():
    """GpuDecoder: the boxes and flips the loader workers drew (training; without them it refuses, it draws
    nothing itself) and evaluation's centred square of the short side, each the per-image reference
    normalised."""
    shapes = [(40, 56), (33, 33), (64, 24), (50, 47)]
    images = _images(shapes, seed=7)
    blobs = _blobs(images)
    decoded = GpuDecoder(20, MEAN, STD, device="cpu").decode(blobs)
    assert all(torch.equal(a, b) for a, b in zip(decoded[:-1], images[:-1], strict=True))
    mean, std = torch.tensor(MEAN)[:, None, None], torch.tensor(STD)[:, None, None]

    def normalised(x: torch.Tensor) -> torch.Tensor:
        return (x / 255 - mean) / std

    g = torch.Generator().manual_seed(1)
    boxes = torch.tensor([rrc_box(h, w, g) for h, w in shapes])
    flips = torch.tensor([True, False, True, True])
    decoder = GpuDecoder(20, MEAN, STD, device="cpu")
    given = decoder(blobs, train=True, boxes=boxes, flips=flips)
    torch.testing.assert_close(given, normalised(per_image(decoded, boxes, 20, flips)), rtol=1e-4, atol=1e-4)
    unflipped = decoder(blobs, train=True, boxes=boxes)
    torch.testing.assert_close(unflipped, normalised(per_image(decoded, boxes, 20)), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="training crops come with the batch"):
        decoder(blobs, train=True)

    centred = torch.tensor(
        [[(h - min(h, w)) // 2, (w - min(h, w)) // 2, min(h, w), min(h, w)] for h, w in shapes]
    )
    ev = decoder(blobs, train=False)
    torch.testing.assert_close(ev, normalised(per_image(decoded, centred, 20)), rtol=1e-4, atol=1e-4)
    assert torch.equal(ev, decoder(blobs, train=False)), "evaluation draws nothing"


def _aten_ops(fn) -> Counter:
    """The aten ops `fn` issues at the top level (those an aten op issues inside itself, such as the CPU
    bmm's loop over the batch, are that op's business; on a GPU bmm is one cuBLAS call)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(
        e.name
        for e in prof.events()
        if e.name.startswith("aten::")
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )


def test_ops_per_batch_do_not_grow_with_the_batch():
    """The decoder's work after the decode, for 8 and 64 images with their boxes and flips (as the loader
    workers send them): the same aten ops when the images share a size (one stack pads them), and when they
    do not only the padding's per-image slice and copy more."""
    decoder = GpuDecoder(24, MEAN, STD, device="cpu")
    padding = {"aten::slice", "aten::copy_"}  # per image: dst[:, :h, :w].copy_(img)
    g = torch.Generator().manual_seed(0)
    for shapes in ([(40, 36)], [(40, 36), (33, 50), (48, 48)]):
        ops = {}
        for n in (8, 64):
            images = _images([shapes[k % len(shapes)] for k in range(n)], seed=n)
            boxes = torch.tensor([rrc_box(*img.shape[-2:], g) for img in images])
            flips = torch.rand(n, generator=g) < 0.5
            decoder.decode = lambda blobs, orientations=None, images=images: (
                images
            )  # per image (nvJPEG: one call)

            def call(images=images, boxes=boxes, flips=flips):
                return decoder(images, train=True, boxes=boxes, flips=flips)

            call()  # warm-up (cached constants)
            ops[n] = _aten_ops(call)
        grown = ops[64] - ops[8]
        if len(shapes) == 1:
            assert not grown and not (ops[8] - ops[64]), (grown, ops[8].total())
        else:
            assert set(grown) <= padding and all(c <= 2 * 56 for c in grown.values()), grown
        assert ops[8].total() < 200, ops[8]


@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "64-true"])
def test_a_batch_prepared_ahead_is_left_to_its_wait_by_the_precision_plugins(precision: str):
    """Lightning's `*-true` precision plugins cast a batch's floating tensors before
    `on_before_batch_transfer`; a batch a thread prepared ahead must reach that hook untouched, since a cast
    would read it on the current stream before the stream waits for the thread's event."""
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision

    from vitrain.data.decode_ahead import DecodedAhead

    plugin = DoublePrecision() if precision == "64-true" else HalfPrecision(precision)
    ahead = DecodedAhead(torch.rand(2, 3, 4, 4), None)
    x, y = plugin.convert_input((ahead, torch.arange(2)))
    assert x is ahead and x.wait().dtype == torch.float32
    assert plugin.convert_input((torch.rand(2), y))[0].dtype != torch.float32  # what it does to a tensor


def test_decode_ahead_runs_at_most_depth_ahead_and_ends_with_its_pass():
    """decode_ahead: batches in order, decoded by one thread that starts at the first batch asked for and
    reads at most `depth` (+ the one it holds) past what was taken; a pass dropped before its end (as
    Lightning drops a pass cut by limit_train_batches) ends the thread before the drop returns, so the loader's
    next pass never shares its iterator with it; an error in the thread is raised on the consumer's."""
    from vitrain.data.decode_ahead import DecodedAhead, decode_ahead

    pulled: list[int] = []

    def source(n: int):
        for i in range(n):
            pulled.append(i)
            yield i, torch.tensor(i)

    def threads() -> int:
        return sum(t.name == "gpu-decode-ahead" for t in threading.enumerate())

    before = threads()
    batches = decode_ahead(source(10), lambda e: torch.full((2,), float(e)), torch.device("cpu"), depth=2)
    time.sleep(0.2)
    assert pulled == [] and threads() == before  # nothing before the first batch
    taken = [next(batches) for _ in range(3)]
    assert all(isinstance(x, DecodedAhead) and x.done is None for x, _ in taken)
    assert [int(x.wait()[0]) for x, _ in taken] == [0, 1, 2] and [int(y) for _, y in taken] == [0, 1, 2]
    time.sleep(0.3)
    assert len(pulled) <= 3 + 2 + 1 and threads() == before + 1
    del batches  # the pass dropped: its thread is waited for
    assert threads() == before and len(pulled) < 10
    assert [int(y) for _, y in decode_ahead(source(4), lambda e: e, torch.device("cpu"), depth=1)] == [
        0,
        1,
        2,
        3,
    ]

    def fails(e):
        if int(e) == 2:
            raise DataError("cannot decode sample 2 (bad)")
        return torch.zeros(1)

    with pytest.raises(DataError, match=r"^cannot decode sample 2 \(bad\)$"):
        list(decode_ahead(source(5), fails, torch.device("cpu"), depth=2))
    time.sleep(0.2)
    assert threads() == before
