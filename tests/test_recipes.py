"""Any timm family (issue 14), FSDP units, EMA, mixup/cutmix, per-image RandAugment, layer-wise LR decay."""

import csv
import json
import re
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import timm
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from helpers import ROOT, TINY_VIT, compose_cfg, fails_in_process, tiny_overrides
from test_distributed import RUN_TIMEOUT, torchrun
from vitrain import checkpoints
from vitrain.callbacks.ema import EMA, ShardedEMA
from vitrain.callbacks.throughput import ImageThroughputMonitor
from vitrain.compat import averaged_model
from vitrain.data.augment import OPS, BatchTransform, RandomAugment
from vitrain.distributed.fsdp import FSDP2Strategy, shard_units
from vitrain.errors import DataError, ModelError, UserError
from vitrain.models.classifier import ImageClassifier, make_mixup
from vitrain.models.resolution import ProgressiveResize, make_resize
from vitrain.models.timm_net import create_net
from vitrain.tasks.build import build
from vitrain.tasks.evaluation import evaluate
from vitrain.tasks.training import train

# --- any family -------------------------------------------------------------------------------------


def test_resnet18_with_default_model_config_on_cpu(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """The issue's command: only the model name changes (and a small input, for speed)."""
    overrides = [o for o in tiny_overrides(tiny_cifar, data_cache) if not o.startswith(("model", "+model"))]
    cfg = compose_cfg(
        "train",
        [
            *overrides,
            "model.net.model_name=resnet18",
            "datamodule.img_size=32",
            "+trainer.limit_train_batches=2",
        ],
        tmp_path,
    )
    assert "img_size" not in cfg.model.net and "patch_size" not in cfg.model.net
    metrics, objects = train(cfg)
    assert objects.trainer.global_step == 2
    assert "test/acc1" in metrics
    # the input spec from timm's data config for the model: ImageNet mean/std only when pretrained
    assert objects.model.input_spec["img_size"] == 224  # timm's size, the datamodule's 32 wins
    assert objects.datamodule.img_size == 32


def test_channels_last_resnet_trains_and_matches_nchw(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """`model.channels_last=true`: the convolutions' weights and inputs in NHWC through training, the same
    function as the NCHW network; refused under FSDP2 before any sharding."""
    overrides = [o for o in tiny_overrides(tiny_cifar, data_cache) if not o.startswith(("model", "+model"))]
    resnet = [
        *overrides,
        "model.net.model_name=resnet18",
        "datamodule.img_size=32",
        "+trainer.limit_train_batches=2",
    ]
    metrics, objects = train(compose_cfg("train", [*resnet, "model.channels_last=true"], tmp_path))
    assert objects.trainer.global_step == 2 and "test/acc1" in metrics
    conv = objects.model.net.conv1.weight
    assert conv.dim() == 4 and conv.is_contiguous(memory_format=torch.channels_last)

    net = {"model_name": "resnet18", "num_classes": 10}
    nchw = ImageClassifier(net, {"_target_": "torch.optim.SGD"}).eval()
    nhwc = ImageClassifier(net, {"_target_": "torch.optim.SGD"}, channels_last=True).eval()
    nhwc.load_state_dict(nchw.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(nhwc(x), nchw(x), rtol=1e-4, atol=1e-4)

    nhwc.trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), logger=False)
    with pytest.raises(
        ModelError, match=re.escape("model.channels_last=true is not supported with trainer=fsdp")
    ):
        nhwc.configure_model()
    # a run is refused while it builds its objects, before Lightning starts the other ranks
    fsdp = ["trainer=fsdp", "trainer.devices=2", "trainer.accelerator=cpu", "model.channels_last=true"]
    with pytest.raises(ModelError, match=re.escape("model.channels_last=true is not supported")):
        build(compose_cfg("train", [*resnet, *fsdp], tmp_path))


def test_keyword_of_another_family_is_one_line_error(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    code, stderr = fails_in_process(
        "train", [*tiny_overrides(tiny_cifar, data_cache), "model.net.model_name=resnet18"], tmp_path
    )
    assert code == 2, stderr[-2000:]
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert "model.net.img_size is not a keyword of resnet18 (ResNet)" in lines[-1]


def test_unknown_model_and_bad_options_are_model_errors():
    with pytest.raises(ModelError, match=re.escape("unknown timm model model.net.model_name=resnet181")):
        create_net({"model_name": "resnet181"})
    with pytest.raises(
        ModelError, match=re.escape("model.net.class_token is not a keyword of convnext_atto")
    ):
        create_net({"model_name": "convnext_atto", "class_token": False})
    with pytest.raises(ModelError, match=re.escape("model.mixup")):
        make_mixup({"mixup_alpha": 0.8, "alpha": 1}, 10, 0.1)


@pytest.mark.parametrize(
    ("name", "unit"),
    [
        ("vit_tiny_patch16_224", "Block"),
        ("resnet50", "Bottleneck"),
        ("convnext_atto", "ConvNeXtBlock"),
        ("efficientnet_b0", "InvertedResidual"),
        ("test_resnet", "Sequential"),  # one block per stage: timm's feature_info stages
    ],
)
def test_fsdp_units_for_every_family(name: str, unit: str):
    net = timm.create_model(name)
    units = shard_units(net)
    assert unit in {type(u).__name__ for u in units}
    total = sum(p.numel() for p in net.parameters())
    assert sum(p.numel() for u in units for p in u.parameters()) > 0.5 * total
    ids = {id(u) for u in units}
    assert not any(id(d) in ids for u in units for d in u.modules() if d is not u)  # no unit inside another


def families_job(strategy: str, data: Path, cache: Path, out: Path, *extra: str) -> dict[str, list[dict]]:
    done = torchrun([ROOT / "tests" / "families_job.py", strategy, data, cache, out, *extra], 2 * RUN_TIMEOUT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    results: dict[str, list[dict]] = {}
    for path in sorted(out.glob("*.rank*.json")):
        results.setdefault(path.name.split(".rank")[0], []).append(json.loads(path.read_text()))
    return results


@pytest.mark.distributed
@pytest.mark.timeout(2 * RUN_TIMEOUT)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_vit_resnet_convnext_train_on_two_processes(
    strategy: str, tmp_path: Path, tiny_cifar: Path, data_cache: Path
):
    # Lightning's clipping and accumulation flags under both strategies (2 batches, 1 optimizer step); FSDP in
    # bf16: BatchNorm (ResNet) must run as its own fp32 unit (vitrain/distributed/fsdp.py). bf16 for the
    # ResNet only: the family with BatchNorm, and on a CPU without native bf16 every bf16 op is emulated
    extra = ["trainer.gradient_clip_val=1.0", "trainer.accumulate_grad_batches=2"]
    if strategy == "fsdp":
        extra.append("resnet18:trainer.strategy.mixed_precision=bf16")
    results = families_job(strategy, tiny_cifar, data_cache, tmp_path, *extra)
    assert set(results) == {"vit", "resnet18", "convnext_atto"}
    for family, ranks in results.items():
        assert len(ranks) == 2, family
        for r in ranks:
            assert r["world_size"] == 2 and r["global_step"] == 1 and r["finite"], (family, r)
            if strategy == "fsdp":
                # ViT's blocks one group, sharded as their container: root + blocks at least
                assert r["sharded_units"] >= 2 and r["dtensor_params"] > 0 and r["local_step"], (family, r)
            else:
                assert r["sharded_units"] == 0 and not r["local_step"]


# --- EMA ----------------------------------------------------------------------------------------------


def ema_overrides(tiny_cifar: Path, data_cache: Path, *extra: str) -> list[str]:
    return [
        *tiny_overrides(tiny_cifar, data_cache),
        "callbacks=[default,ema]",
        "callbacks.ema.decay=0.9",
        "trainer.max_epochs=2",
        "datamodule.train_subset=48",
        "model.optimizer.lr=0.01",
        "callbacks.model_checkpoint.save_top_k=-1",  # every epoch's checkpoint: the resume test starts from epoch 0's
        *extra,
    ]


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory: pytest.TempPathFactory, tiny_cifar: Path, data_cache: Path):
    run_dir = tmp_path_factory.mktemp("ema")
    metrics, objects = train(compose_cfg("train", ema_overrides(tiny_cifar, data_cache), run_dir))
    return run_dir, metrics, objects


def test_ema_weights_are_checkpointed_tested_and_evaluated(ema_run, tmp_path: Path):
    run_dir, metrics, objects = ema_run
    best = checkpoints.load(Path(objects.best_model_path))
    ema, raw = best["state_dict"], best["current_model_state"]
    assert any(not torch.equal(ema[k], raw[k]) for k in ema if k.startswith("net."))
    # test ran on the best checkpoint's EMA weights, not on its raw `current_model_state`
    tested = objects.model.state_dict()
    assert all(torch.equal(tested[k], v) for k, v in ema.items() if k.startswith("net."))
    last = checkpoints.load(run_dir / "checkpoints" / "last.ckpt")
    # test after fit ran on the best checkpoint's EMA weights; eval.py on the same file agrees exactly (in the
    # run's fp32: eval's default `auto` picks bf16 on a CPU whose native bf16 measures faster)
    overrides = [
        f"ckpt_path={objects.best_model_path}",
        "trainer.precision=32-true",
        "extras.print_config=false",
    ]
    evaluated = evaluate(compose_cfg("eval", overrides, tmp_path))[0]
    assert evaluated["test/acc1"] == pytest.approx(metrics["test/acc1"])
    assert evaluated["test/loss"] == pytest.approx(metrics["test/loss"], rel=1e-6)
    assert "averaging_state" in last and last["callbacks"]


def test_ema_resume_is_exact(ema_run, tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """Resumed from epoch 0's checkpoint, the second epoch ends with the raw and the EMA weights (and the
    averaging count) bitwise those of the uninterrupted run."""
    run_dir, _, _ = ema_run
    (epoch0,) = (run_dir / "checkpoints").glob("epoch000-*.ckpt")
    resumed = tmp_path / "resumed"
    train(
        compose_cfg(
            "train", ema_overrides(tiny_cifar, data_cache, f"ckpt_path={epoch0}", "test=false"), resumed
        )
    )
    straight = checkpoints.load(run_dir / "checkpoints" / "last.ckpt")
    again = checkpoints.load(resumed / "checkpoints" / "last.ckpt")
    for key in ("current_model_state", "averaging_state", "state_dict"):
        assert straight[key].keys() == again[key].keys()
        for name, value in straight[key].items():
            assert torch.equal(value, again[key][name]), (key, name)


class _ConvBN(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))


def _ema_callback(module: L.LightningModule, use_buffers: bool) -> EMA:
    callback = EMA(decay=0.9, use_buffers=use_buffers)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=module.device))
    callback.setup(trainer, module, "fit")  # Lightning's AveragedModel, on the module's device
    return callback


