#!/usr/bin/env bash
# Per-SASS-instruction stall samples of stage one (Nsight Compute source counters), for one
# batch of the bench pipeline with its tuned config: where the kernel's warps wait.
# Run on the GPU machine after bench/gpu_run.sh has unpacked .carry/. Output in $OUT:
# sass-b$B.csv (the source page: one row per SASS instruction) and sass-b$B.txt (summary).
set -u
OUT=${OUT:-/tmp/out}
B=${B:-64}
BIN=.carry
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$PWD/$BIN/lib
for f in "$BIN"/*.xz; do [ -e "$f" ] && xz -d -f "$f"; done
chmod +x "$BIN"/gpu_bench
ncu --clock-control none --kernel-name flashsample_stage1 --launch-skip 4 --launch-count 1 \
  --section SourceCounters --section WarpStateStats --section SpeedOfLight --import-source no \
  -f -o "$OUT/sass-b$B" "$BIN/gpu_bench" --shapes "${SHAPE:-4096:151936}" --batches "$B" \
  --filter-batches "" --python none --reps 3 --warmup 2 --rotate 1 >"$OUT/sass-b$B.txt" 2>&1
ncu -i "$OUT/sass-b$B.ncu-rep" --page details >>"$OUT/sass-b$B.txt" 2>&1
ncu -i "$OUT/sass-b$B.ncu-rep" --page source --csv --print-source sass >"$OUT/sass-b$B.csv" 2>>"$OUT/sass-b$B.txt"
rm -f "$OUT/sass-b$B.ncu-rep"
