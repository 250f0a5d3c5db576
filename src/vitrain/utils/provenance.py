"""What produced a run's numbers: the code's git commit and the libraries' versions, for its report.

A figure from last month's run is only comparable to today's when both say which code and which torch,
Lightning and timm made them; W&B records the commit for its own runs, TensorBoard, CSV and the report did
not.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

import vitrain


def code_version(path: str | Path = Path(vitrain.__file__)) -> dict[str, Any] | None:
    """{"commit": the checkout's HEAD, "dirty": whether tracked files differ from it} for the git checkout
    that holds `path` (vitrain's own code by default) as a tracked file; None where it is not one (an
    installed package, a copy without .git) or git is missing. Untracked files do not count: logs/ and data
    live beside the code."""
    path = Path(path).resolve()

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(path.parent), *args], capture_output=True, text=True, timeout=30, check=True
        )
        return done.stdout.strip()

    try:
        git("ls-files", "--error-unmatch", path.name)  # tracked, not a package under an ignored .venv
        return {
            "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        }
    except (OSError, subprocess.SubprocessError):
        return None


def software_versions() -> dict[str, str | None]:
    """Python, torch, Lightning and timm, and CUDA where torch uses a GPU."""
    import lightning
    import timm
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "timm": timm.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
    }
