"""datamodule=image_folder: a class-folder tree (or an archive of one) of real CIFAR-10 JPEGs re-encoded at
random sizes, with a grayscale JPEG, an RGBA PNG, a palette PNG, a CMYK JPEG and a corrupt file; training on
1 process and 2 DDP processes with exact evaluation on an odd split, mid-epoch resume of the worker loader,
the model's head following the data, class names in the checkpoint, per-class accuracy in eval, and the
one-line errors. `decode_device=cuda` (GPU decode) with its decoder on the CPU: normalised crops of PNGs and
JPEGs, crops drawn from (seed, epoch, index) and the header's size, bitwise batches across worker counts
and a mid-epoch resume, its options and its fallback without CUDA."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import tarfile
import threading
import time
import zipfile
from collections import Counter
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import timm
import torch
from PIL import Image

from data_factory import make_noise_folder
from helpers import (
    ROOT,
    TINY_VIT,
    DecodedRecorder,
    Recorder,
    assert_predicted_as_evaluated,
    compose_cfg,
    fails_in_process,
    predicted,
    run_cli,
)
from vitrain.data.datamodules import image_folder
from vitrain.data.datamodules.image_folder import ImageFolderDataModule
from vitrain.data.gpu_decode import EncodedBatch, GpuDecoder
from vitrain.errors import DataError
from vitrain.tasks.export import export_model
from vitrain.tasks.training import train

CLASSES = ("bird", "cat", "ship")  # a subset of CIFAR-10's, in label order
N_TRAIN = 20  # per class
N_VAL = 3  # per class: 9 validation images (odd, for 2 ranks)
RUN_TIMEOUT = 300


def _members(archive: Path) -> dict[str, list[bytes]]:
    """The first JPEGs of CLASSES from the real CIFAR-10 archive's train/ (read, not unpacked)."""
    want = {cls: [] for cls in CLASSES}
    with tarfile.open(archive) as tf:
        for m in tf:
            parts = m.name.split("/")
            if (
                m.isfile()
                and parts[0] == "train"
                and parts[1] in want
                and len(want[parts[1]]) < N_TRAIN + N_VAL
            ):
                want[parts[1]].append(tf.extractfile(m).read())
            if all(len(v) == N_TRAIN + N_VAL for v in want.values()):
                break
    return want


