#!/usr/bin/env bash
# The GPU check: on a CUDA machine, in a few minutes, with the torch (>= 2.11) and triton already
# installed there and no network.
#
#   scripts/gpu_check.sh [OUTDIR]     (default: $OUT if set, else data/measurements)
#
# 1. the kernel tests, compiled on this GPU (no TRITON_INTERPRET) and the no-recompile check;
# 2. the CUDA-graph decode parity check and the pinned swap round trip (tests/test_cuda.py);
# 3. the records of scripts/gpu_record.sh --quick (the 8B shape, random weights).
# Writes at most 8 files to OUTDIR: the records and gpu_record.log, which holds this script's
# output too. Copy the JSON files into data/measurements/ and commit them.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
OUTDIR="${1:-${OUT:-data/measurements}}"
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_record.log"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
unset TRITON_INTERPRET
CHECKS="$OUTDIR/checks.log"
echo "[$(date -u +%H:%M:%S)] gpu_check: kernels compiled on this GPU, CUDA graphs, pinned swap" | tee "$CHECKS"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernel_compile.py \
  tests/test_cuda.py -k "not fits_the_target" 2>&1 | tee -a "$CHECKS"
CHECK_STATUS=${PIPESTATUS[0]}
bash scripts/gpu_record.sh --quick "$OUTDIR"
RECORD_STATUS=$?  # the number of benchmarks that failed
cat "$CHECKS" "$LOG" > "$LOG.all" && mv "$LOG.all" "$LOG" && rm -f "$CHECKS"  # one log: gpu_record.log
exit $(( (CHECK_STATUS != 0) + RECORD_STATUS ))
