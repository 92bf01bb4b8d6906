#!/usr/bin/env bash
# The GPU check: one command for a lent or rented CUDA machine, under 9 minutes on an H200, with
# the Python, torch (>= 2.11) and triton already there: nothing is installed or downloaded.
#
#   MINILLM_GIT_COMMIT=$(git rev-parse HEAD) bash scripts/gpu_check.sh [--dry-run] [OUTDIR]
#
# 1. cuda-tests: tests/test_cuda.py (decode CUDA graphs give the eager tokens, pinned swap);
# 2. kernel-tests: tests/test_kernels.py compiled on this GPU, and no compile after warmup;
# 3. the records of scripts/gpu_record.sh --quick (the 8B shape, bf16, random weights).
# Every step runs under its own time limit (they add up to under 540 s, kills included), and
# writes into OUTDIR (default: $OUT if set, else data/measurements) as it goes: gpu_check.log and
# six JSON records, 7 files. Copy the records into data/measurements/ and commit them.
# The copy a lent machine gets has no .git: pass the commit as above. --dry-run: the same steps
# and limits on the CPU, the tests collected but not run, the benchmarks at the tiny preset
# (tests/test_gpu_check.py runs it).
# Exit status: the number of failed steps.
set -u
# shellcheck source=scripts/gpu_record.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_record.sh"

parse_args --quick "$@"
prepare gpu_check.log
PYTEST=(env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest -p no:cacheprovider)  # no plugins
[ "$MODE" = dry ] && PYTEST+=(--collect-only)  # the CPU lists the GPU-only tests it cannot run
step cuda-tests 70 "${PYTEST[@]}" tests/test_cuda.py
step kernel-tests 80 "${PYTEST[@]}" tests/test_kernels.py \
  tests/test_kernel_compile.py::test_after_warmup_a_run_compiles_nothing
record_steps
log "$FAILED step(s) failed; log and records in $OUTDIR"
exit "$FAILED"
