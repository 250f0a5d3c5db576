"""One test per private Lightning/torch/litdata name in vitrain/compat.py: a failure here names what an
upgrade moved, renamed or changed, before a training run finds out."""

import importlib
import inspect
import os
import uuid
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ThroughputMonitor, WeightAveraging
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from vitrain import compat
from warm import ScriptRun

UPGRADE = "Lightning/torch/litdata upgrade changed a private name vitrain relies on (vitrain/compat.py):"


def tiny_trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_should_update_logs():
    trainer = tiny_trainer(log_every_n_steps=5)
    assert hasattr(trainer, "_logger_connector"), f"{UPGRADE} Trainer._logger_connector is gone"
    assert hasattr(type(trainer._logger_connector), "should_update_logs"), (
        f"{UPGRADE} the logger connector has no should_update_logs"
    )
    assert compat.should_update_logs(trainer) is True  # no loop running: Lightning says log
    assert compat.should_update_logs(tiny_trainer(log_every_n_steps=0)) is False


def test_attached_trainer():
    module = L.LightningModule()
    assert compat.attached_trainer(module) is None, f"{UPGRADE} LightningModule._trainer"
    trainer = tiny_trainer()
    module.trainer = trainer
    assert compat.attached_trainer(module) is trainer, f"{UPGRADE} LightningModule._trainer"


def test_replace_sigterm_broadcast():
    trainer = tiny_trainer()
    loop = type(trainer.fit_loop.epoch_loop)
    assert hasattr(loop, "_broadcast_sigterm_tensor"), (
        f"{UPGRADE} {loop.__name__}._broadcast_sigterm_tensor is gone: CheckpointOnSigterm would add a "
        "second collective per step"
    )
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(loop.advance), (
        f"{UPGRADE} the epoch loop no longer calls _broadcast_sigterm_tensor before a batch"
    )
    calls: list[int] = []
    assert compat.replace_sigterm_broadcast(trainer, lambda: calls.append(1))
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert calls == [1]


def test_plugin_compute_dtype():
    assert compat.plugin_compute_dtype(MixedPrecision("bf16-mixed", "cpu")) is torch.bfloat16, (
        f"{UPGRADE} _plugin_to_compute_dtype"
    )
    assert compat.plugin_compute_dtype(Precision()) is torch.float32


def test_epochs_from_one_bar():
    """Rich's bar takes its epoch text from `_get_train_description`: ours numbers from 1 to max_epochs."""
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.demos.boring_classes import BoringModel

    assert parameters(RichProgressBar._get_train_description) == ["self", "current_epoch"], (
        f"{UPGRADE} RichProgressBar._get_train_description"
    )
    seen = []

    class Bar(compat.EpochsFromOneBar):
        def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            super().on_train_epoch_end(trainer, pl_module)
            seen.append(self.progress.tasks[self.train_progress_bar_id].description.strip())

    trainer = L.Trainer(
        accelerator="cpu", max_epochs=2, limit_train_batches=2, limit_val_batches=1, logger=False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=[Bar(leave=True)],
    )  # fmt: skip
    trainer.fit(BoringModel())
    assert seen == ["Epoch 1/2", "Epoch 2/2"], f"{UPGRADE} the bar's epoch text: {seen}"


def test_throughput_monitor_internals():
    assert parameters(ThroughputMonitor._update) == ["self", "trainer", "pl_module", "batch", "iter_num"], (
        f"{UPGRADE} ThroughputMonitor._update's signature"
    )
    assert "self._update(" in inspect.getsource(ThroughputMonitor.on_train_batch_end), (
        f"{UPGRADE} ThroughputMonitor no longer updates through _update: our no-sync override is skipped"
    )
    monitor = compat.UnsyncedThroughputMonitor(batch_size_fn=len, window_size=2)
    for name in ("_t0s", "_throughputs", "_lengths", "_samples", "_batches"):
        assert isinstance(getattr(monitor, name, None), dict), f"{UPGRADE} ThroughputMonitor.{name}"
    trainer = SimpleNamespace(
        state=SimpleNamespace(stage=RunningStage.TRAINING, fn=TrainerFn.FITTING),
        precision_plugin=Precision(),
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
        enable_validation=False,
        world_size=1,
        _logger_connector=SimpleNamespace(should_update_logs=False),
        is_last_batch=False,
        training=True,
    )
    monitor.setup(trainer, L.LightningModule(), "fit")
    monitor.set_available_flops(10**12)
    monitor._start(trainer)
    monitor._update(trainer, L.LightningModule(), [0, 1, 2], 1)
    assert monitor._samples[RunningStage.TRAINING] == 3 and monitor._batches[RunningStage.TRAINING] == 1
    assert monitor._throughputs[RunningStage.TRAINING].available_flops == 10**12
    # a window fitted to a short run replaces the meter setup made, with the same peak
    monitor.fit_train_window(trainer, 5)
    meter = monitor._throughputs[RunningStage.TRAINING]
    assert meter._time.maxlen == 5 and meter.available_flops == 10**12, f"{UPGRADE} Throughput's window"
    # Lightning's own _compute logs through the logger connector, as our override does
    assert "_logger_connector.log_metrics" in inspect.getsource(ThroughputMonitor._compute), (
        f"{UPGRADE} _compute"
    )