@pytest.fixture(scope="session")
def photos(real_cifar10_cache, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train/ + val/ of 3 classes: CIFAR-10 JPEGs resized to 40..160 px per side (JPEG, PNG, WebP), plus in
    train a grayscale JPEG, an RGBA PNG, a palette PNG and a CMYK JPEG; no corrupt file (see `broken`)."""
    _, archive = real_cifar10_cache
    root = tmp_path_factory.mktemp("photos") / "photos"
    gen = torch.Generator().manual_seed(0)
    for label, (cls, blobs) in enumerate(_members(archive).items()):
        for i, blob in enumerate(blobs):
            split = "train" if i < N_TRAIN else "val"
            d = root / split / cls
            d.mkdir(parents=True, exist_ok=True)
            h, w = (int(v) for v in torch.randint(40, 161, (2,), generator=gen))
            img = Image.open(io.BytesIO(blob)).convert("RGB").resize((w, h))
            fmt = ("JPEG", "PNG", "WEBP")[i % 3] if split == "train" else "JPEG"
            img.save(d / f"{i:03d}.{fmt.lower()}", fmt)
        first = Image.open(io.BytesIO(blobs[0]))
        mode, fmt = (("L", "JPEG"), ("RGBA", "PNG"), ("P", "PNG"))[label]
        first.convert(mode).resize((57, 93)).save(root / "train" / cls / f"odd-mode.{fmt.lower()}", fmt)
    Image.open(io.BytesIO(blobs[1])).convert("CMYK").save(root / "train" / CLASSES[0] / "cmyk.jpg", "JPEG")
    return root


N_TRAIN_ALL = 3 * (N_TRAIN + 1) + 1  # + one odd mode per class + the CMYK JPEG
N_VAL_ALL = 3 * N_VAL


def _overrides(data_dir: Path | str, cache: Path, batch_size: int = 8) -> list[str]:
    return [
        *TINY_VIT,
        "datamodule=image_folder",
        f"datamodule.data_dir={data_dir}",
        f"datamodule.cache_dir={cache}",
        f"datamodule.batch_size={batch_size}",
        "datamodule.eval_batch_size=4",
        "datamodule.num_workers=1",
        "datamodule.in_memory=false",  # the worker path; in memory: tests/test_in_memory.py
        "trainer.accelerator=cpu",
        "trainer.precision=32-true",
        "trainer.max_epochs=1",
        "trainer.log_every_n_steps=1",
        "extras.print_config=false",
        "logger=csv",
    ]


def test_trains_one_process_then_eval_per_class(photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    """The head follows the data (3 classes, no num_classes given); the checkpoint keeps the class names;
    eval prints and writes per-class accuracy; a checkpoint meets data with other classes: one line."""
    from vitrain.checkpoints import CheckpointError
    from vitrain.tasks.evaluation import evaluate

    cfg = compose_cfg("train", [*_overrides(photos, tmp_path), "+trainer.limit_train_batches=3"], tmp_path)
    metrics, objects = train(cfg)
    assert objects.trainer.global_step == 3 and "val/acc1" in metrics
    assert objects.model.net.head.out_features == 3
    dm = objects.datamodule
    assert (len(dm.train_set), len(dm.val_set)) == (N_TRAIN_ALL, N_VAL_ALL)
    # no test/: test/ metrics are on the validation images, and the report says so where it shows them
    report = (tmp_path / "report.md").read_text()
    assert (
        dm.test_is_val
        and f"{N_VAL_ALL} test images (test = the val images: the data has no test split)" in report
    )
    assert "Test metrics on the validation images (the data has no test split)" in report
    # what to do with the checkpoint, said where the run ends
    best = next((tmp_path / "checkpoints").glob("epoch*.ckpt"))
    assert f"`python src/predict.py ckpt_path={best} inputs=<photos>`" in report
    # CLASSES[0] has the CMYK JPEG too
    assert (
        f"| train images per class | 21 (`{CLASSES[1]}`) to 22 (`{CLASSES[0]}`), median 21; 1.0x |" in report
    )
    last = tmp_path / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True)
    assert ckpt["class_names"] == list(CLASSES)
    assert ckpt["run_config"]["model"]["net"]["num_classes"] == 3

    evaluated, out = evaluate(compose_cfg("eval", [f"ckpt_path={last}", "split=val"], tmp_path / "eval"))
    written = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert set(written["per_class_acc"]) == set(CLASSES) == set(out.per_class_acc)
    # the per-class accuracies are those of the same predictions: their mean over 3 equal classes is acc1
    mean = sum(written["per_class_acc"].values()) / 3
    assert mean == pytest.approx(evaluated["val/acc1"], abs=1e-6)
    printed = capsys.readouterr().out
    assert all(f"│ {cls} " in printed for cls in CLASSES)
    assert written["images_of_split"] == "val"
    # split=test of a folder without test/: the val images, and its output says so
    tested, _ = evaluate(compose_cfg("eval", [f"ckpt_path={last}"], tmp_path / "eval_test"))
    written = json.loads((tmp_path / "eval_test" / "metrics.json").read_text())
    assert (written["split"], written["images_of_split"]) == ("test", "val")
    assert tested["test/acc1"] == pytest.approx(evaluated["val/acc1"], abs=1e-6)
    # one line, the path whole (a Table title was wrapped to the table's width, the path cut in pieces)
    assert f"test (the val images: no test split) metrics of {last}\n" in capsys.readouterr().out

    # src/predict.py on the val/ photos: each classified as evaluation saw it (decoded, resized and cropped by
    # the workers' evaluation transform, normalised on the device), whatever its size and format
    rows = predicted(last, photos / "val", tmp_path / "predict")
    files = [path for path, _ in dm.val_set.files]
    images = torch.stack([dm.val_set[i][0] for i in range(len(files))])
    assert_predicted_as_evaluated(rows, objects.model, dm, images, files)
    # val/ is a folder of class folders: the files are labelled by them and scored as eval.py scored them
    scored = json.loads((tmp_path / "predict" / "metrics.json").read_text())
    assert scored["acc1"] == pytest.approx(evaluated["val/acc1"], abs=1e-6)
    assert "acc5" not in scored and "val/acc5" not in evaluated  # 3 classes
    assert scored["per_class_acc"] == pytest.approx(out.per_class_acc, abs=1e-6)
    # src/export.py: timm's transform from the exported config is the workers' evaluation transform (timm's
    # own, run here on tensors: pixels within 2 levels), so timm alone classifies the photos as predict.py
    _, folder = export_model(
        compose_cfg("export", [f"ckpt_path={last}", "extras.print_config=false"], tmp_path / "x")
    )
    rebuilt = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    config = timm.data.resolve_data_config({}, model=rebuilt)
    assert (config["input_size"], config["crop_pct"], config["interpolation"]) == (
        (3, dm.img_size, dm.img_size),
        dm._spec["crop_pct"],
        dm._spec["interpolation"],
    )
    transform = timm.data.create_transform(**config)
    with torch.no_grad():
        probabilities = rebuilt(
            torch.stack([transform(Image.open(f).convert("RGB")) for f in files])
        ).softmax(-1)
    assert [CLASSES[i] for i in probabilities.argmax(-1)] == [row["class"] for row in rows]
    assert probabilities.max(-1).values.tolist() == pytest.approx(
        [float(r["probability"]) for r in rows], abs=0.01
    )

    other = tmp_path / "other"
    shutil.copytree(photos, other)
    for split in ("train", "val"):
        shutil.copytree(other / split / "cat", other / split / "dog")
    with pytest.raises(CheckpointError, match=r"trained on other classes \(3 classes, the data has 4\)"):
        evaluate(compose_cfg("eval", [f"ckpt_path={last}", f"datamodule.data_dir={other}"], tmp_path / "e2"))


@pytest.mark.slow
def test_ctrl_c_saves_last_and_reports_and_a_second_one_stops_at_once(photos: Path, tmp_path: Path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) stops at the next step like SIGTERM:
    `last` saved, the report written, exit 130, resumable. The loader's workers get it too and keep serving
    (a worker's default is to exit on it, which breaks the loader mid-epoch). A second Ctrl-C stops at once,
    without saving, as Lightning does (exit 1). Ctrl-C in the test after fit stops the test (exit 130) and the
    report is written, saying how to test the checkpoint (before: Lightning's exit 1 and no report)."""
    run, children = tmp_path / "run", tmp_path / "children"
    base = [
        *_overrides(photos, tmp_path / "cache"),
        "datamodule.num_workers=2",
        "trainer.max_epochs=2",
        f"hydra.run.dir={run}",
    ]
    fault = ["+callbacks.fault._target_=fault_injection.InterruptAt", "+callbacks.fault.step=3"]
    env = {"PYTHONPATH": str(ROOT / "tests")}
    stopped = run_cli("train.py", [*base, *fault, f"+callbacks.fault.children_file={children}"], env=env)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    # said once, by the training process (not again by each worker, which inherits the handler)
    assert stopped.stderr.count("SIGINT (Ctrl-C) received: stopping at the next step boundary") == 1
    before, after = (int(n) for n in children.read_text().split())
    assert before >= 2 and after == before, "the loader's workers died of the Ctrl-C"
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3
    assert (
        "`weights_only` was not set" not in stopped.stdout + stopped.stderr
    )  # Lightning's note on a save without it
    report = json.loads((run / "report.json").read_text())
    assert report["stopped"]["by"] == "SIGINT (Ctrl-C)" and report["stopped"]["step"] == 3, report["stopped"]
    assert "by SIGINT (Ctrl-C) at step 3" in (run / "report.md").read_text()
    resumed = run_cli("train.py", [*base, "ckpt_path=last"], env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = 2 * (N_TRAIN_ALL // 8)
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == steps

    twice = tmp_path / "twice"
    aborted = run_cli(
        "train.py", [*base[:-1], f"hydra.run.dir={twice}", *fault, "+callbacks.fault.times=2"], env=env
    )
    assert aborted.returncode == 1, aborted.stderr[-3000:]
    assert "Ctrl-C again stops at once without saving" in aborted.stderr
    assert not (twice / "checkpoints" / "last.ckpt").exists()

    # in the test after fit: the test stops, the report of the training is written and says how to test
    tested = tmp_path / "tested"
    one_epoch = [o for o in base if o not in ("trainer.max_epochs=2", f"hydra.run.dir={run}")]
    fault = ["+callbacks.fault._target_=fault_injection.InterruptAt", "+callbacks.fault.test_batch=0"]
    stopped = run_cli("train.py", [*one_epoch, f"hydra.run.dir={tested}", *fault], env=env)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "SIGINT (Ctrl-C) received: stopping the test; the training is saved" in stopped.stderr
    assert "Traceback" not in stopped.stderr and "Detected KeyboardInterrupt" not in stopped.stdout
    best = next((tested / "checkpoints").glob("epoch*.ckpt"))
    report = json.loads((tested / "report.json").read_text())
    assert report["test_stopped"] == {"stopped_by": "SIGINT (Ctrl-C)", "ckpt_path": str(best)}, report
    assert not report["stopped"] and report["metrics"]["test"] == {}
    assert (
        "No test metrics: the test was stopped by SIGINT (Ctrl-C); test the checkpoint with "
        f"`python src/eval.py ckpt_path={best}`."
    ) in (tested / "report.md").read_text()


def test_photos_are_turned_upright_by_their_exif_orientation_on_every_path(tmp_path: Path):
    """A phone's portrait photo is stored landscape with an EXIF orientation: every decoder reads it upright,
    as PIL's `exif_transpose` turns it (before: as stored, sideways): the workers' tensor and PIL decoders
    (JPEG, PNG, WebP), the in-memory decode, and the GPU decoder (run on the CPU), whose crop box the worker
    draws in the upright image (its size from the header, no pixel decoded) and which turns nvJPEG's output."""
    from PIL import ImageOps

    from vitrain.data.gpu_decode import GpuDecoder, draw_crop, encoded_sample, resize_crops
    from vitrain.data.readers.decode import decode_square
    from vitrain.data.transforms import decode_pil, decode_tensor

    stored = torch.randint(0, 256, (30, 50, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    photo = Image.fromarray(stored.numpy())
    for fmt, orientation in [("JPEG", 6), ("JPEG", 8), ("JPEG", 3), ("JPEG", 1), ("PNG", 6), ("WEBP", 6)]:
        exif = Image.Exif()
        exif[0x0112] = orientation
        path = tmp_path / f"o{orientation}.{fmt.lower()}"
        photo.save(path, fmt, exif=exif, **({"lossless": True} if fmt == "WEBP" else {"quality": 95}))
        data = path.read_bytes()
        upright = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
        want = torch.from_numpy(np.array(upright)).permute(2, 0, 1)
        assert want.shape[1:] == ((50, 30) if orientation in (6, 8) else (30, 50))
        assert torch.equal(torch.from_numpy(np.array(decode_pil(data))).permute(2, 0, 1), want), (
            fmt,
            orientation,
        )
        assert (decode_tensor(data).int() - want.int()).abs().max() <= 1, (fmt, orientation)
        # in memory: the upright photo's centred square, as for a photo saved upright
        plain = tmp_path / f"plain{orientation}.png"
        upright.save(plain)
        assert torch.equal(
            decode_square(str(path), 30, Image.BILINEAR), decode_square(str(plain), 30, Image.BILINEAR)
        )
        # the GPU path: the box drawn in the upright image, the decode turned upright before the crop
        blob, box, flip, _, read = encoded_sample(data, seed=7, hflip=0.5, index=0)
        assert read == orientation and (box, flip) == draw_crop(*want.shape[1:], 7, 0.5)
        decoder = GpuDecoder(16, (0.5,) * 3, (0.25,) * 3, device="cpu")
        boxes, flips = torch.tensor([box]), torch.tensor([flip])
        got = decoder.crops([blob], boxes, flips, torch.tensor([read]))
        assert (got - resize_crops([want], boxes, 16, flips)).abs().max() <= 1.5, (fmt, orientation)


def test_imbalanced_classes_are_said(photos: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """A class with a tenth of another's training images: one warning at set-up, naming both (accuracy then
    mostly measures the large classes); the counts per class are in the run's data facts (report.md)."""
    root = tmp_path / "mine"
    shutil.copytree(photos, root)
    for extra in sorted((root / "train" / CLASSES[2]).iterdir())[2:]:
        extra.unlink()
    with caplog.at_level(logging.WARNING):
        dm = ImageFolderDataModule(str(root), str(tmp_path / "cache"), batch_size=2, in_memory=False)
        dm.setup("fit")
        dm.setup("test")  # the test after fit: said once, at the data's set-up
    counts = dm.data_facts()["train_class_images"]
    assert counts == {CLASSES[0]: 22, CLASSES[1]: 21, CLASSES[2]: 2}
    [warning] = [r.getMessage() for r in caplog.records if "imbalanced" in r.getMessage()]
    assert f"{CLASSES[0]} has 22 images, {CLASSES[2]} 2 (11x)" in warning, warning
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ImageFolderDataModule(str(photos), str(tmp_path / "cache"), batch_size=2, in_memory=False).setup(
            "fit"
        )
    assert not [r for r in caplog.records if "imbalanced" in r.getMessage()]


def test_albums_and_other_formats_are_read_and_the_rest_is_counted(photos: Path, tmp_path: Path, caplog):
    """Photos as people keep them: in sub-folders (albums) of a class folder, as BMP, GIF and TIFF, among
    files that are not images. The images are all read (before: the sub-folders' and the BMP/GIF/TIFF ones
    left out, silently); the rest is counted in a warning by suffix; hidden files and folders are not read."""
    root = tmp_path / "mine"
    shutil.copytree(photos, root)
    cat = root / "train" / CLASSES[0]
    (cat / "2019" / "summer").mkdir(parents=True)
    picture = Image.open(next(cat.glob("*.jpg"))).convert("RGB")
    picture.save(cat / "2019" / "summer" / "beach.jpg")
    for fmt in ("BMP", "GIF", "TIFF", "PPM"):
        picture.save(cat / f"scan.{fmt.lower()}", fmt)
    (cat / "IMG_0001.heic").write_bytes(b"not decodable here")
    (cat / "notes.txt").write_text("taken with my phone")
    (cat / ".DS_Store").write_bytes(b"\0")
    (cat / ".thumbnails").mkdir()
    picture.save(cat / ".thumbnails" / "t.jpg")
    with caplog.at_level(logging.WARNING):
        dm = ImageFolderDataModule(str(root), str(tmp_path / "cache"), batch_size=4, in_memory=False)
        dm.setup("fit")
    assert len(dm.train_set) == N_TRAIN_ALL + 5
    read = {Path(f).name for f, _ in dm.train_set.files}
    assert {"beach.jpg", "scan.bmp", "scan.gif", "scan.tiff", "scan.ppm"} <= read and "t.jpg" not in read
    [warning] = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert "left out 2 file(s) that are not" in warning and "(.heic: 1, .txt: 1)" in warning, warning
    for name in (
        "scan.bmp",
        "scan.tiff",
        "scan.gif",
        "scan.ppm",
    ):  # decoded as the CPU path does, and by the GPU decoder
        i = next(i for i, (f, _) in enumerate(dm.train_set.files) if f.endswith(name))
        assert dm.train_set[i][0].shape == (3, 224, 224)
        blob = torch.frombuffer(bytearray((cat / name).read_bytes()), dtype=torch.uint8)
        assert GpuDecoder(20, (0.5,) * 3, (0.5,) * 3, device="cpu").decode([blob])[0].shape[0] == 3
    # a 16-bit PNG: torchvision decodes it to uint16 (0-65535), which the GPU decoder passed on as pixels
    deep = io.BytesIO()
    Image.fromarray((torch.arange(400).reshape(20, 20) * 160).numpy().astype("uint16")).save(deep, "PNG")
    blob = torch.frombuffer(bytearray(deep.getvalue()), dtype=torch.uint8)
    [image] = GpuDecoder(20, (0.5,) * 3, (0.5,) * 3, device="cpu").decode([blob])
    assert image.dtype == torch.uint8 and image.shape == (3, 20, 20) and image.max() > 200


def test_a_zip_of_photos_is_unpacked_once(photos: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """A .zip (what a photo export or Kaggle gives), with a member that points outside the folder: unpacked
    once into the cache, nothing written outside it; copied again, unpacked again with the older unpack
    named; a damaged .zip is one line."""
    archive = tmp_path / "mine.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for f in sorted(photos.rglob("*")):
            if f.is_file():
                zf.write(f, f"mine/{f.relative_to(photos)}")
        zf.writestr("../../escaped.txt", "outside")
    cache = tmp_path / "cache"
    dm = ImageFolderDataModule(str(archive), str(cache), batch_size=4, in_memory=False)
    assert dm.classes == list(CLASSES)
    dm.setup("fit")
    assert len(dm.train_set) == N_TRAIN_ALL and len(dm.val_set) == N_VAL_ALL
    [unpacked] = list((cache / "unpacked").iterdir())
    assert not list(tmp_path.rglob("escaped.txt")) or all(
        p.is_relative_to(unpacked) for p in tmp_path.rglob("escaped.txt")
    )
    ImageFolderDataModule(str(archive), str(cache), batch_size=4, in_memory=False).setup("fit")
    assert list((cache / "unpacked").iterdir()) == [unpacked]  # once
    # copied again (a new mtime): unpacked anew, and the older unpack named, not removed (a run may read it)
    os.utime(archive, (archive.stat().st_atime, archive.stat().st_mtime + 60))
    with caplog.at_level(logging.WARNING):
        ImageFolderDataModule(str(archive), str(cache), batch_size=4, in_memory=False).setup("fit")
    assert len(list((cache / "unpacked").iterdir())) == 2 and unpacked.is_dir()
    [note] = [r.getMessage() for r in caplog.records if "has changed since it was unpacked" in r.getMessage()]
    assert f"the older unpack(s) {unpacked} can be removed once no run reads them" in note
    archive.write_bytes(archive.read_bytes()[:2000])
    with pytest.raises(DataError, match=r"cannot unpack .*mine.zip .*truncated or corrupted"):
        ImageFolderDataModule(str(archive), str(tmp_path / "cache2"), batch_size=4).setup("fit")


def test_archive_is_unpacked_once_and_val_carved(photos: Path, tmp_path: Path):
    """A .tar.gz of a tree with only train/: unpacked once into the cache, validation carved from train."""
    archive = tmp_path / "mine.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(photos / "train", arcname="mine/train")
    dm = ImageFolderDataModule(
        str(archive), str(tmp_path / "cache"), batch_size=4, val_size=0.2, in_memory=False
    )
    assert dm.classes == list(CLASSES)
    dm.setup("fit")
    assert len(dm.train_set) + len(dm.val_set) == N_TRAIN_ALL and len(dm.val_set) == round(0.2 * N_TRAIN_ALL)
    # each class its share of the 13 (22, 21 and 21 images: 4.5, 4.3, 4.3), not what a random carve leaves it
    assert Counter(label for _, label in dm.val_set.files) == {0: 5, 1: 4, 2: 4}
    assert dm.test_set.files == dm.val_set.files
    unpacked = list((tmp_path / "cache" / "unpacked").iterdir())
    assert len(unpacked) == 1 and ImageFolderDataModule(
        str(archive), str(tmp_path / "cache")
    ).root().is_relative_to(unpacked[0])
    x, y = next(iter(dm.train_dataloader()))
    # uint8 from the workers; normalised where the batch lands (a float, model-ready batch is left alone)
    assert x.shape == (4, 3, 224, 224) and x.dtype == torch.uint8 and y.dtype == torch.long
    model_input, _ = dm.on_after_batch_transfer((x, y), 0)
    assert model_input.dtype == torch.float32 and model_input.shape == x.shape
    assert dm.on_after_batch_transfer((model_input, y), 0)[0] is model_input


def _tree(tmp_path: Path, photos: Path) -> Path:
    root = tmp_path / "tree"
    shutil.copytree(photos, root)
    return root


def _classes_and_setup(root: Path, tmp_path: Path, **kwargs) -> ImageFolderDataModule:
    dm = ImageFolderDataModule(
        str(root), str(tmp_path / "cache"), batch_size=4, **{"in_memory": False, **kwargs}
    )
    dm.classes  # noqa: B018 - the folder listing
    dm.setup("fit")
    return dm


def test_bad_input_is_one_line(photos: Path, tmp_path: Path):
    root = _tree(tmp_path, photos)
    broken = root / "train" / "cat" / "broken.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(DataError, match=r"broken\.jpg is not a readable image.*bad_images=skip"):
        _classes_and_setup(root, tmp_path)
    dm = _classes_and_setup(root, tmp_path, bad_images="skip")
    assert len(dm.train_set) == N_TRAIN_ALL and dm.skipped[0][0] == str(broken)
    broken.unlink()

    (root / "val" / "dog").mkdir()
    (root / "val" / "dog" / "0.jpg").write_bytes((root / "val" / "cat" / "020.jpeg").read_bytes())
    with pytest.raises(DataError, match=r"other classes than train/ \(extra: \['dog'\]"):
        _classes_and_setup(root, tmp_path)
    shutil.rmtree(root / "val" / "dog")

    (root / "train" / "empty").mkdir()
    (root / "val" / "empty").mkdir()
    with pytest.raises(DataError, match=r"train/empty holds no .*images"):
        _classes_and_setup(root, tmp_path)

    bare = tmp_path / "bare"
    (bare / "train" / "a").mkdir(parents=True)
    (bare / "train" / "a" / "notes.txt").write_text("no images")
    with pytest.raises(DataError, match=r"holds no .*images"):
        _classes_and_setup(bare, tmp_path)
    with pytest.raises(DataError, match=r"has no train/<class>/ folder"):
        _classes_and_setup(tmp_path / "bare" / "train", tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        _classes_and_setup(tmp_path / "nowhere", tmp_path)


def test_head_mismatch_and_bad_image_errors(photos: Path, tmp_path: Path):
    """A head that does not fit the data is refused before building anything; through the CLI a truncated
    JPEG is one line and exit 2, before training."""
    with pytest.raises(
        DataError, match=r"model.net.num_classes=10 but the data has 3 classes \(bird, cat, ship\)"
    ):
        train(compose_cfg("train", [*_overrides(photos, tmp_path), "model.net.num_classes=10"], tmp_path))
    root = _tree(tmp_path, photos)
    (root / "train" / "ship" / "trunc.jpg").write_bytes(
        (root / "val" / "cat" / "020.jpeg").read_bytes()[:300]
    )
    code, stderr = fails_in_process("train", _overrides(root, tmp_path), tmp_path / "run")
    assert code == 2 and "trunc.jpg is not a readable image" in stderr, stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists(), "stopped before training"
    # a float TIFF (PIL's convert clipped it: a black image in training)
    (root / "train" / "ship" / "trunc.jpg").unlink()
    Image.fromarray(torch.rand(40, 50).numpy()).save(root / "train" / "ship" / "scan.tif")
    code, stderr = fails_in_process("train", _overrides(root, tmp_path), tmp_path / "run2")
    assert code == 2 and stderr.strip().endswith(
        "scan.tif is not a readable image (32-bit float pixels (PIL mode F) have no 8-bit scale: save the image "
        "with 8 or 16 bits per channel) in train/: remove or replace it, or set datamodule.bad_images=skip"
    ), stderr[-3000:]


def test_unreadable_file_found_by_a_worker_is_one_line(photos: Path, tmp_path: Path):
    """With verify_images=false a bad file is met by a loader worker, whose error torch re-raises with the
    worker's traceback as its message: the user still gets the one line that names the file."""
    root = _tree(tmp_path, photos)
    (root / "train" / "ship" / "trunc.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    overrides = [*_overrides(root, tmp_path), "datamodule.verify_images=false", "datamodule.batch_size=64"]
    code, stderr = fails_in_process("train", overrides, tmp_path / "run")
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("error: cannot decode ") and "trunc.jpg" in lines[0], lines[0]


class IndexSample:
    """Stands in for ImageFileDataset.__getitem__: the sample's index as its 'image', to record the order."""

    def __getitem__(self, key):
        index = key[1] if isinstance(key, tuple) else key
        return torch.tensor([float(index)]), 0


class SaveAt(L.Callback):
    """Save a checkpoint after training batch `step`, where the SIGTERM callback saves (a kill after it
    loses nothing)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, use_distributed_sampler=False, **{"max_epochs": 1, **kwargs},
    )  # fmt: skip


def test_mid_epoch_resume_continues_the_epoch(photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Checkpoint after 3 of 8 batches (2 loader workers), resume from it: the batches before the save and the
    resumed run's are the samples of one uninterrupted epoch, each once, in the same order (the loader starts
    past the batches the restored loop completed; it keeps no state of its own)."""
    monkeypatch.setattr(image_folder.ImageFileDataset, "__getitem__", IndexSample.__getitem__)

    def dm() -> ImageFolderDataModule:
        return ImageFolderDataModule(
            str(photos), str(tmp_path / "cache"), batch_size=8, num_workers=2, in_memory=False
        )

    ckpt = tmp_path / "mid.ckpt"
    whole = Recorder()
    _trainer(callbacks=[SaveAt(3, ckpt)], default_root_dir=tmp_path).fit(whole, datamodule=dm())
    assert len(whole.seen) == 8 * (N_TRAIN_ALL // 8) and sorted(whole.seen) == list(range(N_TRAIN_ALL))
    saved = torch.load(ckpt, weights_only=True)["loops"]["fit_loop"]
    assert saved["epoch_loop.batch_progress"]["current"]["processed"] == 3  # what the loader resumes from
    assert "combined_loader" not in saved["state_dict"], "no loader state: the counters are enough"

    rest = Recorder()
    _trainer(default_root_dir=tmp_path).fit(rest, datamodule=dm(), ckpt_path=ckpt)
    assert whole.seen[:24] + rest.seen == whole.seen


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT)
def test_ddp_two_processes_exact_eval(photos: Path, tmp_path: Path):
    """2 DDP processes train from the folder; the 9 validation images are evaluated 5 + 4, none twice."""
    args = [*_overrides(photos, tmp_path), "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu",
            "+trainer.limit_train_batches=2", f"hydra.run.dir={tmp_path / 'run'}",
            "+callbacks.eval_samples._target_=helpers.EvalSamples", f"+callbacks.eval_samples.out={tmp_path}"]  # fmt: skip
    done = run_cli("train.py", args, env={"PYTHONPATH": str(ROOT / "tests")}, timeout=RUN_TIMEOUT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in done.stdout + done.stderr
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["class_names"] == list(CLASSES) and ckpt["global_step"] == 2
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(map(len, ranks)) == [4, 5]
    assert len(set(ranks[0]) | set(ranks[1])) == N_VAL_ALL


# --- decode_device=cuda: the GPU decode path, its decoder on the CPU ----------------------------------------


@pytest.fixture(scope="module")
def noise(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 classes x 8 training images of random noise, 20..48 px a side, PNG and JPEG in turn."""
    return make_noise_folder(tmp_path_factory.mktemp("noise") / "folder", seed=0)


@pytest.fixture
def decode_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_device=cuda with the decoder on the CPU: the seam the GPU path's tests use (no mock of decoding)."""
    monkeypatch.setattr(ImageFolderDataModule, "decode_on", lambda self: torch.device("cpu"))


def _gpu_dm(root: Path, tmp_path: Path, workers: int = 0, **kwargs) -> ImageFolderDataModule:
    dm = ImageFolderDataModule(
        str(root), str(tmp_path / "cache"), num_workers=workers, in_memory=False, decode_device="cuda",
        **{"batch_size": 4, **kwargs},
    )  # fmt: skip
    dm.set_input_spec(16, (0.4, 0.5, 0.6), (0.2, 0.25, 0.3))
    dm.classes  # noqa: B018 - the folder listing
    dm.setup("fit")
    return dm


def _decoded(dm: ImageFolderDataModule, epoch: int, batches_done: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """Every training batch of `epoch` as the training process gets it, from `batches_done` on."""
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(epoch)
    loader._batches_done = lambda: batches_done
    return [dm.on_before_batch_transfer(batch, 0) for batch in loader]


def test_gpu_decode_batches_are_normalised_crops(noise: Path, tmp_path: Path, decode_on_cpu: None):
    """Workers hand over bytes + crop box + flip; the training process decodes them (PNG and JPEG) into
    normalised model-size images: each row is its file's box resized, flipped if drawn, normalised.
    Validation keeps timm's eval transform in the workers; train_subset keeps the encoded dataset."""
    from torchvision.io import ImageReadMode, decode_image

    dm = _gpu_dm(noise, tmp_path)
    loader = dm.train_dataloader()
    (encoded, labels), *_ = loader
    assert isinstance(encoded, EncodedBatch) and encoded.boxes.shape == (4, 4)
    assert {Path(p).suffix for p, _ in dm.train_set.files} == {".png", ".jpg"}
    x, y = dm.on_before_batch_transfer((encoded, labels), 0)
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.float32 and torch.equal(y, labels)

    mean, std = torch.tensor([0.4, 0.5, 0.6])[:, None, None], torch.tensor([0.2, 0.25, 0.3])[:, None, None]
    for row, blob, (top, left, h, w), flip in zip(
        x, encoded.blobs(), encoded.boxes.tolist(), encoded.flips, strict=True
    ):
        img = decode_image(blob, mode=ImageReadMode.RGB)[None, :, top : top + h, left : left + w].float()
        crop = torch.nn.functional.interpolate(img, size=(16, 16), mode="bilinear", antialias=True)[0]
        crop = crop.clamp(0, 255).flip(-1) if flip else crop.clamp(0, 255)
        torch.testing.assert_close(row, (crop / 255 - mean) / std, atol=1e-4, rtol=0)

    epoch = [dm.on_before_batch_transfer(b, 0)[0] for b in loader]  # every PNG and JPEG decodes
    assert len(epoch) == len(dm.train_set) // 4 and all(b.shape == (4, 3, 16, 16) for b in epoch)
    val_x, _ = next(iter(dm.val_dataloader()))
    assert val_x.shape == (4, 3, 16, 16), "eval batches arrive decoded"
    assert dm.on_before_batch_transfer((val_x, _), 0)[0] is val_x

    small = _gpu_dm(noise, tmp_path, train_subset=5)
    assert type(small.train_set) is image_folder.EncodedFileDataset and len(small.train_set) == 5


def test_gpu_decode_names_a_damaged_file(noise: Path, tmp_path: Path, decode_on_cpu: None):
    """A JPEG whose header reads but whose pixels do not (a damaged file, verify_images=false) reaches the
    batch decode: the error names that file in one line, not torchvision's "Image is incomplete"."""
    root = tmp_path / "folder"
    shutil.copytree(noise, root)
    victim = sorted((root / "train").rglob("*.jpg"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])  # the header intact, the scan cut
    dm = _gpu_dm(root, tmp_path, verify_images=False)
    with pytest.raises(DataError) as err:
        for batch in dm.train_dataloader():  # the batch that holds it
            dm.on_before_batch_transfer(batch, 0)
    assert re.fullmatch(
        rf"cannot decode {re.escape(str(victim))} \(.*\): remove or replace it \(datamodule.verify_images=true "
        r"finds such files before training\)",
        str(err.value),
    ), str(err.value)
    assert "\n" not in str(err.value) and ".cpp" not in str(err.value)


class ThreadOfBatches(DecodedRecorder):
    """DecodedRecorder that also notes the threads running while each training step runs."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[set[str]] = []

    def training_step(self, batch, batch_idx):
        self.threads.append({t.name for t in threading.enumerate()})
        return super().training_step(batch, batch_idx)


def test_gpu_decode_ahead_in_a_thread_gives_the_inline_batches(
    noise: Path, tmp_path: Path, decode_on_cpu: None
):
    """decode_ahead=2 (the default): in a trainer a thread decodes the training batches ahead; with the random
    augmentation on (RandAugment, random erasing: drawn on the training thread, after the thread's crops) the
    steps get bitwise the batches of decode_ahead=0, where the training thread decodes, over two epochs; the
    thread ends with each pass. Each pass is left before its end (4 of 6 batches), so the thread is still
    decoding when the loader's next pass resets the persistent workers' iterator it reads from."""

    def run(ahead: int) -> ThreadOfBatches:
        dm = ImageFolderDataModule(
            str(noise), str(tmp_path / "cache"), batch_size=4, num_workers=2, in_memory=False, decode_device="cuda",
            img_size=16, decode_ahead=ahead, auto_augment="rand-m9-n2-mstd0.5", re_prob=0.5,
        )  # fmt: skip
        model = ThreadOfBatches()
        L.seed_everything(3)
        _trainer(max_epochs=2, limit_train_batches=4).fit(model, datamodule=dm)
        return model

    inline, ahead = run(0), run(2)
    assert len(inline.seen) == len(ahead.seen) == 8
    assert all(torch.equal(a, b) for a, b in zip(inline.seen, ahead.seen, strict=True))
    assert not any("gpu-decode-ahead" in names for names in inline.threads)
    # each epoch's first step runs while the thread decodes the batches after it
    assert "gpu-decode-ahead" in ahead.threads[0] and "gpu-decode-ahead" in ahead.threads[4]
    time.sleep(0.5)  # the last pass's thread sees its end
    assert "gpu-decode-ahead" not in {t.name for t in threading.enumerate()}
    with pytest.raises(DataError, match=r"^datamodule.decode_ahead=-1 must be a whole number of batches, at"):
        ImageFolderDataModule(str(noise), str(tmp_path / "cache"), decode_ahead=-1)


def test_gpu_decode_ahead_names_a_damaged_file_and_stops(noise: Path, tmp_path: Path, decode_on_cpu: None):
    """A file that does not decode, met by the decode thread: the training thread raises the same one-line
    error; a pass left before its end (the consumer gone) stops the thread."""
    root = tmp_path / "folder"
    shutil.copytree(noise, root)
    victim = sorted((root / "train").rglob("*.jpg"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    dm = _gpu_dm(root, tmp_path, verify_images=False)
    dm.trainer = _trainer()
    loader = dm.train_dataloader()
    assert loader.ahead is not None
    with pytest.raises(DataError, match=rf"^cannot decode {re.escape(str(victim))} \("):
        for batch in loader:
            dm.on_before_batch_transfer(batch, 0)
    shutil.copy2(noise / victim.relative_to(root), victim)  # mended: a pass left after one batch
    passes = iter(loader)
    next(passes)
    passes.close()
    time.sleep(0.5)
    assert "gpu-decode-ahead" not in {t.name for t in threading.enumerate()}


def test_gpu_decode_boxes_are_rrc_boxes_of_the_header_size(
    noise: Path, tmp_path: Path, decode_on_cpu: None, monkeypatch: pytest.MonkeyPatch
):
    """Each sample's box and flip are `draw_crop` from (seed, epoch, index) and the size in the file's header
    (the size the decoder then decodes, read without decoding a pixel): boxes inside the image, of 8-100 % of
    its area at an aspect ratio of 3/4..4/3 (GpuDecoder's rrc_box), or its centred fallback."""
    from PIL import ImageFile
    from torchvision.io import decode_image

    from vitrain.data.gpu_decode import draw_crop, rrc_box
    from vitrain.data.sampling import sample_seed

    dm = _gpu_dm(noise, tmp_path)
    data = dm.train_set
    with monkeypatch.context() as patch:
        patch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("the header read decoded pixels"))
        samples = [data[(3, i)][0] for i in range(len(data))]
    for i, (blob, box, flip, index, orientation) in enumerate(samples):
        assert index == i and orientation == 1  # no EXIF here
        _, h, w = decode_image(blob).shape
        assert (box, flip) == draw_crop(h, w, sample_seed(dm.hparams.shuffle_seed, 3, i), 0.5)
    assert [s[1] for s in samples] != [data[(4, i)][0][1] for i in range(len(data))], (
        "other epoch, other crops"
    )

    for seed in range(400):
        h, w = 20 + seed % 37, 20 + (seed * 7) % 41
        top, left, ch, cw = rrc_box(h, w, torch.Generator().manual_seed(seed))
        assert min(top, left) >= 0 and top + ch <= h and left + cw <= w
        centred = (top, left) == ((h - ch) // 2, (w - cw) // 2)
        # sides are rounded: allow a pixel either way on the area and the ratio
        assert centred or ((ch - 1) * (cw - 1) <= h * w and (ch + 1) * (cw + 1) >= 0.08 * h * w)
        assert centred or ((cw - 1) / (ch + 1) <= 4 / 3 and (cw + 1) / (ch - 1) >= 3 / 4)


def test_gpu_decode_batches_resume_and_ignore_workers(noise: Path, tmp_path: Path, decode_on_cpu: None):
    """The crops are a function of (seed, epoch, index): 2 workers and 0 give bitwise the same batches, and a
    run resumed mid-epoch from a checkpoint (0 workers) continues with the batches the whole run (2) saw."""
    none, two = _decoded(_gpu_dm(noise, tmp_path, 0), 1), _decoded(_gpu_dm(noise, tmp_path, 2), 1)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(none, two, strict=True))

    def dm(workers: int) -> ImageFolderDataModule:
        return ImageFolderDataModule(
            str(noise), str(tmp_path / "cache"), batch_size=4, num_workers=workers, in_memory=False,
            decode_device="cuda", img_size=16,
        )  # fmt: skip

    ckpt = tmp_path / "mid.ckpt"
    whole = DecodedRecorder()
    _trainer(max_epochs=2, callbacks=[SaveAt(8, ckpt)], default_root_dir=tmp_path).fit(
        whole, datamodule=dm(2)
    )
    rest = DecodedRecorder()
    _trainer(max_epochs=2, default_root_dir=tmp_path).fit(rest, datamodule=dm(0), ckpt_path=ckpt)
    assert len(whole.seen) == 12 and len(rest.seen) == 4
    assert all(torch.equal(a, b) for a, b in zip(whole.seen[8:], rest.seen, strict=True))
    assert whole.seen[0].shape == (4, 3, 16, 16) and not torch.equal(whole.seen[0], whole.seen[6])


def test_gpu_decode_options_and_fallback(
    noise: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """Bad decode_device and auto-augment policies the GPU does not have are one line each; the GPU's
    RandAugment and random erasing run on the decoded batch; without CUDA: one warning, CPU decoding."""

    def refused(match: str, **kwargs) -> None:
        with pytest.raises(DataError, match=match) as err:
            ImageFolderDataModule(str(noise), str(tmp_path), **kwargs)
        assert "\n" not in str(err.value)

    refused(r"decode_device='bogus': choose cpu or cuda", decode_device="bogus")
    refused(
        r"auto_augment='rand-m9-mstd0.5-inc1'.*decode_device=cuda.*set datamodule.decode_device=cpu",
        decode_device="cuda",
        auto_augment="rand-m9-mstd0.5-inc1",
    )
    refused(r"auto_augment='augmix-m5'.*decode_device=cpu", decode_device="cuda", auto_augment="augmix-m5")
    refused(r"re_prob=1.5 must be between 0 and 1", decode_device="cuda", re_prob=1.5)
    ImageFolderDataModule(str(noise), str(tmp_path), auto_augment="rand-m9-mstd0.5-inc1")  # timm's, on CPUs

    if not torch.cuda.is_available():
        with caplog.at_level("WARNING"):
            dm = _gpu_dm(noise, tmp_path)
        assert caplog.text.count("no CUDA device in this process, decoding on the CPU instead") == 1
        x, _ = next(iter(dm.train_dataloader()))
        assert x.shape == (4, 3, 16, 16), "the workers decode"

    monkeypatch.setattr(ImageFolderDataModule, "decode_on", lambda self: torch.device("cpu"))
    plain = _decoded(_gpu_dm(noise, tmp_path), 0)[0][0]
    torch.manual_seed(0)
    augmented = _decoded(_gpu_dm(noise, tmp_path, auto_augment="rand-m9-n2-mstd0.5", re_prob=0.5), 0)[0][0]
    assert augmented.shape == plain.shape and not torch.equal(augmented, plain)


def test_gpu_decode_trains_through_the_cli(noise: Path, tmp_path: Path, decode_on_cpu: None):
    """`datamodule.decode_device=cuda` from the config: training steps get the decoded batches."""
    cfg = compose_cfg(
        "train",
        [
            *_overrides(noise, tmp_path, batch_size=4),
            "datamodule.decode_device=cuda",
            "+trainer.limit_train_batches=2",
        ],
        tmp_path,
    )
    metrics, objects = train(cfg)
    assert objects.trainer.global_step == 2 and "val/acc1" in metrics
    assert objects.datamodule._gpu_decoder is not None


def test_test_subset_keeps_sampled_files(photos: Path, tmp_path: Path):
    """From disk, `test_subset` keeps the sampled files (the test split here is val/, sorted by class); the
    validation split it was taken from stays whole."""
    whole = _classes_and_setup(photos, tmp_path)
    dm = _classes_and_setup(photos, tmp_path, test_subset=5)
    picked = torch.randperm(len(whole.test_set), generator=torch.Generator().manual_seed(0))[:5].sort().values
    assert dm.test_set.files == [whole.test_set.files[i] for i in picked.tolist()]
    assert dm.val_set.files == whole.val_set.files
    _, y = next(iter(dm.test_dataloader()))
    assert len(y) == 4 and y.tolist() == [label for _, label in dm.test_set.files[:4]]


def test_colour_jitter_only_when_asked_and_only_in_workers(photos: Path, tmp_path: Path, caplog):
    """timm's create_transform jitters colours by default (0.4); the in-memory and GPU-decode paths do not,
    so the workers' transform does not either unless `color_jitter` asks; a value the workers cannot apply
    there is refused in one line, and `in_memory=auto` then decodes from disk."""
    from torchvision.transforms import ColorJitter

    from vitrain.data.transforms import TensorPipeline, timm_transform

    def jitters(transform) -> list[ColorJitter]:
        ops = getattr(transform, "transforms", None)
        if ops is None:  # a TensorPipeline: the ops after the crop that run on a PIL image
            ops = [o for op in transform.ops if type(op).__name__ == "_OnPil" for o in op.op]
        return [t for t in ops if isinstance(t, ColorJitter)]

    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    assert jitters(timm_transform(True, 32, mean, std, {})) == []
    (jitter,) = jitters(timm_transform(True, 32, mean, std, {}, color_jitter=0.4))
    assert jitter.brightness == (0.6, 1.4) and jitter.hue is None
    (jitter,) = jitters(timm_transform(True, 32, mean, std, {}, color_jitter=[0.1, 0.2, 0.3, 0.05]))
    assert jitter.contrast == (0.8, 1.2) and jitter.hue == (-0.05, 0.05)
    assert jitters(timm_transform(False, 32, mean, std, {}, color_jitter=0.4)) == []  # evaluation

    dm = _classes_and_setup(photos, tmp_path, color_jitter=0.3)
    assert len(jitters(dm.train_set.transform)) == 1  # timm's, on a PIL image of the crop
    # no jitter: timm's crop and flip, run on uint8 tensors
    assert isinstance(_classes_and_setup(photos, tmp_path).train_set.transform, TensorPipeline)

    for bad in (-0.1, [0.1, 0.2], "much", True):
        with pytest.raises(DataError, match=r"^datamodule\.color_jitter=.*: use null") as err:
            ImageFolderDataModule(str(photos), str(tmp_path), color_jitter=bad)
        assert "\n" not in str(err.value)
    with pytest.raises(DataError, match=r"color_jitter runs in the loader workers.*decode_device=cpu$"):
        ImageFolderDataModule(str(photos), str(tmp_path), color_jitter=0.4, decode_device="cuda")
    with pytest.raises(DataError, match=r"color_jitter runs in the loader workers.*not on in-memory batches"):
        _classes_and_setup(photos, tmp_path, color_jitter=0.4, in_memory=True)
    with caplog.at_level("INFO"):
        dm = _classes_and_setup(photos, tmp_path, color_jitter=0.4, in_memory="auto")
    assert not dm.memory_plan().in_memory and "color_jitter" in dm.memory_plan().reason
    assert len(jitters(dm.train_set.transform)) == 1


def test_default_worker_count_follows_the_cores(photos: Path, tmp_path: Path, monkeypatch):
    """`num_workers: null`: this process's share of the cores it may use, less one for itself, at least 1 and
    at most 16 (a worker decodes ~700-2,000 photos a second; an H100 trains ViT-B/32 on 10-12k)."""
    from vitrain.data.datamodules import base

    # num_workers=None: the config's null (the class defaults to 0); held in memory there are no workers
    dm = ImageFolderDataModule(str(photos), str(tmp_path), in_memory=False, num_workers=None)
    for cores, local, expected in ((16, 1, 15), (64, 1, 16), (96, 8, 11), (16, 8, 1), (2, 1, 1), (1, 1, 1)):
        monkeypatch.setattr(base.os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
        assert dm.num_workers() == expected, (cores, local)
    assert (
        ImageFolderDataModule(str(photos), str(tmp_path), in_memory=False, num_workers=3).num_workers() == 3
    )


def test_trivialaugment_from_disk_as_in_memory(photos: Path, tmp_path: Path):
    """`auto_augment=trivial` (and its other names) works from disk as in memory and with the GPU decoder:
    timm has no TrivialAugment, so the workers run torchvision's TrivialAugmentWide after the crop and flip;
    a policy string timm cannot parse stops at set-up in one line, not with timm's AssertionError."""
    from torchvision.transforms import TrivialAugmentWide

    for name in ("trivial", "trivialaugment", "ta_wide"):
        dm = _classes_and_setup(photos, tmp_path, auto_augment=name)
        (segment,) = [op for op in dm.train_set.transform.ops if type(op).__name__ == "_OnPil"]
        assert [type(op) for op in segment.op] == [TrivialAugmentWide], name
        x, y = next(iter(dm.train_dataloader()))
        assert x.dtype == torch.uint8 and x.shape[0] == len(y) == 4
    with pytest.raises(
        DataError, match=r"^datamodule\.auto_augment='rand-x9' is no policy timm knows"
    ) as err:
        _classes_and_setup(photos, tmp_path, auto_augment="rand-x9")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        (
            "hflip",
            -1,
            r"^datamodule\.hflip=-1: use true \(half the images\), false \(none\) or a probability",
        ),
        ("hflip", "abc", r"^datamodule\.hflip='abc': use true"),
        ("img_size", 0, r"^datamodule\.img_size=0 must be at least 1"),
        (
            "mean",
            [0.5],
            r"^datamodule\.mean=\[0\.5\]: use null \(the model's\) or 3 numbers, one per RGB channel$",
        ),
        ("std", [1.0, 0.0, 1.0], r"^datamodule\.std=.*3 numbers, one per RGB channel, each above 0$"),
    ],
)
def test_augmentation_and_input_values_are_checked(photos: Path, tmp_path: Path, option, value, message):
    """Values the transforms would take silently (a negative flip probability never flips, img_size 0 fell
    back to the model's size, one mean value broadcast over three channels) or fail on later stop at
    construction in one line, for image folders, streaming shards and CIFAR alike."""
    from vitrain.data.datamodules.cifar import CIFAR10DataModule
    from vitrain.data.datamodules.streaming import StreamingDataModule

    for build in (
        lambda: ImageFolderDataModule(str(photos), str(tmp_path), **{option: value}),
        lambda: StreamingDataModule(str(tmp_path), str(tmp_path), **{option: value}),
        lambda: CIFAR10DataModule(str(tmp_path), str(tmp_path), **{option: value}),
    ):
        with pytest.raises(DataError, match=message) as err:
            build()
        assert "\n" not in str(err.value)


def test_hflip_true_flips_half_the_images_from_disk(photos: Path, tmp_path: Path):
    """`hflip: true` is half the images in memory; from disk it reached timm as p=True, which flips every
    image: both paths now read true as 0.5."""
    dm = _classes_and_setup(photos, tmp_path, hflip=True)
    (flip,) = [op for op in dm.train_set.transform.ops if type(op).__name__ == "RandomHorizontalFlip"]
    assert flip.p == 0.5


def test_val_size_and_crop_padding_are_checked(photos: Path, tmp_path: Path):
    """`val_size=1.5` carved one image (int(1.5)) and a negative `crop_padding` failed inside torch at the
    first batch: both stop at construction in one line."""
    from vitrain.data.datamodules.cifar import CIFAR10DataModule

    for cls, root in ((ImageFolderDataModule, photos), (CIFAR10DataModule, tmp_path)):
        for option, value, message in (
            (
                "val_size",
                1.5,
                r"^datamodule\.val_size=1\.5 must be a count of images \(at least 1\) or a fraction",
            ),
            ("val_size", -1, r"^datamodule\.val_size=-1 must be a count"),
            ("crop_padding", -2, r"^datamodule\.crop_padding=-2 must be at least 0"),
        ):
            with pytest.raises(DataError, match=message) as err:
                cls(str(root), str(tmp_path), **{option: value})
            assert "\n" not in str(err.value)
