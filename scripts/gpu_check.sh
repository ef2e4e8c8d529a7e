#!/usr/bin/env bash
# One-command GPU check for npattn, on a machine with a CUDA GPU.
#
#   scripts/gpu_check.sh            # venv in .venv-gpu, install .[test,cupy], run everything
#   scripts/gpu_check.sh --dry-run  # no GPU: current python, no install, numpy-vs-numpy parity
#   scripts/gpu_check.sh --no-install --gpu-only
#                                   # current python, its packages as they are (a machine
#                                   # with CuPy and no network), the GPU steps alone
#
# Steps:
#   1. create (or reuse) a virtual environment and `pip install -e ".[test,cupy]"`;
#   2. with NPATTN_REQUIRE_GPU=1 (a skipped cupy test is a failure), run the
#      GPU-marked tests (`pytest -m gpu`: every test parametrized on cupy, the
#      docs' code blocks that need CuPy, and tests/test_gpu.py's marked ones),
#      then the rest of the suite (the backend suite on numpy, array-api-strict
#      and torch when installed);
#   3. check CuPy-vs-NumPy parity of forward and backward on the benchmark
#      shapes in float32, then in float64 for every implementation and option
#      case on the shapes up to L = 1024 (scripts/gpu_parity.py).
# Exits non-zero on the first failure, including "no GPU tests ran".
#
# Environment:
#   NPATTN_VENV=DIR       virtual environment to create/use (default .venv-gpu)
#   PYTHON=python3        interpreter that creates the venv
#   CUPY_PACKAGE=...      install this CuPy wheel instead of the cupy extra
#                         (e.g. cupy-cuda11x, or cupy-cuda13x on CUDA 13)
#   NPATTN_WITH_TORCH=1   also install torch==2.13.0 (CPU build) for the torch backend tests
#   PIP_ARGS=...          extra pip arguments (e.g. --no-index --find-links wheels/)
#   PYTEST_ARGS=...       extra pytest arguments (e.g. -n 8 with pytest-xdist)
set -euo pipefail

cd "$(dirname "$0")/.."
DRY_RUN=0
INSTALL=1
GPU_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --no-install) INSTALL=0 ;;
    --gpu-only) GPU_ONLY=1 ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done

step() { printf '\n=== %s\n' "$*"; }

if [ "$DRY_RUN" = 1 ]; then
  PY="${PYTHON:-python3}"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  step "dry run with $PY: no install, no GPU"
  step "GPU-marked tests that would run"
  "$PY" -m pytest -q -m gpu --collect-only tests | tail -n 1
  step "parity script, numpy vs numpy (first three benchmark shapes)"
  "$PY" scripts/gpu_parity.py --backend numpy --max-len 1024
  step "dry run ok"
  exit 0
fi

if [ "$INSTALL" = 1 ]; then
  VENV="${NPATTN_VENV:-.venv-gpu}"
  step "virtual environment $VENV"
  if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
  PY="$VENV/bin/python"
  "$PY" -m pip install ${PIP_ARGS:-} -q --upgrade pip
  if [ "${NPATTN_WITH_TORCH:-0}" = 1 ]; then
    "$PY" -m pip install ${PIP_ARGS:-} -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
  fi
  if [ -n "${CUPY_PACKAGE:-}" ]; then
    "$PY" -m pip install ${PIP_ARGS:-} -q -e ".[test]" "$CUPY_PACKAGE"
  else
    "$PY" -m pip install ${PIP_ARGS:-} -q -e ".[test,cupy]"
  fi
else
  PY="${PYTHON:-python3}"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  step "no install: $PY as it is, npattn from $PWD"
fi

step "GPU"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" - <<'PYEOF'
import cupy
n = cupy.cuda.runtime.getDeviceCount()
assert n > 0, "no CUDA device visible to CuPy"
x = cupy.arange(10.0)
assert float((x * 2).sum()) == 90.0
print(f"cupy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, {n} device(s)")
PYEOF

export NPATTN_REQUIRE_GPU=1   # tests/conftest.py: a skipped cupy backend is a failure
export CUPY_TF32=0            # float32 matmuls in full float32, as on the CPU
export CI=1                   # the bounded 'ci' hypothesis profile

step "GPU-marked tests (pytest -m gpu)"
# pytest exits 5 when nothing was selected: that fails this script too
"$PY" -m pytest -q -rs ${PYTEST_ARGS:-} -m gpu tests

if [ "$GPU_ONLY" = 0 ]; then
  step "rest of the suite, every backend"
  "$PY" -m pytest -q -rs ${PYTEST_ARGS:-} -m "not gpu" tests
fi

step "CuPy-vs-NumPy parity on the benchmark shapes, float32 forward + backward"
"$PY" scripts/gpu_parity.py --backend cupy --dtype float32 --reference

step "CuPy-vs-NumPy parity in float64: every implementation and option case, L <= 1024"
"$PY" scripts/gpu_parity.py --backend cupy --dtype float64 --max-len 1024 \
  --impl reference,dense,blocked,auto --cases all

step "gpu check ok"
