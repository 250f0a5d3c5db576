"""Data read per sample (an image folder from disk, streaming shards): a run killed with SIGKILL in the middle of
an epoch and at an epoch boundary, resumed each time with ckpt_path=last, ends on the uninterrupted run's
weights, bit for bit, with 0 and 2 loader workers (issue 33).

Each run goes through the CLI as a user's does (the model asks for `estimated_stepping_batches`, which makes
Lightning build the training loader before it restores the checkpoint: what hid the bug from loader-level
tests). Augmentation draws from all three global generators (timm's RandomResizedCrop and RandAugment use
Python's `random` and numpy's, flips and random erasing torch's) and drop-path from torch's in the training
process. One uninterrupted reference per kind of data; the image folder's serves 0 and 2 workers, which must
train alike."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from data_factory import make_noise_folder
from helpers import ROOT, TINY_VIT, run_cli

RUN_TIMEOUT = 300
BATCH, N_TRAIN = 4, 3 * 8  # 6 steps an epoch
STEPS, EPOCHS = N_TRAIN // BATCH, 2
EVERY_3_STEPS = [
    "+callbacks.last_checkpoint.every_n_train_steps=3",
    "callbacks.last_checkpoint.every_n_epochs=null",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The image folder and the shards `make shards` writes from it."""
    from vitrain.data.shards import write_shards

    root = tmp_path_factory.mktemp("resume_disk")
    folder = make_noise_folder(root / "folder", seed=0)
    shards = root / "shards"
    write_shards(folder, str(shards), chunk_bytes="16KB", workers=1, cache_dir=root / "write_cache")
    return {"folder": folder, "streaming": shards}


def _overrides(
    folders: dict[str, Path], kind: str, workers: int, run_dir: Path, ddp: bool = False
) -> list[str]:
    data = {
        "folder": ["datamodule=image_folder", "datamodule.in_memory=false"],
        "streaming": ["datamodule=streaming", "model.net.num_classes=3"],
    }[kind]
    return [
        *TINY_VIT,
        "model.net.drop_path_rate=0.1",
        *data,
        f"datamodule.data_dir={folders[kind]}",
        f"datamodule.cache_dir={run_dir.parent / 'cache'}",
        f"datamodule.batch_size={BATCH}",
        f"datamodule.num_workers={workers}",
        "datamodule.auto_augment=rand-m9-mstd0.5-inc1",
        "datamodule.re_prob=0.25",
        "trainer.accelerator=cpu",
        "trainer.precision=32-true",
        f"trainer.max_epochs={EPOCHS}",
        "extras.print_config=false",
        "logger=csv",
        "test=false",
        f"hydra.run.dir={run_dir}",
        # DDP: the global batch split over 2 processes, each its own share of the epoch and its own generators
        *(["trainer=ddp", "trainer.devices=2"] if ddp else []),
    ]


def _run(args: list[str]):
    return run_cli("train.py", args, env={"PYTHONPATH": str(ROOT / "tests")}, timeout=RUN_TIMEOUT)


