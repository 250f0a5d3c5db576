#!/usr/bin/env bash
# One prepared GPU benchmark call on a machine reached by copying the checkout over, with no network there
# (this project's lent GPU machines; docs/gpu.md, "A lease"): `bench/gpu.py --plan PLAN` with the wheels the
# machine's image lacks, the real CIFAR-10 archive and the last call's compile cache; what it measured comes
# back in at most 8 files under $OUT.
#
#   bash bench/lease.sh prepare          # here, once a session: .whl/ and .gpu/ (both git-ignored)
#   run(command="CHECKS=augment_ahead bash bench/lease.sh table", carry=[".whl", ".gpu"], timeout_s=590)
#   run(command="LIMIT=280 bash bench/lease.sh levers --only hand,seed_levers --hand-variants compiled_patchmm@1024",
#       carry=[".whl", ".gpu"], timeout_s=290)      # what is left of a 15-minute lease, on the warm machine
#
# PLAN: one of bench/gpu.py's PLANS; further arguments go to bench/gpu.py (a flag given wins over the plan's).
# LIMIT: the seconds this call has (default 590, the timeout_s to give it): the sections end in time to pack.
# CHECKS: `make gpu-check` checks that run no training (data_on_device, decode_ahead, augment_ahead), after the
# benchmark, with CHECK_SECONDS (90) kept for them. Scratch (photos, shards, compile cache) stays in /tmp/gw while the
# machine is warm, so a second call of the same lease starts warm.
set -euo pipefail
cd "$(dirname "$0")/.."
plan=${1:?usage: bash bench/lease.sh prepare | PLAN [bench/gpu.py arguments]}
shift

if [ "$plan" = prepare ]; then
    for dir in /.whl/ /.gpu/; do grep -qxF "$dir" .git/info/exclude 2>/dev/null || echo "$dir" >>.git/info/exclude; done
    bash ../shared/device/prepare-wheels.sh >/dev/null # into .whl/
    # torchao: float8 (model.float8, the levers plan) is not in the image either
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d .whl "$(grep -m1 '^torchao==' requirements.txt)"
    ls .whl/hydra_core-*.whl .whl/torchao-*.whl >/dev/null
    mkdir -p .gpu && cp -u ../shared/data/cifar10-jpeg.tar.gz .gpu/
    du -sh .whl .gpu
    exit 0
fi

limit=${LIMIT:-590}
end=$(($(date +%s) + limit - 45)) # 45 s to pack and return
reserve=0
if [ -n "${CHECKS:-}" ]; then reserve=${CHECK_SECONDS:-90}; fi
export VITRAIN_BENCH_DEADLINE=$((end - reserve)) PYTHONUNBUFFERED=1
out=${OUT:-/tmp/lease-out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# seconds left until $1 (at least 1: `timeout 0` would mean no limit at all)
left() { local s=$(($1 - $(date +%s))); echo $((s > 0 ? s : 1)); }
status=0
# gpu.py ends its sections by VITRAIN_BENCH_DEADLINE; the timeout only guards against a hang after it
timeout "$(left $((VITRAIN_BENCH_DEADLINE + 30)))" python3 bench/gpu.py --plan "$plan" --out "$out" \
    --work /tmp/gw --data-dir .gpu/cifar10-jpeg.tar.gz --compile-cache .gpu/compile_cache.tar.gz "$@" || status=$?
if [ -n "${CHECKS:-}" ]; then
    # the checks a lease runs load data and run no training: 100 generated images a class are plenty
    timeout "$(left "$end")" python3 bench/gpu_check.py --only "$CHECKS" --per-class 100 \
        --out /tmp/gw/gpu-check >"$out/gpu_check.log" 2>&1 || status=$?
    cp /tmp/gw/gpu-check/gpu_check.json "$out/" 2>/dev/null || true
fi
# every run's log in one file; a compile cache too large to come back (16 MB) is left out
if [ -d "$out/logs" ]; then tar czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$out/logs"; fi
cache="$out/compile_cache.tar.gz"
if [ -f "$cache" ] && [ "$(stat -c %s "$cache")" -gt 16000000 ]; then rm "$cache"; fi
ls -l "$out"
exit "$status"
