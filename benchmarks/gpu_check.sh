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
#   bash benchmarks/gpu_check.sh --dry-run  # on CPU: interpreter, tiny shapes, untimed, the
#                                           # three steps side by side (make test runs it)
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

# step NAME LIMIT CMD...: CMD under `timeout LIMIT`, its output in $LOG/NAME.log, its exit
# status in $LOG/NAME.status; status_of NAME reads it back (1 where the step left none).
step() {
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
  echo $? > "$LOG/$name.status"
}
status_of() { cat "$LOG/$1.status" 2> /dev/null || echo 1; }
run_tests() { step tests 200 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}"; }
run_bench() { step bench 120 "$PY" -m loraplex.benchmarks.kernels "${BENCH[@]}"; }
run_invariance() { step invariance 150 "$PY" -m loraplex.benchmarks.invariance_cost "${BENCH[@]}"; }

rm -f "$LOG/tests.status" "$LOG/bench.status" "$LOG/invariance.status"
if (( DRY )); then
  # Untimed (the interpreter on CPU): the three steps side by side, one torch thread each
  # (three processes on 2 cores); the same logs, statuses and verdict as one after another.
  export OMP_NUM_THREADS=1
  run_tests & tests_pid=$!
  run_bench & bench_pid=$!
  run_invariance & invariance_pid=$!
  wait "$tests_pid" "$bench_pid" "$invariance_pid"
else  # one after another: bench and invariance time the kernels
  run_tests
  run_bench
  run_invariance
fi
tests_status=$(status_of tests)
tail -3 "$LOG/tests.log"

bench_status=$(status_of bench)
cat "$LOG/bench.log"
verdict=$(tail -1 "$LOG/bench.log")

invariance_status=$(status_of invariance)
cat "$LOG/invariance.log"
invariance=$(tail -1 "$LOG/invariance.log")

(( tests_status == 0 )) || fail "kernel tests exit $tests_status (see $LOG/tests.log); bench: $verdict"
(( bench_status == 0 )) || fail "bench exit $bench_status: $verdict"
(( invariance_status == 0 )) || fail "batch-invariant mode exit $invariance_status: $invariance"
echo "gpu_check: $verdict | batch-invariant mode: $invariance"
