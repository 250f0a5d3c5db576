"""The run directory's name, identical on every process and node of one run.

Hydra resolves `hydra.run.dir` separately in every process it starts in; a plain `${now:...}` differs
between nodes (and between restarts), which splits one run into several directories.
"""

import os
from datetime import datetime

from omegaconf import OmegaConf

# first set wins: an explicit name, then the launcher's id for this job
RUN_ID_VARS = ("VITRAIN_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


def run_id() -> str:
    for var in RUN_ID_VARS:
        value = os.environ.get(var, "")
        if value and value != "none":
            return value
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("run_id"):
        # cached per process so the run dir and the sweep dir agree
        OmegaConf.register_new_resolver("run_id", run_id, use_cache=True)
