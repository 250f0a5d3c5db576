"""One 2-process job that trains several timm families in a row: `torchrun --nproc-per-node=2 families_job.py
STRATEGY DATA CACHE OUT [EXTRA_OVERRIDE ...]`. One launch (and one process group) for all families keeps the
test cheap; every rank writes `<OUT>/<family>.rank<R>.json` with what the test checks. An override written
`<family>:<override>` applies to that family only."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
from torch.distributed.fsdp import FSDPModule

from helpers import TINY_VIT, compose_cfg
from vitrain.tasks.training import train

# every family with nothing but a small input: the model config has no family-specific keyword
FAMILIES = {
    "vit": [*TINY_VIT],
    "resnet18": ["model.net.model_name=resnet18", "datamodule.img_size=32"],
    "convnext_atto": ["model.net.model_name=convnext_atto", "datamodule.img_size=32"],
}


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: a collective, same order on all ranks


def for_family(family: str, extra: tuple[str, ...]) -> list[str]:
    """The overrides for all families, and this family's own with their `<family>:` prefix taken off."""
    picked = []
    for override in extra:
        target, _, own = override.partition(":")
        if target not in FAMILIES:
            picked.append(override)
        elif target == family:
            picked.append(own)
    return picked


def main(strategy: str, data: str, cache: str, out: str, *extra: str) -> None:
    out_dir = Path(out)
    for family, model in FAMILIES.items():
        overrides = [
            *model,
            f"trainer={strategy}",
            "trainer.devices=2",
            # not `auto`: each torchrun worker would measure the CPU's bf16 speed on its own (FSDP's bf16 is the
            # strategy's mixed_precision, which a family's override sets)
            "trainer.precision=32-true",
            "trainer.max_epochs=1",
            "+trainer.limit_train_batches=2",
            "trainer.log_every_n_steps=1",
            f"datamodule.data_dir={data}",
            f"datamodule.cache_dir={cache}",
            "datamodule.batch_size=8",
            "datamodule.val_size=16",
            "logger=none",
            "extras.print_config=false",
            "test=false",
            *for_family(family, extra),
        ]
        cfg = compose_cfg("train", overrides, out_dir / family)
        _, objects = train(cfg)
        trainer, net = objects.trainer, objects.model.net
        rank = trainer.global_rank
        result = {
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "sharded_units": sum(isinstance(m, FSDPModule) for m in net.modules()),
            "dtensor_params": sum(type(p).__name__ == "DTensor" for p in net.parameters()),
            # the optimizer steps on the local shards (vitrain/distributed/local_step.py)
            "local_step": bool(getattr(trainer.optimizers[0], "_vitrain_local_step", False)),
            "finite": all(bool(torch.isfinite(_full(p)).all()) for p in net.parameters()),
            "best": objects.best_model_path,
        }
        (out_dir / f"{family}.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