def test_weight_averaging_internals():
    callback = EMAWeightAveraging(device="cpu", use_buffers=False)
    assert compat.averaging_device(callback) == torch.device("cpu"), f"{UPGRADE} WeightAveraging._device"
    assert compat.averaging_uses_buffers(callback) is False, f"{UPGRADE} WeightAveraging._use_buffers"
    assert compat.latest_averaging_update(callback) == (0, -1), f"{UPGRADE} WeightAveraging._latest_update_*"
    compat.set_averaging_device(callback, torch.device("meta"))
    compat.set_latest_averaging_update(callback, step=7)
    compat.set_latest_averaging_update(callback, epoch=2)
    assert compat.averaging_device(callback) == torch.device("meta")
    assert compat.latest_averaging_update(callback) == (7, 2)
    # Lightning reads them where we expect: the device at setup, the counters before an update
    assert "self._device" in inspect.getsource(WeightAveraging.setup), f"{UPGRADE} WeightAveraging.setup"
    assert "self._latest_update_step" in inspect.getsource(WeightAveraging.on_train_batch_end)
    assert "self._latest_update_epoch" in inspect.getsource(WeightAveraging.on_train_epoch_end)


def test_set_data_parallel_size():
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size="auto", tensor_parallel_size=1)
    compat.set_data_parallel_size(strategy, 4)
    assert strategy._data_parallel_size == 4, f"{UPGRADE} ModelParallelStrategy._data_parallel_size"
    assert "self._data_parallel_size" in inspect.getsource(ModelParallelStrategy.setup_environment), (
        f"{UPGRADE} ModelParallelStrategy.setup_environment no longer reads _data_parallel_size"
    )


def test_hydra_subprocess_cmd():
    originals = {}
    for name in compat.HYDRA_LAUNCHER_MODULES:
        module = importlib.import_module(name)
        builder = getattr(module, "_hydra_subprocess_cmd", None)
        assert callable(builder), f"{UPGRADE} {name}._hydra_subprocess_cmd is gone: multirun with DDP breaks"
        assert parameters(builder) == ["local_rank"], f"{UPGRADE} {name}._hydra_subprocess_cmd's signature"
        assert "_hydra_subprocess_cmd(" in inspect.getsource(module), f"{UPGRADE} {name} no longer calls it"
        originals[name] = builder

    def mine(local_rank: int):
        return ["child", str(local_rank)], "/"

    try:
        assert compat.install_hydra_subprocess_cmd(mine) is None
        for name in compat.HYDRA_LAUNCHER_MODULES:
            assert importlib.import_module(name)._hydra_subprocess_cmd is mine
    finally:
        compat.uninstall_hydra_subprocess_cmd()
    for name, builder in originals.items():
        assert importlib.import_module(name)._hydra_subprocess_cmd is builder


def test_meta_filename():
    # the name is in every sharded checkpoint already written: a change in Lightning must be noticed
    assert compat.META_FILENAME == "meta.pt", f"{UPGRADE} Lightning's _METADATA_FILENAME"