@pytest.mark.parametrize("use_buffers", [True, False])
def test_ema_update_is_averaged_models_without_reading_its_count(use_buffers: bool):
    """One or two DDP/one-device EMA steps give AveragedModel.update_parameters' floating values bitwise, and
    read nothing back from the device: AveragedModel itself reads its count (a tensor on the model's
    device) twice per step, which on a GPU waits for every queued kernel; the meta device holds no values."""
    module = _ConvBN()
    reference = AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=use_buffers)
    callback = _ema_callback(module, use_buffers)
    for step in range(4):
        with torch.no_grad():
            for t in [*module.parameters(), module.net[1].running_mean]:
                t.add_(torch.randn_like(t))
        if step == 2:  # new values loaded in place, and validation's swaps: the update follows them
            module.load_state_dict({k: v + 1 for k, v in module.state_dict().items()})
            callback._swap_models(module)
            callback._swap_models(module)
        reference.update_parameters(module)
        callback._update(module)
    ours = averaged_model(callback).state_dict()
    assert ours["n_averaged"].item() == reference.n_averaged.item() == 4
    for name, value in reference.state_dict().items():
        if value.is_floating_point():
            assert torch.equal(ours[name], value), name

    with torch.device("meta"):
        on_meta = _ConvBN()
    callback = _ema_callback(on_meta, use_buffers)
    assert averaged_model(callback).n_averaged.device.type == "meta"
    callback._update(on_meta)
    callback._update(on_meta)
    # what the test detects: AveragedModel's own reads of its count on the device (as Lightning builds it)
    reference = AveragedModel(on_meta, device=on_meta.device, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):
        reference.update_parameters(on_meta)


