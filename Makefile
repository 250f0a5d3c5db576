# Shortcuts; every target runs inside the project's virtual environment (.venv).
PY ?= .venv/bin/python
RUN ?=

.PHONY: install test test-fast lint format train train-smoke eval predict export report clean bench bench-gpu bench-smoke bench-recipes gpu-check shards

install:  ## create .venv and install everything (the README's first command)
	python3 -m venv .venv && .venv/bin/pip install uv==0.13.9 && .venv/bin/uv pip install --python .venv/bin/python -r requirements.txt

test:  ## the whole suite, as CI runs it
	$(PY) -m pytest

test-fast:  ## skip the slow end-to-end and distributed tests
	$(PY) -m pytest -m "not slow and not distributed"

lint:
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

format:
	$(PY) -m ruff format src tests bench
	$(PY) -m ruff check --fix src tests bench

train:  ## the main job: fine-tune ViT-B/32 on CIFAR-10
	$(PY) src/train.py experiment=cifar

train-smoke:  ## a tiny run through the whole pipeline
	$(PY) src/train.py experiment=smoke

eval:  ## make eval CKPT=path/to/checkpoint.ckpt
	@test -n "$(CKPT)" || { echo "error: make eval CKPT=logs/train/runs/<run>/checkpoints/last.ckpt (or an FSDP checkpoint folder, or s3://bucket/key)" >&2; exit 2; }
	$(PY) src/eval.py ckpt_path=$(CKPT)

predict:  ## make predict CKPT=path/to/checkpoint.ckpt IMAGES=<folder or image file>: predictions.csv in logs/predict/runs/<id>/
	@test -n "$(CKPT)" -a -n "$(IMAGES)" || { echo "error: make predict CKPT=logs/train/runs/<run>/checkpoints/last.ckpt IMAGES=<folder of images or an image file>" >&2; exit 2; }
	$(PY) src/predict.py ckpt_path=$(CKPT) inputs=$(IMAGES)

export:  ## make export CKPT=path/to/checkpoint.ckpt [OUT=folder]: a timm model folder (timm.create_model("local-dir:<folder>"))
	@test -n "$(CKPT)" || { echo "error: make export CKPT=logs/train/runs/<run>/checkpoints/last.ckpt [OUT=<new folder>]" >&2; exit 2; }
	$(PY) src/export.py ckpt_path=$(CKPT) $(if $(OUT),output=$(OUT))

report:  ## make report RUN=logs/train/runs/<id> (or a multiruns/<id> sweep dir): rebuild report.md/json, plots
	@test -n "$(RUN)" || { echo "error: make report RUN=logs/train/runs/<run> (or a logs/train/multiruns/<id> sweep dir)" >&2; exit 2; }
	PYTHONPATH=src $(PY) -m vitrain.reporting $(RUN)

shards:  ## make shards SRC=<image folder or .tar(.gz)> DST=<folder or s3://bucket/prefix> [SHARDS_ARGS="--val-size 0.05"]
	@test -n "$(SRC)" -a -n "$(DST)" || { echo "error: make shards SRC=<image folder or .tar(.gz)> DST=<folder or s3://bucket/prefix>" >&2; exit 2; }
	PYTHONPATH=src $(PY) -m vitrain.data.shards $(SRC) $(DST) $(SHARDS_ARGS)

bench:  ## the benchmark suite (~20 min on 2 CPU cores): bench/results/*.json -> docs/benchmarks.md
	$(PY) bench/run.py $(BENCH_ARGS)

bench-gpu:  ## on a CUDA machine: every GPU path next to a hand-written loop (~15 min on one H100; BENCH_ARGS="-- --quick" ~8 min) -> docs/benchmarks.md section 7
	$(PY) bench/run.py --only gpu $(BENCH_ARGS)

bench-smoke:  ## every benchmark in seconds-sized mode, results in /tmp (checks the scripts, measures nothing)
	$(PY) bench/run.py --smoke --out /tmp/vitrain-bench-smoke $(BENCH_ARGS)

bench-recipes:  ## recipe ablation on experiment=cifar_cpu (~11 min a row; ROWS=-conv_stem,recipe for a subset) -> docs/recipes.md
	$(PY) bench/recipes.py $(if $(ROWS),--only=$(ROWS))

gpu-check:  ## every GPU path on this machine's GPUs in a few minutes, PASS/FAIL table + logs/gpu-check/<time>/gpu_check.json (docs/gpu.md)
	$(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf logs/train logs/eval logs/predict logs/export .pytest_cache .ruff_cache
