#!/usr/bin/env bash
# A short CUDA autotune on an H200 (or any sm_80+ GPU) that fits about 5 minutes of device
# time: both LM heads (Qwen3-8B-like D=4096,V=151936 and Llama-3-70B-like D=8192,V=128256),
# B in 1..512, pruned search (flashsample-autotune --budget-s / --top-heuristic, see
# autotune/src/main.rs). Writes the tuning JSON to $1; the table goes to stdout.
#
#   scripts/autotune-h200.sh /tmp/out/tuning-h200.json
#
# Binary: $AUTOTUNE_BIN, else .carry/flashsample-autotune(.xz, decompressed here), else
# target/release/flashsample-autotune. Knobs: BATCHES (default 1,2,4,...,512), BUDGET_S
# (default 270: the search's own wall clock, head generation and references included), TOP_K
# (12 configs per shape besides the heuristic), QUICK_REPS (3), FINALISTS (3), REPS (20).
set -euo pipefail
out=${1:?usage: $0 OUTPUT.json}
mkdir -p "$(dirname "$out")"
if [ -z "${AUTOTUNE_BIN:-}" ]; then
  if [ -e .carry/flashsample-autotune.xz ]; then xz -d -f .carry/flashsample-autotune.xz; fi
  for b in .carry/flashsample-autotune target/release/flashsample-autotune; do
    if [ -e "$b" ]; then AUTOTUNE_BIN=$b; break; fi
  done
fi
: "${AUTOTUNE_BIN:?no flashsample-autotune binary (build: cargo build --release -p flashsample-autotune)}"
chmod +x "$AUTOTUNE_BIN"
# Libraries the build machine linked (libffi, libzstd for LLVM), used only where the image lacks them.
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$PWD/.carry/lib
export FLASHSAMPLE_CACHE_DIR=${FLASHSAMPLE_CACHE_DIR:-/tmp/flashsample-cache}
start=$SECONDS
"$AUTOTUNE_BIN" --device cuda:0 \
  --shapes 4096:151936,8192:128256 --batch "${BATCHES:-1,2,4,8,16,32,64,128,256,512}" \
  --budget-s "${BUDGET_S:-270}" --top-heuristic "${TOP_K:-12}" \
  --quick-reps "${QUICK_REPS:-3}" --finalists "${FINALISTS:-3}" --warmup 3 --reps "${REPS:-20}" \
  --out "$out"
echo "autotune-h200: $((SECONDS - start)) s -> $out"