def test_the_ema_of_a_16_bit_model_moves(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """Under `trainer.precision=bf16-true` the weights are bf16: an EMA step moves the average by 1e-3 of its
    distance to them (decay 0.999), far below bf16's resolution. Both EMA kinds average in float32 and follow
    the weights as float32 arithmetic does; a bf16 average would not move (Lightning's AveragedModel, made
    before the model was converted, is float32: the update failed on the mixed dtypes)."""
    module = _ConvBN().to(torch.bfloat16)
    callback = _ema_callback(_ConvBN(), use_buffers=True)  # made in float32, as Lightning's setup makes it
    callback.decay = 0.999
    sharded = ShardedEMA(module, use_buffers=True)
    first = [t.float() for t in module.parameters()]
    expected = list(first)
    for step in range(3):
        if step:
            with torch.no_grad():
                for t in module.parameters():
                    t.add_(0.5)
            expected = [e.lerp(t.float(), 0.001) for e, t in zip(expected, module.parameters(), strict=True)]
        callback._update(module)  # the first update copies the weights, as AveragedModel's does
        sharded.update(0.999)
        # validation's swaps: the model validates the EMA rounded to bf16, the average stays exact (swapped
        # back through the bf16 model it was rounded at every validation: Lightning's swap)
        raw = [t.clone() for t in module.parameters()]
        lightnings = (
            partial(callback.on_validation_epoch_start, None, module),
            partial(callback.on_validation_epoch_end, None, module),
        )
        for swap_in, swap_out in (lightnings, (sharded.swap, sharded.swap)):
            swap_in()
            validated = [t.clone() for t in module.parameters()]
            assert all(torch.equal(v, e.bfloat16()) for v, e in zip(validated, expected, strict=True))
            swap_out()
            assert all(torch.equal(t, r) for t, r in zip(module.parameters(), raw, strict=True))
    kept = list(averaged_model(callback).module.parameters())
    shards = sharded.average[: len(kept)]  # the parameters first, then the buffers
    for ours, shard, want, start in zip(kept, shards, expected, first, strict=True):
        assert ours.dtype == shard.dtype == torch.float32
        assert torch.equal(ours, want) and torch.equal(shard, want) and not torch.equal(want, start)

    # and a whole run: trains, validates and saves the EMA (float32) beside the bf16 weights
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        "callbacks=[default,ema]",
        "trainer.precision=bf16-true",
    ]
    train(compose_cfg("train", [*overrides, "logger=none", "test=false"], tmp_path))
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    name = "net.patch_embed.proj.weight"
    assert saved["state_dict"][name].dtype == torch.float32
    assert saved["current_model_state"][name].dtype == torch.bfloat16


