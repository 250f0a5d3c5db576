"""Learning-rate schedules, built from torch's own schedulers so checkpoints restore them."""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR


def warmup_cosine(
    optimizer: Optimizer, total_steps: int, warmup_fraction: float = 0.05, min_lr_ratio: float = 0.01
) -> LRScheduler:
    """Linear warm-up over `warmup_fraction` of the steps, then cosine decay to `min_lr_ratio` x lr."""
    total_steps = max(int(total_steps), 1)
    warmup = min(max(math.ceil(total_steps * warmup_fraction), 1), total_steps)
    base_lr = optimizer.param_groups[0]["lr"]
    decay = CosineAnnealingLR(optimizer, T_max=max(total_steps - warmup, 1), eta_min=base_lr * min_lr_ratio)
    if warmup_fraction <= 0:
        return decay
    ramp = LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup)
    return SequentialLR(optimizer, [ramp, decay], milestones=[warmup])
