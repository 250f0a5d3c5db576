"""`src/predict.py`: image files classified with a trained checkpoint, each as evaluation sees the data's own
images; one CSV row per file; bad input in one line. The image-folder paths (from disk, in memory) are
checked beside their training runs in tests/test_image_folder.py and tests/test_in_memory.py."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import assert_predicted_as_evaluated, compose_cfg, fails_in_process, predicted, run_cli
from vitrain.tasks.evaluation import evaluate


def test_cifar_checkpoint_classifies_files_as_it_evaluates(
    tiny_checkpoint: Path, tiny_cifar: Path, tmp_path: Path
):
    """The CIFAR-10 checkpoint on the test/ PNGs: each row is the image's top classes as evaluation scores
    them (held at 32 px, resized and normalised on the device), most probable first, in path order; their
    accuracy is eval.py's. A photo of another size is brought to CIFAR's 32 px as the data's images are."""
    last = tiny_checkpoint / "checkpoints" / "last.ckpt"
    evaluated, objects = evaluate(
        compose_cfg("eval", [f"ckpt_path={last}", "trainer.precision=32-true"], tmp_path / "eval")
    )
    files = sorted((tiny_cifar / "test").rglob("*.png"))
    rows = predicted(last, tiny_cifar / "test", tmp_path / "predict", "top_k=3")
    dm = objects.datamodule
    assert_predicted_as_evaluated(rows, objects.model, dm, dm.test_set.x, files)
    hits = sum(Path(row["file"]).parent.name == row["class"] for row in rows)
    assert hits / len(rows) == pytest.approx(evaluated["test/acc1"], abs=1e-6)
    # test/ is a folder of class folders: each file is labelled by its folder, and scored as eval.py scores
    header = ["file", "class", "probability", "class_2", "probability_2", "class_3", "probability_3", "label"]
    assert list(rows[0]) == header and all(Path(r["file"]).parent.name == r["label"] for r in rows)
    scored = json.loads((tmp_path / "predict" / "metrics.json").read_text())
    assert (
        scored["acc1"] == pytest.approx(evaluated["test/acc1"], abs=1e-6) and "acc5" not in scored
    )  # top_k=3
    assert scored["per_class_acc"] == pytest.approx(objects.per_class_acc, abs=1e-6)
    assert scored["per_class_images"] == objects.per_class_images
    assert scored["code"]["commit"] and scored["software"]["timm"]  # what produced the numbers
    predicted(last, tiny_cifar / "test", tmp_path / "top5")  # top_k=5, the default: top-5 accuracy too
    scored = json.loads((tmp_path / "top5" / "metrics.json").read_text())
    assert scored["acc5"] == pytest.approx(evaluated["test/acc5"], abs=1e-6)
    for row in rows:
        probabilities = [float(row[k]) for k in ("probability", "probability_2", "probability_3")]
        assert probabilities == sorted(probabilities, reverse=True) and sum(probabilities) <= 1 + 1e-5
        assert len({row["class"], row["class_2"], row["class_3"]}) == 3

    # a 100x70 photo: its center square resized to 32 px, as a held image is made (`decode_square`), not
    # resized and cropped as a photo from an image folder would be
    photo = tmp_path / "photo.png"
    noise = torch.randint(0, 256, (70, 100, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    Image.fromarray(noise.numpy()).save(photo)
    (row,) = predicted(last, photo, tmp_path / "photo")
    square = Image.open(photo).convert("RGB").resize((32, 32), dm.resample(), box=(15, 0, 85, 70))
    image = torch.from_numpy(np.array(square)).permute(2, 0, 1)[None]
    assert_predicted_as_evaluated([row], objects.model, dm, image, [photo])


def test_a_folder_of_photos_from_the_command_line(tiny_checkpoint: Path, tiny_cifar: Path, tmp_path: Path):
    """`python src/predict.py ckpt_path=... inputs=<folder>`: albums (sub-folders) are read, other files
    counted; a file that is no image stops the run in one line naming it (no run dir left), or is skipped
    with `bad_images=skip`; the CSV goes where `output` says."""
    last = tiny_checkpoint / "checkpoints" / "last.ckpt"
    photos = tmp_path / "photos"
    album = photos / "album" / "2024"
    album.mkdir(parents=True)
    cats = sorted((tiny_cifar / "test" / "cat").glob("*.png"))
    shutil.copy(cats[0], photos / "a.png")
    for cat in cats[1:3]:
        shutil.copy(cat, album / cat.name)
    (photos / "notes.txt").write_text("not a photo")
    (photos / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")

    run = tmp_path / "run"
    done = run_cli("predict.py", [f"ckpt_path={last}", f"inputs={photos}", f"hydra.run.dir={run}"])
    assert done.returncode == 2, done.stderr[-3000:]
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: {photos / 'broken.jpg'} is not a readable image (")
    assert error.endswith("): remove or replace it, or set bad_images=skip")
    assert not run.exists()

    out = tmp_path / "elsewhere" / "cats.csv"
    args = [f"ckpt_path={last}", f"inputs={photos}", "bad_images=skip", "top_k=2", f"output={out}"]
    done = run_cli("predict.py", [*args, f"hydra.run.dir={run}"])
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    expected = [photos / "a.png", *(album / c.name for c in cats[1:3])]
    assert [row["file"] for row in rows] == [str(p) for p in expected]
    assert list(rows[0]) == ["file", "class", "probability", "class_2", "probability_2"]
    log = (run / "predict.log").read_text()
    assert f"skipping {photos / 'broken.jpg'}: not a readable image" in log
    assert "left out 1 file(s) that are not .jpg/" in log and "(.txt: 1)" in log
    assert "3 images classified by" in done.stdout and f"Predictions written to {out}" in log


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["inputs=photos"], "error: ckpt_path is required: a .ckpt file"),
        (["ckpt_path=x.ckpt"], "error: inputs is required: a folder of images"),
        (["ckpt_path=last", "inputs=photos"], "error: predict.py takes a checkpoint, not ckpt_path=last"),
        (["ckpt_path=x.ckpt", "inputs=photos", "top_k=0"], "error: top_k=0: must be a positive whole number"),
        (
            ["ckpt_path=x.ckpt", "inputs=photos", "bad_images=ignore"],
            "error: bad_images=ignore: must be stop or skip",
        ),
    ],
)
def test_missing_and_bad_values_stop_before_the_imports(overrides: list[str], message: str, tmp_path: Path):
    done = run_cli("predict.py", [*overrides, f"hydra.run.dir={tmp_path / 'run'}"])
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith(message), done.stderr


def test_what_the_run_finds_wrong_is_one_line(tiny_checkpoint: Path, tiny_cifar: Path, tmp_path: Path):
    """Inputs that are not there or hold no image, and fewer images than processes, end in one line, exit 2."""
    last = tiny_checkpoint / "checkpoints" / "last.ckpt"
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    one = next((tiny_cifar / "test" / "cat").glob("*.png"))
    cases = [
        ([f"inputs={tmp_path / 'absent'}"], f"error: inputs: {tmp_path / 'absent'} does not exist"),
        ([f"inputs={tmp_path / 'empty'}"], f"error: inputs={tmp_path / 'empty'}: no .jpg/"),
        ([f"inputs={tmp_path / 'notes.txt'}"], f"error: inputs: {tmp_path / 'notes.txt'} is not a .jpg/"),
        (
            [f"inputs={one}", "trainer.accelerator=cpu", "trainer.devices=2"],
            "error: 1 image(s) for 2 processes: classify them with at most 1 (trainer.devices, trainer.num_nodes)",
        ),
    ]
    for overrides, message in cases:
        code, err = fails_in_process("predict", [f"ckpt_path={last}", *overrides], tmp_path / "run")
        assert code == 2 and err.startswith(message), (overrides, err)


def test_many_classes_print_the_ends_not_a_thousand_rows(capsys: pytest.CaptureFixture):
    """ImageNet's 1000 classes: eval.py prints the 15 worst and 15 best classes (metrics.json has all),
    predict.py the 30 most predicted and a count of the rest (the CSV has every file); a few classes: all."""
    from collections import Counter

    from vitrain.tasks.evaluation import print_per_class
    from vitrain.tasks.prediction import print_counts

    names = [f"n{i:04d}" for i in range(1000)]
    accuracy = {name: (i % 100) / 100 for i, name in enumerate(names)}
    print_per_class(accuracy, dict.fromkeys(names, 50), "test accuracy per class")
    out = capsys.readouterr().out
    assert (
        "test accuracy per class: the 15 worst and the 15 best of 1000 (metrics.json has every class)" in out
    )
    shown = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    worst = [*names[0:1000:100], *names[1:500:100]]  # accuracy 0.00 (ten), then 0.01 by name
    best = [*names[598:1000:100], *names[99:1000:100]]  # 0.98 (the last five by name), then 0.99 (ten)
    assert shown == [*worst, "...", *best]
    print_counts(Counter({name: i + 1 for i, name in enumerate(names[:50])}), "50 classes")
    out = capsys.readouterr().out
    rows = [line.split("│")[1:3] for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 31 and rows[0][0].strip() == "n0049" and rows[-1][0].strip() == "... 20 more classes"
    assert int(rows[-1][1]) == sum(range(1, 21))
    print_per_class({"a": 0.5, "b": 1.0}, {"a": 2, "b": 2}, "two")
    assert [
        ln.split("│")[1].strip() for ln in capsys.readouterr().out.splitlines() if ln.startswith("│")
    ] == [
        "a",
        "b",
    ]


def test_photos_in_a_bucket_are_fetched_and_named_by_their_uri(
    tiny_checkpoint: Path, tiny_cifar: Path, s3_bucket: str, tmp_path: Path
):
    """`inputs=s3://bucket/prefix` (a real S3 API: moto's server): the objects are fetched into the cache once
    (verified, as a checkpoint is) and classified as the same files on disk are; the CSV names each by its
    URI, and a prefix of class folders is a labelled set there too."""
    import boto3

    client = boto3.client("s3")
    files = sorted((tiny_cifar / "test").rglob("*.png"))[:12]  # airplane, automobile, bird
    for f in files:
        client.upload_file(str(f), s3_bucket, f"photos/{f.parent.name}/{f.name}")
    last = tiny_checkpoint / "checkpoints" / "last.ckpt"
    cache = f"paths.cache_dir={tmp_path / 'cache'}"
    rows = predicted(last, f"s3://{s3_bucket}/photos", tmp_path / "s3", cache)
    local = tmp_path / "local"
    for f in files:
        (local / f.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(f, local / f.parent.name / f.name)
    on_disk = predicted(last, local, tmp_path / "disk")
    assert [r["file"] for r in rows] == [f"s3://{s3_bucket}/photos/{f.parent.name}/{f.name}" for f in files]
    assert [(r["class"], r["probability"], r["label"]) for r in rows] == [
        (r["class"], r["probability"], r["label"]) for r in on_disk
    ]
    assert json.loads((tmp_path / "s3" / "metrics.json").read_text())["acc1"] == pytest.approx(
        json.loads((tmp_path / "disk" / "metrics.json").read_text())["acc1"]
    )
    # a second run reads the cache: nothing fetched again
    fetched = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache" / "s3").rglob("*.png")}
    assert len(fetched) == len(files)
    predicted(last, f"s3://{s3_bucket}/photos", tmp_path / "again", cache)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache" / "s3").rglob("*.png")} == fetched