@pytest.fixture(scope="module")
def fsdp_ema_run(tmp_path_factory: pytest.TempPathFactory, tiny_cifar: Path, data_cache: Path):
    """The EMA run on 2 FSDP processes (gloo): 2 epochs of 3 steps, every epoch's checkpoint a folder."""
    run_dir = tmp_path_factory.mktemp("fsdp_ema") / "run"
    output = fsdp_ema_job(run_dir, ema_overrides(tiny_cifar, data_cache, "datamodule.val_size=9"))
    return run_dir, output


def fsdp_ema_job(run_dir: Path, overrides: list[str]) -> str:
    args = [*overrides, "trainer=fsdp", "trainer.devices=2", "logger=csv", f"hydra.run.dir={run_dir}"]
    done = torchrun([ROOT / "src" / "train.py", *args])
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout + done.stderr


def logged(run_dir: Path, metric: str) -> list[float]:
    with (run_dir / "csv" / "metrics.csv").open() as f:
        return [float(row[metric]) for row in csv.DictReader(f) if row.get(metric)]


@pytest.mark.distributed
@pytest.mark.timeout(2 * RUN_TIMEOUT)
def test_fsdp_ema_validates_checkpoints_and_evaluates_the_ema_weights(fsdp_ema_run, tmp_path: Path):
    """Under FSDP the sharded folders hold the EMA weights as `state_dict` and the raw ones beside them;
    validation ran on the EMA weights (eval.py on each epoch's checkpoint reproduces its logged val loss)
    and eval.py on the best checkpoint reports the run's test metrics."""
    fsdp_ema_run, output = fsdp_ema_run
    folders = sorted((fsdp_ema_run / "checkpoints").glob("epoch*.ckpt"))
    assert len(folders) == 2 and all(f.is_dir() for f in folders)
    val_losses = logged(fsdp_ema_run, "val/loss")
    for epoch, folder in enumerate(folders):
        state = checkpoints.load(folder)
        ema, raw = state["state_dict"], state["current_model_state"]
        assert ema.keys() == raw.keys()
        assert any(not torch.equal(ema[k], raw[k]) for k in ema if k.startswith("net."))
        assert int(state["averaging_state"]["n_averaged"]) == state["global_step"] > 0  # one per step
        evaluated = evaluate(
            compose_cfg(
                "eval",
                [
                    f"ckpt_path={folder}",
                    "split=val",
                    "trainer.precision=32-true",
                    "extras.print_config=false",
                ],
                tmp_path / f"val{epoch}",
            )
        )[0]
        assert evaluated["val/loss"] == pytest.approx(val_losses[epoch], rel=1e-6)
    # the raw weights of the last epoch validate differently: the logged loss can only be the EMA's
    torch.save({**state, "state_dict": raw}, tmp_path / "raw.ckpt")
    cfg = ["split=val", "trainer.precision=32-true", "extras.print_config=false"]
    raw_val = evaluate(compose_cfg("eval", [f"ckpt_path={tmp_path / 'raw.ckpt'}", *cfg], tmp_path / "raw"))[0]
    assert raw_val["val/loss"] != pytest.approx(val_losses[-1], rel=1e-4)
    (best_path,) = set(re.findall(r"Testing the best checkpoint: (\S+)", output))
    evaluated = evaluate(
        compose_cfg(
            "eval",
            [f"ckpt_path={best_path}", "trainer.precision=32-true", "extras.print_config=false"],
            tmp_path / "test",
        )
    )[0]
    assert evaluated["test/acc1"] == pytest.approx(logged(fsdp_ema_run, "test/acc1")[-1])
    assert evaluated["test/loss"] == pytest.approx(logged(fsdp_ema_run, "test/loss")[-1], rel=1e-6)


