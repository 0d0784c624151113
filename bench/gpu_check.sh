#!/usr/bin/env bash
# GPU check for the kernels: compiled Triton kernel tests, then bench/kernels.py.
# For the GPU machine (torch + triton preinstalled, no package registry); < 5 minutes.
# Logs go to $OUT (or /tmp/loraplex-gpu-check). Usage: bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-/tmp/loraplex-gpu-check}"
mkdir -p "$LOG"
PY="${PYTHON:-python}"

{ nvidia-smi; "$PY" -c 'import torch, triton; print(torch.__version__, triton.__version__)'; } \
  > "$LOG/env.txt" 2>&1
cat "$LOG/env.txt"

# No registry: no deps and no isolated build env (it would fetch setuptools).
if ! "$PY" -m pip install --no-deps --no-build-isolation -e . > "$LOG/install.log" 2>&1; then
  echo "pip install failed (see install.log); importing through a symlink instead"
  mkdir -p /tmp/loraplex-path && ln -sfn "$PWD" /tmp/loraplex-path/loraplex
  export PYTHONPATH="/tmp/loraplex-path${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c 'import loraplex.kernels.triton.sgmv' || { echo "cannot import loraplex"; exit 1; }

# Compiled kernels, not the interpreter (conftest only sets TRITON_INTERPRET by default).
export TRITON_INTERPRET=0 LORAPLEX_KERNELS=triton
status=0
if "$PY" -c 'import pytest' 2>/dev/null; then
  timeout 150 "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_kernels_sgmv.py tests/test_kernels_attention.py 2>&1 | tee "$LOG/tests.log"
  status=${PIPESTATUS[0]}
else
  echo "pytest is not installed here: kernel tests skipped" | tee "$LOG/tests.log"
fi

timeout 120 "$PY" -m loraplex.bench.kernels 2>&1 | tee "$LOG/bench.log"
bench_status=${PIPESTATUS[0]}
echo "tests exit $status, bench exit $bench_status; logs in $LOG"
exit $(( status != 0 || bench_status != 0 ))
