"""Your own data: the `imagenet` and `finetune_folder` experiments on a small folder, a data set with a class
count drawn from 3..17 (grayscale JPEG, RGBA PNG, one corrupt file) trained on 1 process with the skipped file
counted in the run report, and `datamodule=image_folder` / `datamodule=streaming` under FSDP on 2 processes."""

from __future__ import annotations

import io
import json
import os
import random
from pathlib import Path

import pytest
import torch

from data_factory import PhotoFolder, make_photo_folder
from helpers import TINY_VIT, compose_cfg, run_cli
from vitrain.data.datamodules.image_folder import ImageFolderDataModule
from vitrain.data.shards import write_shards
from vitrain.errors import DataError
from vitrain.tasks.training import train

RUN_TIMEOUT = 300


@pytest.fixture(scope="session")
def drawn(tmp_path_factory: pytest.TempPathFactory) -> PhotoFolder:
    """A class count drawn anew each session (VITRAIN_TEST_DATA_SEED repeats one); the seed is in the path.
    6 images a class: even 3 classes give the 2 full batches of 8 the runs below take (drop_last)."""
    seed = int(os.environ.get("VITRAIN_TEST_DATA_SEED") or random.SystemRandom().randrange(10**6))
    return make_photo_folder(tmp_path_factory.mktemp(f"photos-seed{seed}"), seed, n_train=6)


def _overrides(data_dir: Path | str, cache: Path, *extra: str) -> list[str]:
    """A tiny ViT, 2 steps of 8 images on the CPU; `extra` goes before the tiny model (an experiment)."""
    return [
        *extra,
        *TINY_VIT,
        f"datamodule.data_dir={data_dir}",
        f"datamodule.cache_dir={cache}",
        "datamodule.batch_size=8",
        "datamodule.eval_batch_size=4",
        "datamodule.num_workers=1",
        "trainer.accelerator=cpu",
        "trainer.precision=32-true",
        "trainer.max_epochs=1",
        "+trainer.limit_train_batches=2",
        "trainer.log_every_n_steps=1",
        "extras.print_config=false",
        "logger=csv",
    ]


# --- the experiments --------------------------------------------------------------------------------------


def test_imagenet_experiment_is_deits_recipe(tmp_path: Path):
    cfg = compose_cfg("train", ["experiment=imagenet"], tmp_path)
    dm, model = cfg.datamodule, cfg.model
    assert dm._target_.endswith("ImageFolderDataModule") and dm.data_dir.endswith("/imagenet")
    assert (dm.batch_size, dm.auto_augment, dm.re_prob) == (1024, "rand-m9-mstd0.5-inc1", 0.25)
    assert (model.net.model_name, model.net.img_size, model.net.patch_size) == (
        "vit_base_patch16_224",
        224,
        16,
    )
    assert model.net.pretrained is False and model.net.drop_path_rate == 0.1
    # 5e-4 x 1024 / 512, weight decay 0.05, 5 warm-up epochs of 300, cosine to 1e-5
    assert model.optimizer.lr == pytest.approx(5e-4 * dm.batch_size / 512)
    assert model.optimizer.weight_decay == 0.05 and cfg.trainer.max_epochs == 300
    assert model.scheduler.warmup_fraction == pytest.approx(5 / 300, abs=1e-6)
    assert model.optimizer.lr * model.scheduler.min_lr_ratio == pytest.approx(1e-5)
    assert (model.label_smoothing, model.mixup.mixup_alpha, model.mixup.cutmix_alpha) == (0.1, 0.8, 1.0)


def test_finetune_folder_experiment_fine_tunes_a_pretrained_vit(tmp_path: Path):
    cfg = compose_cfg("train", ["experiment=finetune_folder", "datamodule.data_dir=/my/photos"], tmp_path)
    assert (
        cfg.datamodule._target_.endswith("ImageFolderDataModule") and cfg.datamodule.data_dir == "/my/photos"
    )
    assert cfg.model.net.model_name == "vit_small_patch16_224" and cfg.model.net.pretrained is True
    assert cfg.model.layer_decay == 0.75
    assert cfg.model.optimizer.lr == pytest.approx(5e-4 * cfg.datamodule.batch_size / 256)


