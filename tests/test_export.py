"""`src/export.py`: a checkpoint's network written as a timm model folder, which timm alone rebuilds with its
weights, class names and evaluation preprocessing; what timm cannot rebuild is refused in one line, and an
export never replaces files or leaves half a folder."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import timm
import torch
from PIL import Image
from timm.layers import HybridEmbed
from timm.models.vision_transformer_hybrid import ConvStem

from helpers import compose_cfg, fails_in_process, predicted, run_cli
from vitrain.errors import ModelError
from vitrain.tasks.evaluation import evaluate
from vitrain.tasks.export import export_model, write


def test_timm_alone_rebuilds_the_exported_network(tiny_checkpoint: Path, tiny_cifar: Path, tmp_path: Path):
    """The CIFAR-10 checkpoint: timm.create_model("local-dir:...") gives the same network (outputs), its
    class names, and a data config whose transform classifies the test images as src/predict.py does."""
    last = tiny_checkpoint / "checkpoints" / "last.ckpt"
    _, folder = export_model(
        compose_cfg("export", [f"ckpt_path={last}", "extras.print_config=false"], tmp_path)
    )
    assert folder == tmp_path / "model" and sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    _, objects = evaluate(
        compose_cfg("eval", [f"ckpt_path={last}", "trainer.precision=32-true"], tmp_path / "eval")
    )
    net = objects.model.net.eval()
    rebuilt = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(rebuilt(x), net(x), atol=1e-6)
    assert rebuilt.pretrained_cfg["label_names"] == objects.datamodule.classes
    assert json.loads((folder / "config.json").read_text())["num_classes"] == 10

    # timm's own preprocessing from the exported config: the CIFAR test images classified as predict.py does
    config = timm.data.resolve_data_config({}, model=rebuilt)
    assert config["input_size"] == (3, 32, 32) and config["crop_pct"] == 1.0
    assert tuple(config["mean"]) == objects.datamodule.mean
    transform = timm.data.create_transform(**config)
    files = sorted((tiny_cifar / "test").rglob("*.png"))
    with torch.no_grad():
        probabilities = rebuilt(
            torch.stack([transform(Image.open(f).convert("RGB")) for f in files])
        ).softmax(-1)
    rows = predicted(last, tiny_cifar / "test", tmp_path / "predict")
    assert [rebuilt.pretrained_cfg["label_names"][i] for i in probabilities.argmax(-1)] == [
        r["class"] for r in rows
    ]
    assert probabilities.max(-1).values.tolist() == pytest.approx(
        [float(r["probability"]) for r in rows], abs=1e-5
    )
    # CIFAR at 224 px (the seed run): timm's transform cannot say "32 px, then upsampled", and the export says so
    dm = objects.datamodule
    dm.set_input_spec(img_size=224)
    config, caveat = dm.timm_data_config()
    assert config["input_size"] == (3, 224, 224) and "held at 32x32 px and resized to 224 px" in caveat


def test_what_timm_cannot_rebuild_and_a_used_folder_are_refused(tiny_checkpoint: Path, tmp_path: Path):
    """A network with an argument timm cannot write in its config (a ConvStem embedding, a Hydra node in
    model.net) is one line naming the key; an output folder holding files is never written into."""
    stem = partial(HybridEmbed, proj=False, backbone=ConvStem(depth=2, channels=[16, 32], stride=[2, 2]))
    net = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=1, embed_dim=32, depth=1, num_heads=2,
        class_token=False, global_pool="avg", embed_layer=stem, num_classes=3,
    )  # fmt: skip
    node = {"embed_layer": {"_target_": "timm.layers.HybridEmbed", "_partial_": True}}
    config = {"input_size": (3, 32, 32), "mean": (0.5,) * 3, "std": (0.5,) * 3, "crop_pct": 1.0}
    with pytest.raises(ModelError) as err:
        write(net, tmp_path / "x", ["a", "b", "c"], config, node)
    assert str(err.value) == (
        "model.net.embed_layer (timm.layers.HybridEmbed) cannot be written in a timm config: timm cannot rebuild "
        "this network from a folder; classify with src/predict.py, or load the checkpoint with vitrain"
    )

    used = tmp_path / "used"
    used.mkdir()
    (used / "mine.txt").write_text("keep me")
    last = tiny_checkpoint / "checkpoints" / "last.ckpt"
    code, out = fails_in_process("export", [f"ckpt_path={last}", f"output={used}"], tmp_path / "run")
    assert (
        code == 2
        and out.strip()
        == f"error: output={used} exists and is not an empty folder: give a new one (nothing is replaced)"
    )
    assert [p.name for p in used.iterdir()] == ["mine.txt"]


def test_export_from_the_command_line(tiny_checkpoint: Path, tmp_path: Path):
    last = tiny_checkpoint / "checkpoints" / "last.ckpt"
    done = run_cli("export.py", [f"hydra.run.dir={tmp_path / 'run'}"])
    assert done.returncode == 2 and done.stderr.startswith("error: ckpt_path is required: a .ckpt file"), (
        done.stderr
    )
    out = tmp_path / "deploy" / "cifar-vit"
    done = run_cli("export.py", [f"ckpt_path={last}", f"output={out}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        f"Exported to {out}: timm.create_model('local-dir:{out}', pretrained=True)"
        in (tmp_path / "run" / "export.log").read_text()
    )
    assert sorted(p.name for p in out.parent.iterdir()) == ["cifar-vit"]  # no staging folder left beside it
