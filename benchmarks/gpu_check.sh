#!/usr/bin/env bash
# GPU check of the Triton backend, one verdict: the kernel tests compiled for the GPU, then
# benchmarks/kernels.py (every benchmarked shape checked against its torch twin, then timed
# against the HBM roofline; FAIL on a mismatch, a NaN or a register spill). The W4A16 int4
# linear (tests/test_kernels_w4a16.py; Llama-3-8B's layers in groups of 128) is also timed
# against a dense F.linear in bf16 on the same weight, before and after it. Then
# benchmarks/invariance_cost.py (the batch-invariant mode: each op it changes timed against
# its default form, and checked bit for bit on the device; FAIL when a row is not invariant).
# For the GPU machine (torch + triton preinstalled, no package registry); < 5 minutes.
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run  # on CPU: interpreter, tiny shapes (make test runs it)
#
# Logs go to $OUT (or /tmp/loraplex-gpu-check). The last line is the verdict:
# "gpu_check: PASS | ..." or "gpu_check: FAIL | ..."; the exit status is 0 only on PASS.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-/tmp/loraplex-gpu-check}"
mkdir -p "$LOG"
PY="${PYTHON:-python}"
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1

fail() { echo "gpu_check: FAIL | $*"; exit 1; }

if (( DRY )); then
  export TRITON_INTERPRET=1
  TESTS=(tests/test_kernels_sgmv.py::test_work_list_holds_exactly_the_row_blocks_of_adapted_segments
         tests/test_kernels_w4a16.py::test_leading_dims_and_strided_x)
  BENCH=(--dry-run)
else
  { nvidia-smi; "$PY" -c 'import torch, triton; print(torch.__version__, triton.__version__)'; } \
    > "$LOG/env.txt" 2>&1
  cat "$LOG/env.txt"
  export TRITON_INTERPRET=0
  TESTS=(tests/test_kernels_sgmv.py tests/test_kernels_attention.py tests/test_kernels_w4a16.py
         tests/test_triton_batch_invariance.py -k "not engine")
  BENCH=()
  # No registry: no deps and no isolated build env (it would fetch setuptools).
  if ! "$PY" -m pip install --no-deps --no-build-isolation -e . > "$LOG/install.log" 2>&1; then
    echo "pip install failed (see install.log); importing through a symlink instead"
    mkdir -p /tmp/loraplex-path && ln -sfn "$PWD" /tmp/loraplex-path/loraplex
    export PYTHONPATH="/tmp/loraplex-path${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export LORAPLEX_KERNELS=triton

"$PY" -c 'import loraplex.kernel_backends.triton.sgmv' > "$LOG/import.log" 2>&1 \
  || fail "cannot import loraplex.kernel_backends.triton (see $LOG/import.log)"
"$PY" -c 'import pytest' 2> /dev/null || fail "pytest is not installed: the kernel tests cannot run"

timeout 200 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" > "$LOG/tests.log" 2>&1
tests_status=$?
tail -3 "$LOG/tests.log"

timeout 120 "$PY" -m loraplex.benchmarks.kernels "${BENCH[@]}" > "$LOG/bench.log" 2>&1
bench_status=$?
cat "$LOG/bench.log"
verdict=$(tail -1 "$LOG/bench.log")

timeout 150 "$PY" -m loraplex.benchmarks.invariance_cost "${BENCH[@]}" > "$LOG/invariance.log" 2>&1
invariance_status=$?
cat "$LOG/invariance.log"
invariance=$(tail -1 "$LOG/invariance.log")

(( tests_status == 0 )) || fail "kernel tests exit $tests_status (see $LOG/tests.log); bench: $verdict"
(( bench_status == 0 )) || fail "bench exit $bench_status: $verdict"
(( invariance_status == 0 )) || fail "batch-invariant mode exit $invariance_status: $invariance"
echo "gpu_check: $verdict | batch-invariant mode: $invariance"
