#!/usr/bin/env bash
# Record the Llama-3.1-8B shape (bf16, random weights) on a CUDA machine, with the Python, torch
# and triton already there: nothing is installed, nothing is downloaded.
#
#   MINILLM_GIT_COMMIT=$(git rev-parse HEAD) scripts/gpu_record.sh [--quick] [--dry-run] [OUTDIR]
#
# Writes JSON records <gpu>-prefill.json, <gpu>-decode.json, <gpu>-decode-mha.json (the same shape
# with as many KV heads as query heads), <gpu>-paged-decode.json, <gpu>-throughput.json,
# <gpu>-host.json and <gpu>-plan-24gib.json (the memory plan of a 24 GiB card, emulated on this
# one), plus gpu_record.log, into OUTDIR (default: $OUT if set, else data/measurements): at most 8
# files, each record as soon as its step ends. --quick: fewer points (no MHA sweep), "-quick" in
# the file names; scripts/gpu_check.sh runs it after the GPU-only tests. --dry-run: the same
# steps, options and time limits on the CPU at the tiny preset (tests/test_gpu_check.py).
# Each step runs under its own time limit: one that fails or hangs loses only its record.
# A copy of the tree without .git: pass the commit in MINILLM_GIT_COMMIT, or the records say
# git_commit=unknown. PYTHON picks the interpreter (default python3); LIMIT_SCALE multiplies
# every time limit (default 1). Exit status: the number of failed steps.
#
# scripts/gpu_check.sh sources this file for its functions; run as a command, it records.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
KILL_AFTER=3  # seconds from a step's TERM at its limit to its KILL
LIMIT_SCALE="${LIMIT_SCALE:-1}"  # times every limit: a slower GPU, or the dry run on a busy CPU
FAILED=0

log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }

step() {  # step NAME SECONDS COMMAND...: run under a time limit, its output into the log as it comes
  local name=$1 limit=$(($2 * LIMIT_SCALE))
  shift 2
  log "start $name (limit ${limit}s)"
  timeout --kill-after="$KILL_AFTER" "$limit" "$@" 2>&1 | tee -a "$LOG"
  local status=${PIPESTATUS[0]}
  if [ "$status" = 0 ]; then
    log "done $name"
  else
    log "FAILED $name (exit $status; 124 or 137 = over its ${limit}s limit)"
    FAILED=$((FAILED + 1))
  fi
}

parse_args() {  # sets MODE (dry, quick or full) and OUTDIR (absolute)
  local quick=0 dry=0 arg
  OUTDIR="${OUT:-$ROOT/data/measurements}"
  for arg in "$@"; do
    case "$arg" in
      --quick) quick=1 ;;
      --dry-run) dry=1 ;;
      -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;
      -*) echo "unknown option $arg" >&2; exit 2 ;;
      *) OUTDIR="$arg" ;;
    esac
  done
  MODE=full
  [ "$quick" = 1 ] && MODE=quick
  [ "$dry" = 1 ] && MODE=dry
  mkdir -p "$OUTDIR" && OUTDIR="$(cd "$OUTDIR" && pwd)"
}

# What the engine and the benchmarks import, from this machine's own packages (the server and book
# stacks may be missing); the device's name for the record files, last.
ENVIRONMENT_PY='
import platform, re, sys
import torch, triton, safetensors, transformers
import minillm.lab.bench, minillm.lab.bench_host, minillm.lab.bench_plan, minillm.lab.bench_throughput
missing = []
for name in ("fastapi", "uvicorn", "openai", "jupyterlab"):
    try:
        __import__(name)
    except ImportError:
        missing.append(name)
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton.__version__}, transformers {transformers.__version__}")
print("not here, not needed:", ", ".join(missing) or "none")
device = sys.argv[1]
if device == "cuda" and not torch.cuda.is_available():
    sys.exit(f"no CUDA device visible to {sys.executable}: nothing to run")
name = torch.cuda.get_device_name() if device == "cuda" else device
name = name.lower().removeprefix("nvidia ").removeprefix("geforce ")
print(re.sub("[^a-z0-9]+", "-", name).strip("-") or device)
'

MHA_CONFIG_PY='
import json, os, sys
from minillm.engine.config import PRESETS_DIR
config = json.load(open(PRESETS_DIR / "llama-3.1-8b" / "config.json"))
config["num_key_value_heads"] = config["num_attention_heads"]
os.makedirs(sys.argv[1])
json.dump(config, open(os.path.join(sys.argv[1], "config.json"), "w"), indent=1)
'

resolve_commit() {  # export MINILLM_GIT_COMMIT for the records: as given, else this checkout's HEAD
  if [ -z "${MINILLM_GIT_COMMIT:-}" ] && [ "$(git -C "$ROOT" rev-parse --show-toplevel 2>/dev/null)" = "$ROOT" ]; then
    MINILLM_GIT_COMMIT="$(git -C "$ROOT" rev-parse HEAD)"
  fi
  if [ -n "${MINILLM_GIT_COMMIT:-}" ]; then
    export MINILLM_GIT_COMMIT
    log "commit $MINILLM_GIT_COMMIT"
  else
    log "warning: no .git here and no MINILLM_GIT_COMMIT: the records will say git_commit=unknown."
    log "  Pass the commit of the checkout this tree was copied from: MINILLM_GIT_COMMIT=<sha> bash $0"
  fi
}