def test_load_dcp_folder(tmp_path: Path):
    import torch.distributed.checkpoint as dcp

    state = {"state_dict": {"w": torch.arange(6.0).reshape(2, 3)}, "step": torch.tensor(4)}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    loaded = compat.load_dcp_folder(tmp_path)
    torch.testing.assert_close(loaded["state_dict"]["w"], state["state_dict"]["w"])
    assert int(loaded["step"]) == 4, f"{UPGRADE} torch's _EmptyStateDictLoadPlanner / _load_state_dict"


def test_mkldnn_bf16_supported():
    assert hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported"), f"{UPGRADE} torch.ops.mkldnn"
    assert isinstance(compat.mkldnn_bf16_supported(), bool)


def test_foreach_lerp():
    start, end = [torch.zeros(3), torch.ones(2)], [torch.full((3,), 2.0), torch.full((2,), 3.0)]
    compat.foreach_lerp_(start, end, 0.25)
    torch.testing.assert_close(start[0], torch.full((3,), 0.5), msg=f"{UPGRADE} torch._foreach_lerp_")
    torch.testing.assert_close(start[1], torch.full((2,), 1.5))


def test_torch_dispatch_mode():
    """A mode sees the ops run under it, with their schema names (what DeviceOps counts)."""
    seen = []

    class Seen(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.ones(2, device="meta").add_(1)
    assert "aten::add_" in seen, f"{UPGRADE} torch.utils._python_dispatch.TorchDispatchMode: {seen}"


def test_local_shard(tmp_path: Path):
    """The DTensor's own local tensor: the same storage, so an update through it is the DTensor's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        d = DTensor.from_local(torch.zeros(4, 2), mesh, [Shard(0)])
        local = compat.local_shard(d)
        assert type(local) is torch.Tensor and local.shape == (4, 2), f"{UPGRADE} DTensor._local_tensor"
        local.add_(1.0)
        assert torch.equal(d.full_tensor(), torch.ones(4, 2)), f"{UPGRADE} DTensor._local_tensor is a copy"
    finally:
        dist.destroy_process_group()


def test_checkpoint_wrapper():
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    wrapped = torch.nn.Sequential(compat.checkpoint_wrapper(plain[0]), plain[1])
    # our checkpoints keep the plain model's keys: torch's state-dict hooks drop the wrapper's prefix
    assert list(wrapped.state_dict()) == ["0.weight", "0.bias"], f"{UPGRADE} checkpoint_wrapper's keys"
    x = torch.randn(2, 4, requires_grad=True)
    wrapped(x).sum().backward()
    assert plain[0].weight.grad is not None


def test_litdata_distributed_env():
    pytest.importorskip("litdata")
    env = compat.litdata_distributed_env(4, 2, num_nodes=1)
    assert (env.world_size, env.global_rank, env.num_nodes) == (4, 2, 1), f"{UPGRADE} litdata _DistributedEnv"
    from litdata import StreamingDataset

    assert "distributed_env" in inspect.getsource(StreamingDataset), (
        f"{UPGRADE} StreamingDataset.distributed_env"
    )


def test_litdata_allow_http(monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("litdata")
    from litdata.streaming import downloader

    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    assert isinstance(options, dict), f"{UPGRADE} litdata's downloader._OBSTORE_CLIENT_OPTIONS is gone"
    monkeypatch.setattr(downloader, "_OBSTORE_CLIENT_OPTIONS", dict(options))
    compat.litdata_allow_http()
    assert downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] == "true"
    assert "client_options=_OBSTORE_CLIENT_OPTIONS" in inspect.getsource(downloader), (
        f"{UPGRADE} litdata no longer builds its obstore clients from _OBSTORE_CLIENT_OPTIONS"
    )


def test_set_wandb_run_id(tmp_path: Path):
    from lightning.pytorch.loggers import WandbLogger

    logger = WandbLogger(project="p", save_dir=str(tmp_path))
    assert "_wandb_init" in vars(logger) and "_id" in vars(logger), f"{UPGRADE} WandbLogger's init arguments"
    compat.set_wandb_run_id(logger, "abc123")
    assert logger.version == "abc123" and logger._wandb_init["id"] == "abc123"
    assert logger._wandb_init["resume"] == "allow", f"{UPGRADE} WandbLogger no longer resumes a given id"
    assert logger._wandb_init == WandbLogger(project="p", save_dir=str(tmp_path), id="abc123")._wandb_init


def test_set_mlflow_run_id(mlflow_server: str):
    from lightning.pytorch.loggers import MLFlowLogger

    # the session's server: a new SQLite store would cost its schema migrations (~15 s of CPU)
    experiment = f"e-{uuid.uuid4().hex[:8]}"
    first = MLFlowLogger(experiment_name=experiment, tracking_uri=mlflow_server)
    run_id = first.run_id  # starts a run
    logger = MLFlowLogger(experiment_name=experiment, tracking_uri=mlflow_server)
    compat.set_mlflow_run_id(logger, run_id)
    assert logger.run_id == run_id and logger.experiment_id == first.experiment_id, (
        f"{UPGRADE} MLFlowLogger run"
    )
    with pytest.raises(RuntimeError, match="has started"):
        compat.set_mlflow_run_id(logger, "another")


def test_mlflow_params(mlflow_server: str):
    """What Lightning's MLFlowLogger logs for a nested config is what `mlflow_params` says it logs."""
    from lightning.pytorch.loggers import MLFlowLogger

    logger = MLFlowLogger(experiment_name=f"e-{uuid.uuid4().hex[:8]}", tracking_uri=mlflow_server)
    params = {
        "model": {"net": {"name": "vit", "dims": [1, 2]}, "lr": 0.001},
        "ckpt_path": None,
        "x": "y" * 300,
    }
    logger.log_hyperparams(params)
    logged = logger.experiment.get_run(logger.run_id).data.params
    assert logged == compat.mlflow_params(params), (
        f"{UPGRADE} MLFlowLogger.log_hyperparams converts otherwise"
    )


def test_tensorboard_purge_from(tmp_path: Path):
    """An open writer's purge event hides what an earlier writer of the run logged from that step on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    killed = SummaryWriter(str(tmp_path))
    for step in range(10):
        killed.add_scalar("loss", float(step), step)
    killed.close()
    resumed = SummaryWriter(str(tmp_path))
    resumed.add_text("note", "opened before the step to resume from was known", 0)
    compat.tensorboard_purge_from(resumed, 5)
    for step in range(5, 8):
        resumed.add_scalar("loss", 100.0 + step, step)
    resumed.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    shown = [(e.step, e.value) for e in events.Scalars("loss")]
    assert shown == [(s, float(s)) for s in range(5)] + [(s, 100.0 + s) for s in range(5, 8)], (
        f"{UPGRADE} the purge event is not honoured: {shown}"
    )


def test_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert compat.wandb_offline(WandbLogger(project="p", save_dir=str(tmp_path), offline=True))
    assert not compat.wandb_offline(WandbLogger(project="p", save_dir=str(tmp_path)))
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert compat.wandb_offline(WandbLogger(project="p", save_dir=str(tmp_path)))


OBSERVED = """
import subprocess, sys, time
from types import SimpleNamespace
from lightning.fabric.strategies.launchers.subprocess_script import _launch_process_observer
from vitrain.compat import unwatch_launched_ranks
procs = [subprocess.Popen(["sh", "-c", "exit 143"])]  # a rank that ended its agreed stop first
_launch_process_observer(procs)
if sys.argv[1] == "unwatch":
    assert [p.wait() for p in unwatch_launched_ranks(SimpleNamespace(procs=procs))] == [143]
time.sleep(7)  # past the observer's next look (every 5 s)
print("lived on")
"""


def test_unwatch_launched_ranks(tmp_path: Path):
    """Lightning's launcher hands its own `procs` list to the observer that SIGKILLs this process once a child
    exits non-zero; the ranks taken from that list no longer count. Without it, the process is killed."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    assert "_launch_process_observer(self.procs)" in inspect.getsource(_SubprocessScriptLauncher.launch), (
        f"{UPGRADE} _SubprocessScriptLauncher.launch no longer hands `self.procs` to its observer"
    )
    script = tmp_path / "observed.py"
    script.write_text(OBSERVED)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": src}
    runs = {mode: ScriptRun([script, mode], env, tmp_path) for mode in ("unwatch", "watch")}
    done = {mode: run.wait(timeout=120) for mode, run in runs.items()}
    assert done["unwatch"].returncode == 0 and "lived on" in done["unwatch"].stdout, done["unwatch"].stderr
    assert done["watch"].returncode == -9 and "terminated with code 143" in done["watch"].stderr