@pytest.mark.parametrize("experiment", ["imagenet", "finetune_folder"])
def test_experiment_trains_on_a_folder(experiment: str, drawn: PhotoFolder, tmp_path: Path):
    """Every key the experiment sets reaches a real argument (instantiation refuses unknown ones) and the
    recipe trains: RandAugment + random erasing in the loader workers, layer decay or mixup in the model."""
    overrides = _overrides(drawn.root, tmp_path, f"experiment={experiment}")
    metrics, objects = train(compose_cfg("train", [*overrides, "datamodule.bad_images=skip"], tmp_path))
    assert objects.trainer.global_step == 2 and "val/acc1" in metrics and "test/acc1" in metrics
    assert objects.model.net.head.out_features == len(drawn.classes)
    dm = objects.datamodule
    assert dm.hparams.auto_augment == "rand-m9-mstd0.5-inc1" and dm.hparams.re_prob == 0.25
    # RandAugment per sample in the workers (on a PIL image of the crop made on tensors); random erasing on
    # the device, on the normalised batch
    ops = dm.train_set.transform.ops
    names = [type(o).__name__ for op in ops for o in (op.op if type(op).__name__ == "_OnPil" else [op])]
    assert "RandAugment" in names and "RandomErasing" not in names, names
    assert dm.device_transform().re_prob == 0.25
    if experiment == "imagenet":
        assert objects.model.mixup is not None
    else:
        lrs = {g["lr"] for g in objects.trainer.optimizers[0].param_groups}
        assert len(lrs) > 2  # one LR per depth: layer-wise decay


# --- a drawn class count, odd images, a corrupt file ----------------------------------------------------


@pytest.mark.parametrize("in_memory", ["false", "auto"])
def test_drawn_classes_train_and_the_report_counts_the_skipped_file(
    drawn: PhotoFolder, tmp_path: Path, in_memory: str
):
    """The head follows the drawn class count; the grayscale JPEG and RGBA PNG train; the corrupt file stops
    the run before training (named), or with bad_images=skip is left out and counted in report.md/json.
    Both ways in: loader workers (in_memory=false) and the decoded tensor (auto picks it for this folder)."""
    assert 3 <= len(drawn.classes) <= 17
    with pytest.raises(DataError, match=r"corrupt\.jpg is not a readable image"):
        ImageFolderDataModule(
            str(drawn.root), str(tmp_path / "c"), batch_size=8, in_memory=in_memory == "auto" or False
        ).setup("fit")

    overrides = _overrides(drawn.root, tmp_path, "datamodule=image_folder")
    cfg = compose_cfg(
        "train", [*overrides, "datamodule.bad_images=skip", f"datamodule.in_memory={in_memory}"], tmp_path
    )
    metrics, objects = train(cfg)
    assert objects.trainer.global_step == 2 and "test/acc1" in metrics
    assert objects.model.net.head.out_features == len(drawn.classes)
    dm = objects.datamodule
    assert dm.memory_plan().in_memory is (in_memory == "auto")
    assert (len(dm.train_set), len(dm.val_set)) == (drawn.n_train, drawn.n_val)
    if in_memory == "false":
        names = {Path(p).name for p, _ in dm.train_set.files}
        assert {"gray.jpg", "rgba.png"} <= names and "corrupt.jpg" not in names

    data = json.loads((tmp_path / "report.json").read_text())["data"]
    assert data["num_classes"] == len(drawn.classes) and data["skipped_files"] == 1
    assert data["images"] == {"train": drawn.n_train, "val": drawn.n_val, "test": drawn.n_val}
    assert data["skipped_examples"][0]["path"] == str(drawn.corrupt)
    assert (
        "| skipped files | 1 (unreadable, left out: `corrupt.jpg`) |" in (tmp_path / "report.md").read_text()
    )


# --- FSDP on 2 processes -----------------------------------------------------------------------------------