def _last(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """The final weights of the run left alone, per kind of data (made once, when first asked for)."""
    made: dict[tuple, dict[str, torch.Tensor]] = {}

    def weights(kind: str, workers: int, ddp: bool) -> dict[str, torch.Tensor]:
        # the image folder trains alike with any number of workers; litdata deals each worker its own part
        key = (kind, workers if kind == "streaming" else 0, ddp)
        if key not in made:
            run_dir = tmp_path_factory.mktemp(f"alone_{kind}") / "run"
            done = _run(_overrides(folders, *key[:2], run_dir, ddp=ddp))
            assert done.returncode == 0, done.stderr[-3000:]
            assert _last(run_dir)["global_step"] == EPOCHS * STEPS
            made[key] = _last(run_dir)["state_dict"]
        return made[key]

    return weights


# each kill: the extra overrides of the run that is killed, and where its last.ckpt is (global step, epoch)
MID_EPOCH_0 = (
    [*EVERY_3_STEPS, "+callbacks.fault._target_=fault_injection.KillAtStep", "+callbacks.fault.step=3"],
    (3, 0),
)
BOUNDARY = (["+callbacks.fault._target_=fault_injection.KillAt", "+callbacks.fault.epoch=1"], (STEPS, 0))
MID_EPOCH_1 = (
    [*EVERY_3_STEPS, "+callbacks.fault._target_=fault_injection.KillAtStep", "+callbacks.fault.step=9"],
    (9, 1),
)


@pytest.mark.slow
@pytest.mark.timeout(4 * RUN_TIMEOUT)
@pytest.mark.parametrize(
    ("kind", "workers", "kills", "ddp"),
    [
        ("folder", 0, (MID_EPOCH_0, BOUNDARY), False),
        ("folder", 2, (BOUNDARY, MID_EPOCH_1), False),
        ("streaming", 2, (MID_EPOCH_0, BOUNDARY), False),
        pytest.param("streaming", 1, (MID_EPOCH_0,), True, marks=pytest.mark.distributed),
    ],
    ids=["folder-0-workers", "folder-2-workers", "streaming-2-workers", "streaming-ddp-mid-epoch"],
)
def test_sigkill_mid_epoch_and_at_epoch_boundary_then_resume_is_bitwise(
    kind: str, workers: int, kills: tuple, ddp: bool, folders: dict[str, Path], uninterrupted, tmp_path: Path
):
    """Under DDP every rank kills itself at the same step, after rank 0 saved `last`."""
    run_dir = tmp_path / "run"
    args = _overrides(folders, kind, workers, run_dir, ddp=ddp)
    for i, (extra, (step, epoch)) in enumerate(kills):
        killed = _run([*args, *extra, *(["ckpt_path=last"] if i else [])])
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        saved = _last(run_dir)
        assert (saved["global_step"], saved["epoch"]) == (step, epoch)
    resumed = _run([*args, "ckpt_path=last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    output = resumed.stderr + resumed.stdout
    assert "bitwise as if never stopped" in output and "not bitwise" not in output
    final = _last(run_dir)
    assert final["global_step"] == EPOCHS * STEPS
    reference = uninterrupted(kind, workers, ddp)
    assert final["state_dict"].keys() == reference.keys()
    different = [k for k, v in reference.items() if not torch.equal(final["state_dict"][k], v)]
    assert not different, f"weights differ from the uninterrupted run's: {different[:5]}"


def test_per_sample_seeding_leaves_the_training_process_generators_alone():
    """num_workers=0: a sample's transform draws from generators seeded from its (seed, epoch, index), and
    the training process's own states (drop-path, on-device augmentation) come back as they were."""
    import random

    import numpy as np

    from vitrain.data.sampling import sample_seed, seeded_sample

    def draws() -> tuple:
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    expected = draws()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    with seeded_sample(sample_seed(0, 2, 7)):
        first = draws()
    with seeded_sample(sample_seed(0, 2, 7)):
        assert draws() == first, "the same sample, the same draws"
    with seeded_sample(sample_seed(0, 3, 7)):
        assert draws() != first, "another epoch, other draws"
    assert draws() == expected


def test_resume_log_names_a_transform_of_your_own(tmp_path: Path):
    from vitrain.data.datamodules.image_folder import ImageFolderDataModule
    from vitrain.data.datamodules.streaming import StreamingDataModule

    class Mine(ImageFolderDataModule):
        def build_transform(self, train: bool):
            return super().build_transform(train)

    assert ImageFolderDataModule(str(tmp_path), str(tmp_path)).resume_caveat() is None
    assert StreamingDataModule(data_dir=str(tmp_path), cache_dir=str(tmp_path)).resume_caveat() is None
    caveat = Mine(str(tmp_path), str(tmp_path)).resume_caveat()
    assert caveat is not None and "Mine defines build_transform itself" in caveat