prepare() {  # prepare LOGNAME: the log, the commit, the environment; sets GPU, DEVICE and the sizes
  LOG="$OUTDIR/$1"
  : > "$LOG"
  cd "$ROOT" || exit 1
  export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # nothing from the network
  if [ "$MODE" = dry ]; then DEVICE=cpu; else DEVICE=cuda; unset TRITON_INTERPRET; fi
  resolve_commit
  step environment 30 "$PY" -c "$ENVIRONMENT_PY" "$DEVICE"
  [ "$FAILED" = 0 ] || exit 1  # nothing else could run
  GPU="$(grep -v '^\[' "$LOG" | tail -n 1)"  # the environment's last line
  SUFFIX="-quick"
  MODEL=llama-3.1-8b SMALL_MODEL=qwen2.5-0.5b DTYPE=bf16
  PAGED=(--batch 16 --contexts 1024 4096 16384 --repeats 5)
  HOST=(--batch 256 --ctx 1000 --steps 40)
  THROUGHPUT_LIMIT=65 PLAN_LIMIT=60
  case "$MODE" in
    dry)
      MODEL=tiny SMALL_MODEL=tiny DTYPE=fp32
      PREFILL=(--lengths 16 32 --repeats 1)
      DECODE=(--batches 1 2 --contexts 32 --steps 2)
      PAGED=(--batch 2 --contexts 64 128 --repeats 1)
      THROUGHPUT=(--scale 0.02)
      HOST=(--batch 16 --ctx 64 --steps 3)
      PLAN=(--memory-limit 96MiB --max-num-seqs 16 --max-num-batched-tokens 256 --contexts 64) ;;
    quick)
      PREFILL=(--lengths 512 2048 --repeats 3)
      DECODE=(--batches 1 16 --contexts 1024 --steps 10)
      THROUGHPUT=(--scale 0.25)
      PLAN=(--memory-limit 24GiB --contexts 1024) ;;
    full)
      SUFFIX=""
      PREFILL=(--lengths 128 256 512 1024 2048 4096 8192 --repeats 5)
      DECODE=(--batches 1 2 4 8 16 32 64 128 --contexts 512 1024 4096 8192 --steps 20)
      THROUGHPUT=(--scale 1)
      PLAN=(--memory-limit 24GiB --contexts 1024 4096 8192)
      THROUGHPUT_LIMIT=300 PLAN_LIMIT=240 ;;
  esac
  log "device $GPU, $MODE records into $OUTDIR"
}

record_steps() {  # the benchmarks, one record each
  local bench=("$PY" -m minillm bench) out="$OUTDIR/$GPU" mha
  step prefill 45 "${bench[@]}" prefill --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" \
    "${PREFILL[@]}" --out "$out-prefill$SUFFIX.json"
  step decode 50 "${bench[@]}" decode --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" \
    "${DECODE[@]}" --out "$out-decode$SUFFIX.json"
  if [ "$MODE" = full ]; then  # the same shape with one KV head per query head
    mha="$(mktemp -d)/llama-3.1-8b-mha"
    step mha-config 15 "$PY" -c "$MHA_CONFIG_PY" "$mha"
    step decode-mha 150 "${bench[@]}" decode --model "$mha" --device "$DEVICE" --dtype "$DTYPE" \
      --batches 1 8 32 --contexts 1024 4096 --steps 10 --out "$out-decode-mha.json"
    rm -rf "$(dirname "$mha")"
  fi
  # Chapter 7: one layer's paged decode attention (Triton) against contiguous SDPA.
  step paged-decode 35 "${bench[@]}" paged-decode --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" \
    "${PAGED[@]}" --out "$out-paged-decode$SUFFIX.json"
  # Chapter 8: minillm vs transformers generate() on a ~0.5 B model shape, one run, both printed.
  step throughput "$THROUGHPUT_LIMIT" "${bench[@]}" throughput --model "$SMALL_MODEL" \
    --device "$DEVICE" --dtype "$DTYPE" "${THROUGHPUT[@]}" --out "$out-throughput$SUFFIX.json"
  # Chapter 4: the engine's own Python per decode step, launches, eager vs CUDA graphs (8B shape).
  step host 70 "${bench[@]}" host --device "$DEVICE" "${HOST[@]}" --out "$out-host$SUFFIX.json"
  # Chapter 6: the 24 GiB card, emulated on this one (set_per_process_memory_fraction).
  step plan-24gib "$PLAN_LIMIT" "${bench[@]}" plan --model "$MODEL" --device "$DEVICE" \
    --dtype "$DTYPE" "${PLAN[@]}" --out "$out-plan-24gib$SUFFIX.json"
}

main() {
  parse_args "$@"
  prepare gpu_record.log
  record_steps
  log "$FAILED step(s) failed; records in $OUTDIR"
  exit "$FAILED"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
