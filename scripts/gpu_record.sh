#!/usr/bin/env bash
# Record the Llama-3.1-8B shape (bf16, random weights) on a CUDA machine, in a few minutes.
#
#   scripts/gpu_record.sh [--quick] [--install] [OUTDIR]
#
# Writes JSON records <gpu>-prefill.json, <gpu>-decode.json, <gpu>-decode-mha.json (the same shape
# with as many KV heads as query heads), <gpu>-paged-decode.json, <gpu>-throughput.json,
# <gpu>-host.json and <gpu>-plan-24gib.json (the memory plan of a 24 GiB card, emulated on this
# one), plus gpu_record.log, into OUTDIR (default: $OUT if set, else data/measurements): at most 8
# files. --quick: fewer points (no MHA sweep), "-quick" in the file names.
# Packages: installed from requirements.txt only when torch/triton/safetensors are missing, or
# with --install; minillm runs from this checkout (PYTHONPATH), so no network is needed otherwise.
# Each benchmark is its own command with its own time limit: one failure loses only its record.
# A checkout without .git: pass the commit, MINILLM_GIT_COMMIT=<sha> scripts/gpu_record.sh.
# Exit status: the number of failed steps.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

QUICK=0
INSTALL=0
OUTDIR="${OUT:-data/measurements}"
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    --install) INSTALL=1 ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;
    -*) echo "unknown option $arg" >&2; exit 2 ;;
    *) OUTDIR="$arg" ;;
  esac
done
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_record.log"
: > "$LOG"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }

if [ "$INSTALL" = 1 ] || ! "$PY" -c "import torch, triton, safetensors" 2>/dev/null; then
  log "installing requirements.txt and minillm"
  "$PY" -m pip install -r requirements.txt 2>&1 | tail -n 3 | tee -a "$LOG"
  "$PY" -m pip install -e . --no-deps 2>&1 | tail -n 1 | tee -a "$LOG"
fi
if ! "$PY" -c "import torch; assert torch.cuda.is_available()" 2>>"$LOG"; then
  log "no CUDA device visible to $PY: nothing to record"
  exit 1
fi
if [ -z "${MINILLM_GIT_COMMIT:-}" ] && ! git rev-parse HEAD >/dev/null 2>&1; then
  log "warning: no .git and no MINILLM_GIT_COMMIT: records will say git_commit=unknown"
fi

GPU=$("$PY" -c "import re, torch; n = torch.cuda.get_device_name().lower().removeprefix('nvidia ').removeprefix('geforce '); print(re.sub('[^a-z0-9]+', '-', n).strip('-'))")
GPU="${GPU:-cuda}"
SUFFIX=""
[ "$QUICK" = 1 ] && SUFFIX="-quick"
log "GPU $GPU, $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'), out $OUTDIR"

MODEL=llama-3.1-8b
MHA_TMP="$(mktemp -d)"
trap 'rm -rf "$MHA_TMP"' EXIT
MHA_DIR="$MHA_TMP/llama-3.1-8b-mha"
mkdir -p "$MHA_DIR"
"$PY" - "$MHA_DIR" <<'EOF'
import json, sys
from minillm.engine.config import PRESETS_DIR
config = json.load(open(PRESETS_DIR / "llama-3.1-8b" / "config.json"))
config["num_key_value_heads"] = config["num_attention_heads"]  # MHA: one KV head per query head
json.dump(config, open(sys.argv[1] + "/config.json", "w"), indent=1)
EOF

if [ "$QUICK" = 1 ]; then
  PREFILL=(--lengths 512 2048 --repeats 3)
  DECODE=(--batches 1 16 --contexts 1024 --steps 10)
  THROUGHPUT=(--scale 0.25)
else
  THROUGHPUT=()
  PREFILL=(--lengths 128 256 512 1024 2048 4096 8192 --repeats 5)
  DECODE=(--batches 1 2 4 8 16 32 64 128 --contexts 512 1024 4096 8192 --steps 20)
fi
MHA_DECODE=(--batches 1 8 32 --contexts 1024 4096 --steps 10)

FAILED=0
step() {  # step NAME SECONDS COMMAND...: run one benchmark under a time limit, log, count failures
  local name=$1 limit=$2
  shift 2
  log "start $name"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local status=${PIPESTATUS[0]}
  if [ "$status" = 0 ]; then
    log "done $name"
  else
    log "FAILED $name (exit $status; 124 = over its ${limit}s limit)"
    FAILED=$((FAILED + 1))
  fi
}

step prefill 150 "$PY" -m minillm bench prefill --model "$MODEL" --device cuda --dtype bf16 \
  "${PREFILL[@]}" --out "$OUTDIR/$GPU-prefill$SUFFIX.json"
step decode 210 "$PY" -m minillm bench decode --model "$MODEL" --device cuda --dtype bf16 \
  "${DECODE[@]}" --out "$OUTDIR/$GPU-decode$SUFFIX.json"
if [ "$QUICK" = 0 ]; then
  step decode-mha 120 "$PY" -m minillm bench decode --model "$MHA_DIR" --device cuda --dtype bf16 \
    "${MHA_DECODE[@]}" --out "$OUTDIR/$GPU-decode-mha.json"
fi
# The 24 GiB card of chapter 6, emulated on this one by the planner (memory.py).
# Chapter 7: one layer's paged decode attention (Triton) against contiguous SDPA.
step paged-decode 120 "$PY" -m minillm bench paged-decode --model "$MODEL" --device cuda --dtype bf16 \
  --out "$OUTDIR/$GPU-paged-decode$SUFFIX.json"
# Chapter 8: minillm vs transformers generate() on a ~0.5 B model shape, one run, both printed.
step throughput 240 "$PY" -m minillm bench throughput --model qwen2.5-0.5b --device cuda \
  "${THROUGHPUT[@]}" --out "$OUTDIR/$GPU-throughput$SUFFIX.json"
# Chapter 4: the engine's own time per decode step, launches, eager vs CUDA graphs for the 8B shape.
step host 150 "$PY" -m minillm bench host --device cuda --out "$OUTDIR/$GPU-host$SUFFIX.json"
if [ "$QUICK" = 1 ]; then PLAN_CONTEXTS=(--contexts 1024); else PLAN_CONTEXTS=(); fi
step plan-24gib 300 "$PY" -m minillm bench plan --device cuda --out "$OUTDIR/$GPU-plan-24gib$SUFFIX.json" \
  "${PLAN_CONTEXTS[@]}"

log "$FAILED step(s) failed; records in $OUTDIR"
exit "$FAILED"