@pytest.mark.distributed
@pytest.mark.timeout(2 * RUN_TIMEOUT)
def test_fsdp_ema_resume_is_exact(fsdp_ema_run, tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """Resumed on 2 FSDP processes from epoch 0's folder, the second epoch ends with the raw and the EMA
    shards (and the averaging count) bitwise those of the uninterrupted run."""
    fsdp_ema_run, _ = fsdp_ema_run
    (epoch0,) = (fsdp_ema_run / "checkpoints").glob("epoch000-*.ckpt")
    resumed = tmp_path / "resumed"
    fsdp_ema_job(
        resumed,
        ema_overrides(tiny_cifar, data_cache, "datamodule.val_size=9", f"ckpt_path={epoch0}", "test=false"),
    )
    straight = checkpoints.load(fsdp_ema_run / "checkpoints" / "last.ckpt")
    again = checkpoints.load(resumed / "checkpoints" / "last.ckpt")
    for key in ("current_model_state", "averaging_state", "state_dict"):
        assert straight[key].keys() == again[key].keys()
        for name, value in straight[key].items():
            assert torch.equal(value, again[key][name]), (key, name)


def test_fsdp_ema_refuses_one_file_checkpoints():
    trainer = type("T", (), {"strategy": FSDP2Strategy(save_distributed_checkpoint=False)})()
    with pytest.raises(UserError, match=re.escape("save_distributed_checkpoint=true")):
        EMA().setup(trainer, None, "fit")


# --- mixup / cutmix, layer-wise LR decay, grad checkpointing ----------------------------------------


def tiny_classifier(**kwargs) -> ImageClassifier:
    net = {"model_name": "vit_tiny_patch16_224", "num_classes": 10, "img_size": 32, "patch_size": 8,
           "embed_dim": 32, "depth": 4, "num_heads": 2}  # fmt: skip
    optimizer = {"_target_": "torch.optim.AdamW", "lr": 1e-3, "weight_decay": 0.05}
    return ImageClassifier(net=net, optimizer=optimizer, **kwargs)


def test_mixup_gives_soft_targets_and_soft_loss():
    model = tiny_classifier(mixup={"mixup_alpha": 0.8, "cutmix_alpha": 1.0}, label_smoothing=0.1)
    assert model.mixup is not None
    x, y = torch.randn(8, 3, 32, 32), torch.arange(8) % 10
    mixed, soft = model.mixup(x.clone(), y)
    assert soft.shape == (8, 10) and torch.allclose(soft.sum(1), torch.ones(8))
    assert (soft > 0.2).sum(1).min() >= 1 and not torch.equal(mixed, x)
    loss = model.soft_loss(model(mixed), soft)
    assert torch.isfinite(loss)
    assert tiny_classifier().mixup is None  # alphas 0: plain cross-entropy


def test_flip_tta_scores_the_mean_of_image_and_mirror_logits():
    """`model.tta_flip=true`: evaluation scores the mean of each image's and its mirror's logits; training
    steps are untouched."""
    torch.manual_seed(0)
    plain, tta = tiny_classifier().eval(), tiny_classifier(tta_flip=True).eval()
    tta.load_state_dict(plain.state_dict())
    x, y = torch.randn(16, 3, 32, 32), torch.arange(16) % 10
    with torch.no_grad():
        mean_logits = (plain(x) + plain(x.flip(-1))) / 2
        for model in (plain, tta):
            model.test_metrics.reset()
            model.test_loss.reset()
            model._eval_step((x, y), model.test_metrics, model.test_loss)
    expected = F.cross_entropy(mean_logits, y)
    torch.testing.assert_close(tta.test_loss.compute(), expected)
    assert not torch.allclose(plain.test_loss.compute(), expected)  # the mirror changes the prediction
    top1 = (mean_logits.argmax(1) == y).float().mean()
    torch.testing.assert_close(tta.test_metrics.compute()["test/acc1"], top1)


def test_layer_decay_param_groups():
    model = tiny_classifier(layer_decay=0.5)
    optimizer = model.configure_optimizers()["optimizer"]
    assert optimizer.defaults["fused"] is True  # on CPU parameters too (fused_default)
    groups = optimizer.param_groups
    name = {id(p): n for n, p in model.net.named_parameters()}
    lr_of = {name[id(p)]: g["lr"] for g in groups for p in g["params"]}
    assert lr_of["head.weight"] == pytest.approx(1e-3)
    assert lr_of["blocks.3.mlp.fc1.weight"] == pytest.approx(1e-3 * 0.5)
    assert lr_of["blocks.0.mlp.fc1.weight"] == pytest.approx(1e-3 * 0.5**4)
    assert lr_of["patch_embed.proj.weight"] == pytest.approx(1e-3 * 0.5**5)
    wd_of = {name[id(p)]: g["weight_decay"] for g in groups for p in g["params"]}
    assert wd_of["blocks.0.norm1.weight"] == 0 and wd_of["pos_embed"] == 0 and wd_of["head.weight"] == 0.05
    with pytest.raises(ModelError, match=re.escape("model.layer_decay=1.5")):
        tiny_classifier(layer_decay=1.5)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_recipe_options_train_together(precision: str, tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """mixup + cutmix, RandAugment, random erasing, LLRD, grad checkpointing, clipping, accumulation; under
    a mixed precision (a GPU's default) too, where Lightning refuses to clip a fused optimizer's gradients:
    the optimizer then steps unfused, and a `fused: true` given is refused in one line."""
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        f"trainer.precision={precision}",
        "model.mixup.mixup_alpha=0.8",
        "model.mixup.cutmix_alpha=1.0",
        "model.layer_decay=0.75",
        "model.grad_checkpointing=true",
        "datamodule.auto_augment=rand-m9-n2-mstd0.5",
        "datamodule.re_prob=0.25",
        "trainer.gradient_clip_val=1.0",
        "trainer.accumulate_grad_batches=2",
        "+trainer.limit_train_batches=4",
        "test=false",
    ]
    _, objects = train(compose_cfg("train", overrides, tmp_path))
    assert objects.trainer.global_step == 2
    assert objects.model.net.grad_checkpointing is True
    assert all(torch.isfinite(p).all() for p in objects.model.parameters())
    assert bool(objects.trainer.optimizers[0].defaults.get("fused")) is (precision == "32-true")
    if precision == "bf16-mixed":
        code, stderr = fails_in_process(
            "train", [*overrides, "+model.optimizer.fused=true"], tmp_path / "fused"
        )
        assert code == 2 and stderr.strip().splitlines()[-1] == (
            "error: model.optimizer.fused=true cannot be combined with trainer.gradient_clip_val=1.0 under "
            "trainer.precision=bf16-mixed: Lightning does not clip a fused optimizer's gradients under mixed "
            "precision; drop model.optimizer.fused (the default steps without it then) or the clipping"
        ), stderr


# --- progressive resizing ----------------------------------------------------------------------------


def test_progressive_resize_ramps_to_the_full_size():
    resize = ProgressiveResize(start_size=16, start=0.2, end=0.6, multiple=8)
    sizes = [resize.size(p / 10, 32) for p in range(11)]
    assert sizes == [16, 16, 16, 16, 24, 24, 32, 32, 32, 32, 32]
    x = torch.rand(2, 3, 32, 48)
    assert resize(x, 0.0).shape == (2, 3, 16, 24)  # the short side to the size, the aspect ratio kept
    assert resize(x, 1.0) is x
    # a 16-bit batch (trainer.precision=bf16-true): resized as float32 is (the CPU has no 16-bit kernel)
    for dtype in (torch.bfloat16, torch.float16):
        small = resize(x.to(dtype), 0.0)
        assert small.dtype == dtype and torch.equal(small, resize(x.to(dtype).float(), 0.0).to(dtype))
    assert ProgressiveResize(start_size=64, multiple=8).size(0.0, 32) == 32  # never upsampled
    assert make_resize({"start_size": None, "end": 0.5}) is None
    for bad, message in [
        ({"start_size": 12, "multiple": 8}, "start_size=12 must be a positive multiple"),
        ({"start_size": 16, "start": 0.5, "end": 0.5}, "need 0 <= start < end <= 1"),
        ({"start_size": 16, "ends": 0.5}, "unexpected keyword argument 'ends'"),
    ]:
        with pytest.raises(ModelError, match=re.escape(message)):
            make_resize(bad)


def test_progressive_resize_trains_small_then_full(tmp_path: Path, tiny_cifar: Path, data_cache: Path):
    """Training batches grow from 16 to 32 px with the run's progress (a ViT resamples its position
    embeddings); validation and test see the full size. A ViT without dynamic_img_size is refused."""
    resize = ["model.progressive_resize.start_size=16", "model.progressive_resize.end=0.75",
              "model.progressive_resize.multiple=8"]  # fmt: skip
    overrides = [
        *tiny_overrides(tiny_cifar, data_cache),
        *resize,
        "+trainer.limit_train_batches=8",
        "logger=csv",
    ]
    code, stderr = fails_in_process("train", overrides, tmp_path / "refused")
    assert code == 2 and "needs model.net.dynamic_img_size=true" in stderr.strip().splitlines()[-1], stderr
    metrics, objects = train(
        compose_cfg("train", [*overrides, "+model.net.dynamic_img_size=true"], tmp_path / "run")
    )
    assert logged(tmp_path / "run", "train/img_size") == [16, 16, 16, 24, 24, 24, 32, 32]
    assert objects.model.net.patch_embed.grid_size == (4, 4)  # built for 32 px, as evaluated
    # images/s and MFU count each step's FLOPs at the size it trained at, not the full size
    (monitor,) = [c for c in objects.trainer.callbacks if isinstance(c, ImageThroughputMonitor)]
    flops = monitor.resized_train_flops
    assert set(flops) == {(16, 16), (24, 24), (32, 32)}
    assert flops[(16, 16)] < flops[(24, 24)] < flops[(32, 32)] == monitor.train_flops
    stats = json.loads((tmp_path / "run" / "run_stats.json").read_text())["flops"]
    assert stats["resized_train_flops_per_image"]["16x16"] == flops[(16, 16)]
    assert 0 <= metrics["val/acc1"] <= 1 and "test/acc1" in metrics


# --- per-image random augmentation -------------------------------------------------------------------


def test_each_image_gets_its_own_op_and_magnitude():
    torch.manual_seed(0)
    augment = RandomAugment.from_name("rand-m9-n2-mstd0.5")
    ops, mag = augment.sample(64)
    assert len(ops.unique()) > 5 and len(mag.unique()) > 32
    # the same image twice, two different ops: two different results, each the op's own output
    image = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    batch = image.repeat(2, 1, 1, 1)
    names = ["Solarize", "Posterize"]
    out = augment.apply(batch, torch.tensor([augment.ops.index(n) for n in names]), torch.tensor([0.5, 1.0]))
    assert not torch.equal(out[0], out[1])
    assert torch.equal(out[0:1], OPS["Solarize"](image, torch.tensor([0.5]), augment.ranges))
    assert torch.equal(out[1:2], OPS["Posterize"](image, torch.tensor([1.0]), augment.ranges))
    # one op, two magnitudes: different results too
    solarize = torch.full((2,), augment.ops.index("Solarize"))
    out = augment.apply(batch, solarize, torch.tensor([0.1, 0.9]))
    assert not torch.equal(out[0], out[1])


@pytest.mark.parametrize("spec", ["rand-m9-n2-mstd0.5", "rand-m5-n1", "trivial"])
def test_random_augment_keeps_uint8_shape(spec: str):
    x = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    out = RandomAugment.from_name(spec)(x)
    assert out.dtype == torch.uint8 and out.shape == x.shape and not torch.equal(out, x)


@pytest.mark.parametrize("spec", ["rand-m9-n2-mstd0.5", "trivial", None])
def test_batch_transform_reads_nothing_back_from_the_device(spec: str | None):
    """On a GPU, reading a device value on the host (`.tolist()`, `.item()`, a count per op) waits for every
    queued kernel at every batch. The "meta" device holds no values: a transform that runs there reads none."""
    x = torch.empty(16, 3, 32, 32, dtype=torch.uint8, device="meta")
    transform = BatchTransform(32, (0.5,) * 3, (0.5,) * 3, auto_augment=spec, re_prob=0.25)
    out = transform(x, train=True)
    assert out.device.type == "meta" and out.shape == (16, 3, 32, 32) and out.dtype == torch.float32


def test_bad_augment_names_are_data_errors():
    with pytest.raises(DataError, match=re.escape("datamodule.auto_augment='autoaug'")):
        RandomAugment.from_name("autoaug")
    with pytest.raises(DataError, match=re.escape("unknown option 'x'")):
        RandomAugment.from_name("rand-m9-x3")


def test_callbacks_ema_config_composes(tmp_path: Path):
    cfg = compose_cfg("train", [*TINY_VIT, "callbacks=[default,ema]"], tmp_path)
    assert cfg.callbacks.ema._target_ == "vitrain.callbacks.ema.EMA"
    assert isinstance(ModelCheckpoint, type)
