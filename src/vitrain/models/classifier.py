"""LightningModule around a timm network: loss, top-1/top-5 accuracy, AdamW + warm-up/cosine."""

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import hydra
import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.optim import param_groups_layer_decay, param_groups_weight_decay
from torch import nn
from torch.distributed.tensor import DTensor
from torchmetrics import MeanMetric, Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from vitrain.checkpoints import CheckpointError
from vitrain.compat import attached_trainer, should_update_logs
from vitrain.distributed.local_step import steps_on_local_shards
from vitrain.distributed.parallelize import parallelize
from vitrain.errors import ModelError, argument_error
from vitrain.models.float8 import convert_to_float8, float8_refusal
from vitrain.models.resolution import make_resize
from vitrain.models.timm_net import create_net, input_spec, patch_convs_as_matmuls
from vitrain.models.train_figures import TrainingFigures, accuracy_top_k, loss_and_figures
from vitrain.utils.config import plain


def _metrics(num_classes: int, prefix: str, validate_args: bool = True) -> MetricCollection:
    # "micro" = plain accuracy; torchmetrics' default "macro" would average per-class accuracies.
    kwargs = {"num_classes": num_classes, "average": "micro", "validate_args": validate_args}
    metrics = {"acc1": MulticlassAccuracy(top_k=1, **kwargs)}
    if num_classes >= 5:
        metrics["acc5"] = MulticlassAccuracy(top_k=5, **kwargs)
    return MetricCollection(metrics, prefix=prefix)


def set_fused_attn(net: nn.Module, enabled: bool) -> None:
    """Pick timm's attention kernel: SDPA (True, timm's default) or its matmul-softmax-matmul (False).

    On CPU, SDPA's flash kernel is slow for short sequences (65 tokens: about 3x slower training of a small
    ViT here, docs/benchmarks.md); on GPU SDPA wins. State-dict keys are the same either way.
    """
    for module in net.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = enabled