def _fsdp(data_dir: Path | str, tmp_path: Path, *extra: str) -> dict:
    """Train 2 steps with trainer=fsdp on 2 CPU processes (gloo); the run's report.json."""
    args = [*_overrides(data_dir, tmp_path / "cache", *extra), "trainer=fsdp", "trainer.devices=2",
            f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    done = run_cli("train.py", args, timeout=RUN_TIMEOUT)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in out and "FSDPVisionTransformer" in out
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_dir()  # one shard per rank
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["world_size"] == 2 and report["global_step"] == 2
    assert "test/acc1" in report["metrics"]["test"]
    return report


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_image_folder_trains_under_fsdp_on_two_processes(drawn: PhotoFolder, tmp_path: Path):
    report = _fsdp(
        drawn.root,
        tmp_path,
        "datamodule=image_folder",
        "datamodule.bad_images=skip",
        "datamodule.in_memory=false",
    )
    assert report["data"]["skipped_files"] == 1 and report["data"]["num_classes"] == len(drawn.classes)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_streaming_trains_under_fsdp_on_two_processes(drawn: PhotoFolder, tmp_path: Path):
    """Shards written from the drawn folder (`make shards` skips the corrupt file and records it)."""
    shards = tmp_path / "shards"
    write_shards(drawn.root, str(shards), chunk_bytes="16KB", workers=1, cache_dir=tmp_path / "wcache")
    report = _fsdp(shards, tmp_path, "datamodule=streaming")
    data = report["data"]
    assert data["images"]["train"] == drawn.n_train and data["skipped_files"] == 1
    assert data["skipped_examples"][0]["path"] == str(drawn.corrupt)


def test_jpeg_cut_short_is_found_before_training(tmp_path: Path):
    """PIL's verify passes a JPEG whose scan data is cut short; the pre-training check still finds it (baseline
    and progressive), and passes whole JPEGs: with bytes after the end marker, CMYK, grayscale."""
    from PIL import Image

    from vitrain.data.readers.image_folders import find_unreadable

    noise = Image.fromarray(torch.randint(0, 256, (90, 120, 3), dtype=torch.uint8).numpy())

    def jpeg(img: Image.Image = noise, **kwargs) -> bytes:
        buf = io.BytesIO()
        img.save(buf, "JPEG", **kwargs)
        return buf.getvalue()

    whole, progressive = jpeg(), jpeg(progressive=True)
    files = {
        "whole.jpg": whole,
        "trailing.jpg": whole + bytes(4096),
        "cmyk.jpg": jpeg(noise.convert("CMYK")),
        "gray.jpg": jpeg(noise.convert("L")),
        "cut.jpg": whole[: len(whole) * 3 // 4],
        "cut_progressive.jpg": progressive[: len(progressive) * 3 // 4],
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    bad = find_unreadable([str(tmp_path / n) for n in files], workers=1)
    assert sorted(Path(p).name for p, _ in bad) == ["cut.jpg", "cut_progressive.jpg"]
    assert all("truncated" in why for _, why in bad)

    root = tmp_path / "tree"
    for split in ("train", "val"):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            for i in range(2):
                (root / split / cls / f"{i}.jpg").write_bytes(whole)
    (root / "train" / "b" / "cut.jpg").write_bytes(files["cut.jpg"])
    with pytest.raises(
        DataError, match=r"train/b/cut\.jpg is not a readable image \(OSError: image file is truncated"
    ):
        ImageFolderDataModule(str(root), str(tmp_path / "c"), batch_size=2).setup("fit")


def test_timm_transform_hands_out_uint8_and_crops_by_the_model(tmp_path: Path):
    """One helper builds both datamodules' transforms: uint8 out (a quarter of float32's bytes through the
    workers' shared memory, the pinned copy and the copy to a GPU), normalised and erased on the device as
    in-memory batches are; the eval resize from the model's crop_pct."""
    from PIL import Image

    from vitrain.data.transforms import timm_transform

    spec = {"interpolation": "bicubic", "crop_pct": 0.5}
    train_t = timm_transform(True, 32, (0.5,) * 3, (0.5,) * 3, spec, "rand-m9-mstd0.5-inc1", 0.5)
    assert not any(type(t).__name__ in ("RandomErasing", "Normalize") for t in train_t.transforms)
    image = Image.new("RGB", (48, 40), (200, 100, 50))
    x = train_t(image)
    assert x.dtype == torch.uint8 and x.shape == (3, 32, 32)
    eval_t = timm_transform(False, 32, (0.5,) * 3, (0.5,) * 3, spec)
    assert eval_t(image).dtype == torch.uint8
    assert eval_t.transforms[0].size == 64  # 32 / crop_pct 0.5, then a 32 px center crop
