"""Rebuild reports from run dirs alone (no torch needed):

python -m vitrain.reporting logs/train/runs/<run id>          # or: make report RUN=<dir>
python -m vitrain.reporting logs/train/multiruns/<sweep id>   # every job's report, then the sweep summary
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vitrain.reporting.report import write_report
from vitrain.reporting.sweep import job_dirs, write_summary
from vitrain.utils.run_files import REPORT_MD, STATS_FILE, has_metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vitrain.reporting", description="Rebuild report.md/json and plots from run dirs."
    )
    parser.add_argument("dirs", nargs="+", type=Path, help="run dirs, or sweep dirs (with multirun.yaml)")
    args = parser.parse_args(argv)
    for directory in args.dirs:
        if not directory.is_dir():
            print(f"error: {directory} is not a directory", file=sys.stderr)
            return 2
        if (directory / "multirun.yaml").is_file():
            for job in job_dirs(directory):
                if (job / STATS_FILE).is_file() or has_metrics(job):
                    write_report(job)
            paths = write_summary(directory)
            print("\n".join(str(p) for p in paths))
        else:
            write_report(directory)
            print(directory / REPORT_MD)
    return 0


if __name__ == "__main__":
    sys.exit(main())