class ImageClassifier(L.LightningModule):
    """Classifies images with `timm.create_model(**net)`.

    The batch arrives augmented and normalised by the datamodule (on the device), so the step is only
    forward, loss, metrics. Label smoothing applies to the training loss only: val/test losses are plain
    cross-entropy so they compare across runs.

    `optimizer` and `scheduler` are Hydra nodes kept as data (`_target_` and keywords; the scheduler's
    target also gets `optimizer`, `total_steps` and `trainer`), built in `configure_optimizers`: the
    hyperparameters a checkpoint stores are plain containers, which `torch.load(weights_only=True)` reads.
    """

    def __init__(
        self,
        net: Mapping[str, Any],
        optimizer: Mapping[str, Any],
        scheduler: Mapping[str, Any] | None = None,
        label_smoothing: float = 0.0,
        weights_file: str | None = None,
        compile: bool | str = "auto",
        compile_scope: str = "auto",
        compile_mode: str | None = None,
        fused_attn: bool | None = None,
        mixup: Mapping[str, Any] | None = None,
        layer_decay: float | None = None,
        grad_checkpointing: bool = False,
        channels_last: bool = False,
        tta_flip: bool = False,
        progressive_resize: Mapping[str, Any] | None = None,
        float8: bool = False,
    ) -> None:
        super().__init__()
        net, optimizer, scheduler, mixup = plain(net), plain(optimizer), plain(scheduler), plain(mixup)
        progressive_resize = plain(progressive_resize)
        for name, node in (("optimizer", optimizer), ("scheduler", scheduler)):
            if not (isinstance(node, dict) and "_target_" in node) and (
                node is not None or name == "optimizer"
            ):
                raise ModelError(f"model.{name} must be a config node with a _target_, not {node!r}")
        if compile_scope not in COMPILE_SCOPES:
            raise ModelError(
                f"model.compile_scope={compile_scope!r} must be one of {', '.join(COMPILE_SCOPES)}"
            )
        if compile_mode not in COMPILE_MODES:
            raise ModelError(
                f"model.compile_mode={compile_mode!r} must be null or one of {', '.join(COMPILE_MODES[1:])}"
            )
        if not isinstance(float8, bool):
            raise ModelError(f"model.float8={float8!r} must be true or false")
        self.save_hyperparameters(logger=False)  # the plain values above (read from this frame's locals)
        self._cuda_graphs = compile_mode in CUDA_GRAPH_MODES  # read every training step
        self.net: nn.Module = create_net(net, weights_file)
        if fused_attn is not None:
            set_fused_attn(self.net, fused_attn)
        if grad_checkpointing:
            set_grad_checkpointing(self.net, net["model_name"])
        if channels_last:
            # NHWC weights and inputs: oneDNN's and cuDNN's faster convolution layouts (docs/recipes.md)
            self.net.to(memory_format=torch.channels_last)
        if layer_decay is not None and not 0 < layer_decay <= 1:
            raise ModelError(f"model.layer_decay={layer_decay} must be in (0, 1] (or null for none)")
        self.resize = make_resize(progressive_resize)
        self.train_input_shape: tuple[int, int] | None = None  # of the last training step, when resized
        if self.resize is not None and getattr(self.net, "dynamic_img_size", None) is False:
            raise ModelError(
                f"model.progressive_resize needs model.net.dynamic_img_size=true with {net['model_name']}: a "
                "ViT's position embeddings are made for one token grid"
            )
        self.input_spec = input_spec(
            self.net, bool(net.get("pretrained") or weights_file), net.get("img_size")
        )
        num_classes = int(self.net.num_classes)
        # no argument checks per step: they scan the labels (torch.unique: a host sync per batch on GPU), and
        # a bad label already fails in the loss; nor NaN checks in the eval losses (isnan().any(): a sync)
        self.val_metrics = _metrics(num_classes, "val/", validate_args=False)
        self.test_metrics = _metrics(num_classes, "test/", validate_args=False)
        self.val_loss = MeanMetric(nan_strategy="disable")
        self.test_loss = MeanMetric(nan_strategy="disable")
        self.mixup = make_mixup(mixup, num_classes, label_smoothing)
        self.soft_loss = SoftTargetCrossEntropy()
        # the epoch's mean training loss and accuracy, summed on the device (vitrain/models/train_figures.py);
        # no NaN check (a host sync per step on GPU; a NaN loss still shows in train/loss_step and the mean)
        self.train_figures = TrainingFigures(accuracy_top_k(num_classes))
        # the training loss of the last step the loggers wrote, on the host
        self.logged_train_loss: float | None = None
        # the loss and the figures' batch sums: compiled with the network in configure_model when it is
        self._loss_and_figures = loss_and_figures
        # the composed Hydra config of the run, stored in every checkpoint so eval.py can rebuild it
        self.run_config: dict[str, Any] | None = None
        # the data's class names in label order (set by describe_run), stored in every checkpoint
        self.class_names: list[str] | None = None
        # the mean and std the training images were normalised with (set by describe_run), stored in every
        # checkpoint: evaluation builds the network without its pretrained weights, whose config gave them
        self.normalisation: dict[str, list[float]] | None = None
        # accuracy per class, tracked only when eval.py asks for it (vitrain/tasks/evaluation.py)
        self.per_class_acc: MulticlassAccuracy | None = None
        # how many classes src/predict.py keeps for each image (`predict_step`)
        self.predict_top_k = 5

    def describe_run(
        self,
        run_config: dict[str, Any] | None,
        class_names: list[str],
        normalisation: Mapping[str, Sequence[float]] | None = None,
    ) -> None:
        """What every checkpoint of this run stores beside the weights: the composed config (eval.py rebuilds
        the run from it), the class names in label order and the images' `mean` and `std` (eval.py, predict.py
        and export.py normalise as the training did; `model.weights_file` starts from them) (build.py)."""
        self.run_config = run_config
        self.class_names = list(class_names)
        if normalisation is not None:
            self.normalisation = {k: [float(x) for x in normalisation[k]] for k in ("mean", "std")}

    def track_per_class_accuracy(self) -> MulticlassAccuracy:
        """Accuracy per class from now on (evaluation), synced across ranks by torchmetrics at compute()."""
        self.per_class_acc = MulticlassAccuracy(
            num_classes=int(self.net.num_classes), average=None, validate_args=False
        )
        return self.per_class_acc

    def meta_net(self) -> torch.nn.Module:
        """A copy of the network's architecture without weights, for counting FLOPs (build it under
        `torch.device("meta")`: nothing is allocated; vitrain/callbacks/throughput.py)."""
        return create_net({**dict(self.hparams.net), "pretrained": False})

    def check_strategy(self, strategy: Strategy, fitting: bool = True) -> None:
        """Model options that the run's strategy or device cannot honour (`fitting`: in training), refused in
        one line. Called by vitrain.tasks.build before the other ranks start, and again by configure_model (every
        entry point)."""
        if self.hparams.get("float8"):
            refusal = float8_refusal(strategy.root_device)
            if refusal:
                raise ModelError(refusal)
        if self.hparams.channels_last and getattr(strategy, "fsdp_options", None) is not None:
            raise ModelError(
                "model.channels_last=true is not supported with trainer=fsdp (FSDP2 shards each parameter "
                "along its first dimension, as a contiguous tensor): leave it false"
            )
        compiled_under_fsdp = getattr(strategy, "fsdp_options", None) is not None and self.compiles(strategy)
        scope = self.hparams.get("compile_scope")
        if compiled_under_fsdp and scope == "network":
            raise ModelError(
                "model.compile_scope=network with trainer=fsdp: FSDP2's hooks sit between its groups of blocks, "
                "so the network is compiled by group there: set model.compile_scope=auto, stack or blocks"
            )
        if compiled_under_fsdp and self._cuda_graphs:
            raise ModelError(
                f"model.compile_mode={self.hparams.compile_mode} with trainer=fsdp: CUDA graphs replay kernels on "
                "fixed addresses, and FSDP2 frees and gathers the weights again at every step: use "
                "max-autotune-no-cudagraphs or null"
            )
        resamples = (
            getattr(self.net, "dynamic_img_size", False) and getattr(self.net, "pos_embed", None) is not None
        )
        if (
            fitting
            and self.resize is not None
            and resamples
            and strategy.root_device.type == "cuda"
            and torch.are_deterministic_algorithms_enabled()
            and not torch.is_deterministic_algorithms_warn_only_enabled()
        ):
            raise ModelError(
                "model.progressive_resize with trainer.deterministic=true on a GPU: a ViT resamples its position "
                "embeddings to each smaller token grid (bicubic interpolation), whose backward has no "
                "deterministic CUDA kernel: set trainer.deterministic=warn, or leave progressive_resize off"
            )

    def configure_model(self) -> None:
        # activation checkpointing, compile, sharding, in that order, as the strategy asks
        # (vitrain/distributed/parallelize.py); state-dict keys stay those of the plain model
        trainer = attached_trainer(self)
        strategy = trainer.strategy if trainer is not None else None
        if strategy is not None:
            self.check_strategy(strategy, fitting=trainer.state.fn == TrainerFn.FITTING)
        if strategy is not None and strategy.root_device.type == "cuda":
            patch_convs_as_matmuls(self.net)
        if self.hparams.get("float8") and not getattr(self.net, "_vitrain_parallelized", False):
            convert_to_float8(self.net)  # before compile and sharding, which take the converted layers
        parallelize(
            self.net,
            strategy,
            compile=self.compiles(strategy),
            resizes=self.resize is not None,
            compile_scope=self.hparams.get("compile_scope", "auto"),
            compile_mode=self.hparams.get("compile_mode"),
        )
        if self.compiles(strategy) and self._loss_and_figures is loss_and_figures:
            # the loss, its backward and the figures' sums as a few fused kernels instead of ~35 eager ops
            # (torch.compile's default mode: CUDA graphs would gain nothing on kernels this few)
            self._loss_and_figures = torch.compile(loss_and_figures)

    def compiles(self, strategy: Strategy | None) -> bool:
        """Whether the network is compiled for training under `strategy` (`model.compile`, `compile_choice`)."""
        return compile_choice(self.hparams.compile, strategy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hparams.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self._cuda_graphs:
            # a new step for CUDA graph trees: the graphs may reuse the memory of the previous step's outputs
            torch.compiler.cudagraph_mark_step_begin()
        if self.resize is not None:
            x = self.resize(x, self.training_progress())
            self.train_input_shape = tuple(x.shape[-2:])  # the size ImageThroughputMonitor counts FLOPs at
        soft = None
        if self.mixup is not None:
            # mixed images, soft targets (label smoothing folded in); accuracy against the original labels
            x, soft = self.mixup(x, y)
        loss, sums = self._loss_and_figures(
            self(x), y, self.hparams.label_smoothing, self.train_figures.top_k, soft, self.soft_loss
        )
        self.train_figures.update(sums)
        # Logged only on the steps the logger writes (the test LearningRateMonitor uses), as CPU tensors:
        # Lightning reads a logged value with .item() for the progress bar after EVERY batch until the
        # epoch ends, a GPU sync each time were it a GPU tensor; the one copy here is on log steps only.
        # A float would be turned into a tensor on the model's device (a host-to-GPU copy, another sync).
        if should_update_logs(self.trainer):
            logged = loss.detach().to("cpu")
            self.logged_train_loss = float(logged)  # for StopOnDivergence (vitrain/callbacks/divergence.py)
            self.log("train/loss_step", logged, prog_bar=True)
            # one `lr` curve (LearningRateMonitor logs one per param group: lr/decay, lr/no_decay)
            self.log("lr", torch.tensor(float(self.trainer.optimizers[0].param_groups[0]["lr"])))
            if self.resize is not None:
                self.log("train/img_size", torch.tensor(float(x.shape[-1])))
        return loss

    def training_epoch_metrics(self) -> dict[str, Metric]:
        """What training steps accumulate and the epoch's end logs: carried across a mid-epoch resume
        (vitrain/callbacks/epoch_metrics.py)."""
        return {"train_figures": self.train_figures}

    def training_progress(self) -> float:
        """The run's progress in [0, 1]: the LR schedule's own (which follows `trainer.max_time` when set,
        vitrain/models/schedules.py), else optimizer steps done / planned."""
        scheduler = self.lr_schedulers()
        progress = getattr(scheduler, "progress", None)
        if progress is not None:
            return float(progress)
        return min(self.global_step / max(self.trainer.estimated_stepping_batches, 1), 1.0)

    def on_train_epoch_end(self) -> None:
        # once per epoch: compute() sums the states over the ranks (every rank calls it), then they restart.
        # Each rank then holds the same figures; a max over equal values keeps them exact where Lightning
        # syncs what is logged at the epoch's end (a mean could round)
        figures = self.train_figures.compute()
        self.train_figures.reset()
        for name, value in figures.items():
            self.log(f"train/{name}", value, sync_dist=True, reduce_fx="max")

    def eval_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The logits that evaluation and prediction score: with `tta_flip`, the mean of each image's and its
        mirror image's. Eager: a compiled network would compile again for no-grad mode and for each
        evaluation batch size (~20-30 s each for ViT-B/32 on an H100), more than most evaluations take."""
        with torch.compiler.set_stance("force_eager"):
            logits = self(x)
            if self.hparams.tta_flip:
                logits = (logits + self(x.flip(-1))) / 2
        return logits

    def _eval_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], metrics: MetricCollection, loss: MeanMetric
    ):
        x, y = batch
        logits = self.eval_logits(x)
        # per-sample losses: their mean over the epoch weighs every image alike, and no Python weight is
        # turned into a GPU tensor each batch (a host-to-device copy: a sync)
        loss.update(F.cross_entropy(logits, y, reduction="none"))
        metrics.update(logits, y)
        if self.per_class_acc is not None:
            self.per_class_acc.update(logits, y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.val_metrics, self.val_loss)
        # metric objects are synced across ranks once, at epoch end: no collective per step, so ranks
        # with different numbers of batches cannot hang, and every sample counts exactly once.
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True)
        self.log_dict(self.val_metrics, on_step=False, on_epoch=True, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.test_metrics, self.test_loss)
        self.log("test/loss", self.test_loss, on_step=False, on_epoch=True)
        self.log_dict(self.test_metrics, on_step=False, on_epoch=True)

    def predict_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, probabilities, classes) of the `predict_top_k` most probable classes of each image, most
        probable first (src/predict.py): the top k only, so a thousand-class model's outputs stay small."""
        x, positions = batch
        probabilities = self.eval_logits(x).float().softmax(-1)
        top = probabilities.topk(min(self.predict_top_k, probabilities.shape[-1]), dim=-1)
        return positions.cpu(), top.values.cpu(), top.indices.cpu()

    def configure_optimizers(self) -> dict[str, Any]:
        options = self.hparams.optimizer
        weight_decay = options.get("weight_decay", 0.0)
        # no weight decay on norms, biases, position embeddings and tokens (timm's own grouping)
        no_decay = getattr(self.net, "no_weight_decay", set)()
        if self.hparams.layer_decay is None:
            groups = param_groups_weight_decay(self.net, weight_decay, no_weight_decay_list=no_decay)
            for group in groups:
                group["name"] = "decay" if group["weight_decay"] else "no_decay"
        else:
            groups = layer_decay_groups(self.net, weight_decay, self.hparams.layer_decay, no_decay)
            base_lr = options["lr"]
            for group in groups:
                group["lr"] = base_lr * group["lr_scale"]  # torch's schedulers scale each group's own lr
        trainer = attached_trainer(self)
        fused = fused_default(options, self.net, clipping_under_amp(trainer))
        optimizer = build_node("model.optimizer", options, params=groups, **fused)
        if trainer is not None and getattr(trainer.strategy, "fsdp_options", None) is not None:
            # the step on each rank's shards, without DTensor's dispatch (same numbers; SGD, Adam, AdamW)
            steps_on_local_shards(optimizer)
        if self.hparams.scheduler is None:
            return {"optimizer": optimizer}
        # the trainer: its max_time is the schedule's time budget (vitrain/models/schedules.py)
        scheduler = build_node(
            "model.scheduler",
            self.hparams.scheduler,
            optimizer=optimizer,
            total_steps=self.trainer.estimated_stepping_batches,
            trainer=self.trainer,
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"},
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.run_config is not None:
            checkpoint["run_config"] = self.run_config
        if self.class_names is not None:
            checkpoint["class_names"] = list(self.class_names)
        if self.normalisation is not None:
            checkpoint["normalisation"] = self.normalisation

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse, in one line, a checkpoint trained on other classes than the data now given (runs before
        the weights are loaded, which would fail on the head's shape with a long message), or on images
        normalised otherwise than this run's."""
        check_classes(checkpoint.get("class_names"), self.class_names, "ckpt_path")
        check_normalisation(checkpoint.get("normalisation"), self.normalisation)


# model.compile_scope: what `parallelize` compiles (vitrain/distributed/parallelize.py)
COMPILE_SCOPES = ("auto", "network", "blocks", "stack")
# model.compile_mode: torch.compile's modes (null: its default); those that replay CUDA graphs
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_choice(value: bool | str, strategy: Strategy | None) -> bool:
    """`model.compile`: true, false, or auto = on when training on a GPU without FSDP (1.3x the eager speed
    of the seed run on an H100, docs/benchmarks.md), off on a CPU (Inductor's C++ build is rarely won back
    there). Under FSDP `true` compiles each block; `auto` leaves it eager: the one-GPU FSDP step is bound by
    the host (the GPU busy ~20 % of it) and the compiled run has no clean measurement yet, while its compile
    took 49 s. How much is compiled (the whole network, or each block) is `parallelize`'s choice."""
    if value == "auto":
        return (
            strategy is not None
            and strategy.root_device.type == "cuda"
            and getattr(strategy, "fsdp_options", None) is None
        )
    if not isinstance(value, bool):
        raise ModelError(f"model.compile={value!r} must be true, false or auto")
    return value


def fused_default(options: Mapping[str, Any], net: nn.Module, clipping: str | None = None) -> dict[str, Any]:
    """`fused=True` for an optimizer that has a fused kernel (Adam, AdamW, SGD...) when the config does not
    say, on a GPU or a CPU: one kernel for the whole update instead of a few per parameter list (torch's own
    default is foreach; fused AdamW trains `experiment=cifar_cpu` 1.06x faster, docs/benchmarks.md "Levers").
    Sharded (FSDP2's DTensor) parameters too: torch's fused Adam(W) runs on their local shards, and a foreach
    update of DTensors costs host time per op that a one-GPU FSDP step waits on.
    Not with gradient clipping under a mixed precision (`clipping`, `clipping_under_amp`): Lightning refuses
    to clip a fused optimizer's gradients there (it takes the fused step to unscale them, bf16's too), so
    torch's default steps them; a `fused: true` in the config is refused in one line."""
    if clipping is not None and options.get("fused"):
        raise ModelError(
            f"model.optimizer.fused=true cannot be combined with {clipping}: Lightning does not clip a fused "
            "optimizer's gradients under mixed precision; drop model.optimizer.fused (the default steps without "
            "it then) or the clipping"
        )
    if "fused" in options or clipping is not None:
        return {}
    cls = hydra.utils.get_class(options["_target_"])
    if params_device_type(net) in FUSED_DEVICES and "fused" in inspect.signature(cls.__init__).parameters:
        return {"fused": True}
    return {}


def clipping_under_amp(trainer: L.Trainer | None) -> str | None:
    """`trainer.gradient_clip_val=V under trainer.precision=P` when the run clips gradients under Lightning's
    mixed-precision plugin (bf16-mixed, 16-mixed; DDP's and FSDP2's too), else None."""
    clip = getattr(trainer, "gradient_clip_val", None)
    plugin = getattr(trainer, "precision_plugin", None)
    if not clip or not isinstance(plugin, MixedPrecision):
        return None
    return f"trainer.gradient_clip_val={clip} under trainer.precision={plugin.precision}"


# where torch (>= 2.4) has the fused Adam(W)/SGD/Adagrad kernels and the template runs
FUSED_DEVICES = ("cuda", "cpu")


def params_device_type(net: nn.Module) -> str | None:
    """The one device type of all parameters, when each is a plain tensor or a DTensor (FSDP2's shards);
    None for mixed devices or other tensor subclasses, which a fused kernel may not take."""
    params = list(net.parameters())
    if not params or any(type(p.data) not in (torch.Tensor, DTensor) for p in params):
        return None
    kinds = {p.device.type for p in params}
    return kinds.pop() if len(kinds) == 1 else None


def build_node(key: str, node: Mapping[str, Any], **objects: Any) -> Any:
    """`hydra_partial(node)(**objects)`; the library's argument errors as one line naming `key.<keyword>`."""
    try:
        return hydra_partial(node)(**objects)
    except (ValueError, TypeError) as err:
        raise argument_error(key, node, err) from err


def hydra_partial(node: Mapping[str, Any]) -> Any:
    """A Hydra node as a partial, called with the objects (param groups, optimizer, trainer) only now there:
    passed to `instantiate` itself they would be copied into the config."""
    return hydra.utils.instantiate(node, _partial_=True, _convert_="all")


def check_classes(saved: list[str] | None, found: list[str] | None, what: str) -> None:
    """The classes a checkpoint was trained on must be the data's, in the same label order."""
    if saved is None or found is None or list(saved) == list(found):
        return
    if len(saved) != len(found):
        detail = f"{len(saved)} classes, the data has {len(found)}"
    else:
        i = next(i for i, (a, b) in enumerate(zip(saved, found, strict=True)) if a != b)
        detail = f"class {i} is {saved[i]!r}, the data's is {found[i]!r}"
    raise CheckpointError(
        f"{what}: the checkpoint was trained on other classes ({detail}): evaluate or resume it on the same "
        "class folders, or fine-tune from its weights with model.weights_file=... instead"
    )


def check_normalisation(saved: Mapping[str, Any] | None, now: Mapping[str, Any] | None) -> None:
    """A resumed run must normalise its images as the checkpoint's run did: its weights were trained on
    those inputs. They change with `model.net.pretrained` (the weights' mean/std, else the data set's), with
    `model.weights_file` and with `datamodule.mean/std`; e.g. an offline resume told to drop `pretrained`
    would go on from CIFAR's statistics, the inputs off by up to 2x, without a word."""
    if not saved or not now:
        return
    shown = {
        which: {k: [round(float(v), 4) for v in values[k]] for k in ("mean", "std")}
        for which, values in (("saved", saved), ("now", now))
    }
    if shown["saved"] == shown["now"]:
        return
    mean, std = shown["saved"]["mean"], shown["saved"]["std"]
    raise CheckpointError(
        f"ckpt_path: the checkpoint's images were normalised with mean {mean}, std {std}, this run's with mean "
        f"{shown['now']['mean']}, std {shown['now']['std']} (model.net.pretrained, model.weights_file or "
        "datamodule.mean/std differ from its run's): resume with its settings, or give its values: "
        f"datamodule.mean=[{','.join(map(str, mean))}] datamodule.std=[{','.join(map(str, std))}]"
    )


def make_mixup(options: Mapping[str, Any] | None, num_classes: int, label_smoothing: float) -> Mixup | None:
    """timm's Mixup/CutMix when an alpha is > 0; it mixes the batch in place on its device."""
    options = dict(options or {})
    if not (options.get("mixup_alpha", 0) > 0 or options.get("cutmix_alpha", 0) > 0):
        return None
    try:
        return Mixup(**options, label_smoothing=label_smoothing, num_classes=num_classes)
    except TypeError as err:
        raise ModelError(f"model.mixup: {err} (keywords of timm.data.Mixup)") from err


def set_grad_checkpointing(net: nn.Module, model_name: str) -> None:
    """timm's own activation checkpointing (each block's activations recomputed in backward)."""
    try:
        net.set_grad_checkpointing(True)
    except (AttributeError, NotImplementedError, AssertionError) as err:
        raise ModelError(
            f"model.grad_checkpointing=true: {model_name} does not support timm's set_grad_checkpointing"
        ) from err


def layer_decay_groups(
    net: nn.Module, weight_decay: float, layer_decay: float, no_decay: set[str]
) -> list[dict[str, Any]]:
    """timm's layer-wise LR decay groups (BEiT/MAE fine-tuning): the head keeps the full LR, each block
    below it `layer_decay` times its upper neighbour's, the stem the least."""
    groups = param_groups_layer_decay(
        net, weight_decay=weight_decay, layer_decay=layer_decay, no_weight_decay_list=no_decay
    )
    for group in groups:
        group["name"] = f"scale{group['lr_scale']:.3g}_{'decay' if group['weight_decay'] else 'no_decay'}"
    return groups
