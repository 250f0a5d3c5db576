"""Lightning's DDPStrategy with gradient compression as one config option.

`gradient_compression` picks one of PyTorch's DDP communication hooks:
- `fp16` / `bf16`: gradients travel in half precision (half the bytes) and are averaged in fp32 again;
- `powersgd`: low-rank (rank `powersgd_rank`) approximation with error feedback, after
  `powersgd_start_iter` plain all-reduce steps: far fewer bytes, some compute, a little accuracy risk.
They pay off when the all-reduce waits on the network (several nodes over Ethernet), not on NVLink/one node.
See docs/distributed.md.
"""

from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

COMPRESSION_HOOKS: dict[str, Callable[..., Any]] = {
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
    "powersgd": powerSGD_hook.powerSGD_hook,
}


def compression_hook(
    name: str | None, powersgd_rank: int = 1, powersgd_start_iter: int = 1000
) -> tuple[Callable[..., Any] | None, object | None]:
    """(hook, state) for DDPStrategy's `ddp_comm_hook` / `ddp_comm_state`."""
    if name is None:
        return None, None
    if name not in COMPRESSION_HOOKS:
        raise ValueError(
            f"trainer.strategy.gradient_compression={name}: use null or one of {', '.join(COMPRESSION_HOOKS)}"
        )
    if name == "powersgd":
        # start_powerSGD_iter: uncompressed steps first, while gradients change fast (PowerSGD paper, sec. 5)
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=max(int(powersgd_start_iter), 2),
        )
        return COMPRESSION_HOOKS[name], state
    return COMPRESSION_HOOKS[name], None


class DDPStrategy(LightningDDPStrategy):
    """`DDPStrategy(gradient_compression=None | "fp16" | "bf16" | "powersgd", **lightning_ddp_kwargs)`.

    Lightning registers DDP communication hooks on CUDA only; PyTorch's hooks also run on gloo, so they are
    registered on every device here (and the CPU tests exercise them).
    """

    def __init__(
        self,
        gradient_compression: str | None = None,
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 1000,
        **kwargs: Any,
    ) -> None:
        hook, state = compression_hook(gradient_compression, powersgd_rank, powersgd_start_iter)
        if hook is not None and kwargs.get("ddp_comm_hook") is not None:
            raise ValueError("set either trainer.strategy.gradient_compression or ddp_comm_hook, not both")
        if hook is not None:
            kwargs.update(ddp_comm_hook=hook, ddp_comm_state=state)
        super().__init__(**kwargs)
        self.gradient_compression = gradient_compression
        self.comm_hook = kwargs.get("ddp_comm_hook")
        self.comm_state = kwargs.get("ddp_comm_state")
        self.comm_wrapper = kwargs.get("ddp_comm_wrapper")

    def configure_ddp(self) -> None:
        super().configure_ddp()  # wraps the model; registers the hook on CUDA
        if self.root_device.type != "cuda":
            self.register_comm_hook()

    def register_comm_hook(self) -> None:
        """Register the configured hook (wrapped in `ddp_comm_wrapper` if set) on the DDP model, as Lightning
        does on CUDA."""
        if self.comm_hook is None:
            return
        assert isinstance(self.model, DistributedDataParallel)
        hook = self.comm_hook if self.comm_wrapper is None else self.comm_wrapper(self.comm_hook)
        self.model.register_comm_hook(state=self.comm_state, hook=hook)
