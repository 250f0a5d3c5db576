"""A run's log book, built from its run dir alone: `report.md`, `report.json`, `plots/*.png`, and a sweep's
`summary.md` / `summary.csv`.

One module per role, each importing only those listed before it:

- `files`: the names of the files in a run dir, and reading / writing them (TensorBoard events, JSON, .hydra/)
- `measuring`: peak memory (/proc probes, CUDA counters), the GPU-utilisation sampler, metrics as floats
- `run_stats`: the `RunStats` callback: what the report cannot re-read later -> `run_stats.json`
- `plots`, `markdown`: the curves and the text of report.md
- `report`: the report as one dict, and writing report.json / report.md / plots
- `sweep`: the summary of a sweep, and the `SweepSummary` Hydra callback
- `__main__`: `python -m vitrain.reporting RUN_OR_SWEEP_DIR...` rebuilds reports from the files alone

`files`, `plots`, `markdown`, `report`, `sweep` and `__main__` import neither torch nor Lightning.
"""
