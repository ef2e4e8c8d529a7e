#!/usr/bin/env bash
# The GPU measurements of docs/gpu.md, in one run, into one folder.
#
#   scripts/gpu_report.sh OUTDIR [SECONDS]
#
# On a machine with CuPy, a CUDA GPU and torch with CUDA, and npattn's
# dependencies installed (or importable from PYTHONPATH); nothing is installed.
# Writes into OUTDIR: the GPU-marked tests' log, CuPy-vs-NumPy parity (float32
# on the four benchmark shapes; float64 over every implementation and option
# case up to L = 1024, and at 1x4096x512x8) as text and JSON, and
# `npattn bench --backend cupy` against torch CUDA in float32 and float16,
# dense and blocked, and the blocked attention core with blocks of 512 and
# 2048. Each step has its own time limit, and the tests get what is left of
# SECONDS (default 500), so a short lease still returns the rest. Always
# exits 0 once it has started: read the logs.
set -u
if [ $# -lt 1 ]; then sed -n '2,15p' "$0"; exit 2; fi
cd "$(dirname "$0")/.."
OUTDIR=$1
LIMIT=${2:-500}
mkdir -p "$OUTDIR"
START=$SECONDS
step() { printf '\n=== [%ss] %s\n' "$((SECONDS - START))" "$*"; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" CUPY_TF32=0 CI=1 NPATTN_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SHAPES=8x512x768x12,4x1024x768x12c,1x4096x512x8,1x16384x512x8,8x512x768x12d0.1
{
step "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" -c 'import sys, numpy, cupy, torch
print(sys.version.split()[0], "numpy", numpy.__version__, "cupy", cupy.__version__,
      "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
step "parity float32, the four benchmark shapes, against float64"
timeout 90 "$PY" scripts/gpu_parity.py --dtype float32 --reference --json "$OUTDIR/parity32.json"
step "parity float64, every impl and option case, L <= 1024"
timeout 150 "$PY" scripts/gpu_parity.py --dtype float64 --max-len 1024 --impl reference,dense,blocked,auto \
  --cases all --json "$OUTDIR/parity64.json" > "$OUTDIR/parity64.txt" 2>&1
grep -E "FAIL|refused|parity:" "$OUTDIR/parity64.txt" | tail -20
step "parity float64, 1x4096x512x8"
timeout 90 "$PY" scripts/gpu_parity.py --dtype float64 --min-len 4096 --impl dense,blocked,auto \
  --cases plain,bool_mask,gqa,dropout --json "$OUTDIR/parity64_long.json"
for dt in float32 float16; do
  step "bench $dt against torch CUDA"
  timeout 150 "$PY" -m npattn bench --backend cupy --dtype "$dt" --no-progress --repeat 5 --pause 0 \
    --min-sample 0.1 --shapes "$SHAPES" --json "$OUTDIR/bench_$dt.json"
done
step "bench blocked float32"
timeout 90 "$PY" -m npattn bench --backend cupy --impl blocked --no-progress --repeat 5 --pause 0 \
  --min-sample 0.1 --shapes 1x4096x512x8 --json "$OUTDIR/bench_blocked.json"
for b in 512 2048; do
  step "blocked attention core, blocks of $b x $b (isolated; for the GPU's default blocks)"
  timeout 60 "$PY" -m npattn bench --isolated --backend cupy --impl blocked --scope attention \
    --repeat 3 --warmup 1 --gemm 0 --block-q "$b" --block-k "$b" --shapes 1x4096x512x8,1x16384x512x8 \
    --json "$OUTDIR/blocked_core_$b.json"
done
T=$(( LIMIT - (SECONDS - START) - 10 )); [ "$T" -lt 30 ] && T=30
step "GPU-marked tests (pytest -m gpu, at most ${T}s)"
XDIST=$("$PY" -c 'import xdist' 2>/dev/null && echo "-n 8")
timeout "$T" "$PY" -m pytest -q -rfEs -m gpu ${XDIST:-} -p no:cacheprovider tests > "$OUTDIR/pytest_gpu.log" 2>&1
echo "pytest exit status $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUTDIR/pytest_gpu.log" | tail -40
step "done"
} 2>&1 | tee "$OUTDIR/run.log"
exit 0
