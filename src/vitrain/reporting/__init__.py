"""A run's log book, built from its run dir alone: `report.md`, `report.json`, `plots/*.png`, and a sweep's
`summary.md` / `summary.csv`.

A pure reader of a run directory: what a run writes (run_stats.json by vitrain/callbacks/run_stats.py,
metrics.jsonl by vitrain/loggers.py, batch_size_search.json by vitrain/tasks/tuning.py) is named, read and
written through vitrain/utils/run_files.py. One module per role, each importing only those listed before it:

- `plots`, `markdown`: the curves and the text of report.md
- `report`: the report as one dict, and writing report.json / report.md / plots
- `sweep`: the summary of a sweep, and the `SweepSummary` Hydra callback
- `__main__`: `python -m vitrain.reporting RUN_OR_SWEEP_DIR...` rebuilds reports from the files alone

`plots`, `markdown`, `report`, `sweep` and `__main__` import neither torch nor Lightning.
"""
