#!/usr/bin/env bash
# One call on a lent GPU machine: GPU tests, compute-sanitizer, benchmark. Binaries are built
# elsewhere and carried in .carry/ (gpu-test = the tests/tests/gpu/ binary, target/release/deps/gpu-*,
# stripped; gpu_bench, score_bench, spec_bench).
# STAGES picks what runs (default: all but profile); logs go to $OUT, a short summary is printed last.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STAGES=${STAGES:-"info tests cache sanitizer bench"}  # also: new split tiles crowded decode before_after peers profile ptxas score spec
SAN_FILTER=${SAN_FILTER:-stage_one_writes_every_candidate_slot}
BIN=.carry
# Every carried folder (.carry, .carry-before, further before_after sides such as .carry-b).
for f in .carry*/*.xz; do [ -e "$f" ] && xz -d -f "$f"; done
for d in .carry*/; do chmod +x "$d"gpu-test "$d"gpu_bench "$d"score_bench "$d"spec_bench "$d"decode_loop 2>/dev/null; done
GPU_TEST=$BIN/gpu-test
# Libraries the build machine linked (libffi, libzstd for LLVM), used only where the image lacks them.
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$PWD/$BIN/lib
export FLASHSAMPLE_CACHE_DIR=/tmp/flashsample-cache
summary=()
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has info; then
  { date -u; nvidia-smi; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; } >"$OUT/info.txt" 2>&1
  summary+=("gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)")
fi
if has tests; then
  # Every GPU test (#[ignore]d where there is no GPU) as its own process, TEST_JOBS at a time,
  # the slowest known first, each timed; a deadline keeps the call inside its limit (tests it
  # never started are listed as NOTRUN). Most tests spend their time in the float64 reference
  # and in LLVM, so one process per test keeps the lent machine's 16 cores busy: the whole
  # suite took 292 s on an H200 (BENCHMARKS.md, 2026-12-05 fourth session); on an H100 its 66
  # tests summed ~4040 s over 12 jobs, the longest 401 s (2026-12-07), so the longest go first
  # (`slow`) and a deadline of ~520 s covers it. SANITIZE names
  # `tool:test` pairs (tool: memcheck, racecheck, synccheck, initcheck) to run under
  # compute-sanitizer in the same pool; TEST_FILTER / TEST_SKIP are regexes of tests to keep / drop.
  start=$SECONDS
  deadline=$(( $(date +%s) + ${TEST_TIMEOUT:-540} ))
  slow="invariance::requests_get_the_same_bits_at_every_batch_and_schedule logprob_modes::raw_logprobs_match_the_reference_on_every_schedule scoring::target_ranks_match_the_reference_on_every_schedule_and_both_apis scoring::target_logprobs_match_the_reference_on_every_schedule noise_skip::skipped_noise_changes_no_sample_on_peaked_or_flat_rows persistent_overlapped_epilogue_equals_one_cta_per_item speculative::gpu_verification_is_pathwise_the_reference_and_the_cpu logprob_modes::raw_logsumexp_is_the_abi_merge_of_the_raw_partials wgmma_mainloop_pathwise"
  { printf '%s\n' ${SANITIZE:-} $slow; "$GPU_TEST" --list --include-ignored | sed -n 's/: test$//p'; } \
    | awk '!seen[$0]++' | grep -E "${TEST_FILTER:-.}" | grep -Ev "${TEST_SKIP:-^$}" >"$OUT/test-list.txt"
  mkdir -p "$OUT/tests"
  one_test() {
    local t=$1 log="$OUT/tests/${1//:/_}.log" s=$SECONDS left=$(( deadline - $(date +%s) ))
    [ $left -gt 5 ] || { echo "$t NOTRUN"; return; }
    case $t in
      memcheck:* | racecheck:* | synccheck:* | initcheck:*)
        timeout $left compute-sanitizer --tool "${t%%:*}" --error-exitcode 9 "$GPU_TEST" "${t#*:}" --exact --include-ignored >"$log" 2>&1 ;;
      *) timeout $left "$GPU_TEST" "$t" --exact --include-ignored >"$log" 2>&1 ;;
    esac
    echo "$t rc=$? $((SECONDS - s))s $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tr '\n' ' ')"
  }
  export -f one_test; export GPU_TEST OUT deadline
  xargs -P "${TEST_JOBS:-12}" -I{} bash -c 'one_test {}' <"$OUT/test-list.txt" >"$OUT/tests.txt"
  tar czf "$OUT/test-logs.tgz" -C "$OUT" tests && rm -rf "$OUT/tests"
  summary+=("tests ($((SECONDS - start)) s): $(grep -c ' rc=0 ' "$OUT/tests.txt") passed, $(grep ' rc=' "$OUT/tests.txt" | grep -vc ' rc=0 ') failed, $(grep -c NOTRUN "$OUT/tests.txt") not run")
  summary+=("$(grep ' rc=' "$OUT/tests.txt" | grep -v ' rc=0 ')")
fi
if has new; then
  # The GPU tests of work built since the last GPU run (keep this list to what is unverified),
  # then memcheck on the new kernels: the first thing a lent GPU should run.
  # Main's GPU code passed the whole suite on an H100 at 539293b (2026-12-08, thirtieth
  # session: 68 of 68), with the range rerun of overflowed rows and 4-entry lists on every tile.
  # Since then, not yet run on a GPU: the CUDA verifier's host path starts on exact lists when
  # the device launch's overflowed (speculative::a_verification_overflowing_the_lists_decides_on_exact_lists);
  # the 256-token tile is back on 8-entry lists; a recurring overflow doubles the lists before
  # exact ones (mid_batch: four launches walk the lengths). The rest is the list tests.
  NEW_TESTS=${NEW_TESTS:-"speculative:: short_lists filtered_gpu_tokens clustered rows_overflowing mid_batch throughput_batch odd_shapes chi_square_for_every_filter nucleus::"}
  NEW_SANITIZE=${NEW_SANITIZE:-"memcheck:filtered_gpu_tokens_match_cpu_tokens racecheck:filtered_gpu_tokens_match_cpu_tokens"}
  start=$SECONDS
  timeout "${TEST_TIMEOUT:-540}" "$GPU_TEST" --include-ignored --test-threads="${TEST_THREADS:-16}" $NEW_TESTS >"$OUT/new-tests.log" 2>&1
  summary+=("new tests rc=$? ($((SECONDS - start)) s): $(grep -E '^test result' "$OUT/new-tests.log" | tail -1)")
  summary+=("$(grep -E '^test .* FAILED$' "$OUT/new-tests.log" | head -20)")
  for tt in $NEW_SANITIZE; do
    tool=${tt%%:*} t=${tt#*:}
    timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 "$GPU_TEST" "$t" --exact --include-ignored --test-threads=1 >"$OUT/$tool-${t//:/_}.log" 2>&1
    summary+=("$tool $t rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool-${t//:/_}.log" | tr '\n' ' ')")
  done
fi
# Tile configs the `split` and `tiles` stages time (GpuConfig JSON; the benches' `fit_lists`
# adds each pipeline's lists): PP4 / PP6 / PP8 the 128 x 64 ping-pong (4 warps a set) on a 4- /
# 6- / 8-stage TMA ring, PPW6 the 128 x 128 ping-pong on 6, WP / WI the 256 x 128 8-warp tile on
# 4 stages, persistent / one CTA per item.
tile() { echo "{\"vocab_tile\":$1,\"batch_tile\":$2,\"warps\":$3,\"schedule\":{\"WgmmaTma\":{\"stages\":$4,\"grid\":\"$5\"}},\"list_per_tile\":0,\"stagger_us\":0}"; }
PP4=$(tile 128 64 4 4 PingPong) PP6=$(tile 128 64 4 6 PingPong) PP8=$(tile 128 64 4 8 PingPong)
PPW6=$(tile 128 128 4 6 PingPong) WP=$(tile 256 128 8 4 Persistent) WI=$(tile 256 128 8 4 PerItem)
if has split; then
  # Where the epilogue's time goes at B >= 64: each config sampled (per-row T + Gumbel), as a
  # bare argmax and as an untempered Gumbel-max (`--greedy`), the 256 x 128 persistent tile
  # and the 128 x 64 ping-pong, both heads.
  "$BIN/gpu_bench" --python none --reps 20 --warmup 3 --batches ${SPLIT_BATCHES:-64,128,256,512} --filter-batches= \
    --overhead-batches= --nucleus-batches= --logprob-batches= --configs "[$WP,$PP8,$WP]" --greedy >"$OUT/split.txt" 2>"$OUT/split.log"
  summary+=("split rc=$?")
  summary+=("$(grep -E '^  config' "$OUT/split.log" | sed 's/ GpuConfig.*grid: \([A-Za-z]*\).*/ \1/')")
fi
if has crowded; then
  # Filtered rows whose top tokens crowd the low ids (`--logits lm-like-low-ids`, a model of a
  # BPE vocabulary): how many rows three host-API launches rerun on each batch, and the kernel
  # times, next to the same rows placed at random (`lm-like`).
  for logits in lm-like lm-like-low-ids; do
    timeout 200 "$BIN/gpu_bench" --python none --reps 20 --warmup 3 --batches 64 --filter-batches ${CROWDED_BATCHES:-16,64,128,256} \
      --overhead-batches= --nucleus-batches= --logprob-batches= --logits $logits >"$OUT/crowded-$logits.txt" 2>"$OUT/crowded-$logits.log"
    summary+=("crowded $logits rc=$?")
    summary+=("$(grep -E '^fused top-k' "$OUT/crowded-$logits.log" | sed 's/ (GpuConfig.*);/;/')")
  done
fi
if has tiles; then
  # The heuristic's tile choices from B = 192 against their alternatives (BENCHMARKS.md, GPU
  # 2026-12-07, twentieth session): the unfiltered and the filtered verifier, the filtered
  # sampler and the scorer, each timed on the heuristic's tile and on each listed one.
  timeout 120 "$BIN/spec_bench" --device cuda --python none --batches 16,64 --stages --configs "[$PP6,$WI]" >"$OUT/tiles-verify.txt" 2>&1
  summary+=("tiles: verify rc=$?")
  timeout 90 "$BIN/spec_bench" --device cuda --python none --batches 64 --filter --stages --configs "[$PP4,$PP6]" >"$OUT/tiles-verify-filtered.txt" 2>&1
  summary+=("tiles: filtered verify rc=$?")
  timeout 150 "$BIN/gpu_bench" --python none --reps 20 --warmup 3 --batches 256 --filter-batches 256,512 --overhead-batches= \
    --nucleus-batches= --logprob-batches= --configs "[$PP4,$PP6]" >"$OUT/tiles-filtered.txt" 2>"$OUT/tiles-filtered.log"
  summary+=("tiles: filtered sampler rc=$?")
  timeout 150 "$BIN/score_bench" --device cuda --python none --rows 256,2048,8192 --reps 10 \
    --configs "[$PP4,$PP8,$PPW6,$WP,$WI]" >"$OUT/tiles-score.txt" 2>"$OUT/tiles-score.log"
  summary+=("tiles: scorer rc=$?")
fi
if has cache; then
  FLASHSAMPLE_EXPECT_DISK_CACHE=1 "$GPU_TEST" ptx_disk_cache --exact --include-ignored --nocapture >"$OUT/cache.log" 2>&1
  summary+=("disk cache second process rc=$?: $(grep -E 'ok: PTX|panicked' "$OUT/cache.log" | head -2)")
fi
if has sanitizer; then
  start=$SECONDS
  compute-sanitizer --tool memcheck --error-exitcode 9 "$GPU_TEST" "$SAN_FILTER" --include-ignored --test-threads=1 >"$OUT/sanitizer.log" 2>&1
  summary+=("memcheck rc=$? ($((SECONDS - start)) s): $(grep -E 'ERROR SUMMARY|test result' "$OUT/sanitizer.log" | tr '\n' ' ')")
fi
if has peers; then
  PYTHONUNBUFFERED=1 python3 bench/peers/torch_peers.py --json ${PEER_ARGS:-} >"$OUT/peers.json" 2>"$OUT/peers.log"
  summary+=("peers rc=$?")
fi
if has profile; then
  # Registers / spills of every cached module, then Nsight Compute on stage one per batch.
  for b in ${PROFILE_BATCHES:-64 256}; do
    ncu --clock-control none --kernel-name flashsample_stage1 --launch-skip 4 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section LaunchStats --section Occupancy --section InstructionStats \
      --section SchedulerStats "$BIN/gpu_bench" --shapes "${PROFILE_SHAPE:-4096:151936}" --batches "$b" \
      --filter-batches "" --python none --reps 3 --warmup 2 --rotate 1 >"$OUT/ncu-b$b.txt" 2>&1
    summary+=("ncu B=$b rc=$?")
  done
fi
if has profile || has ptxas; then
  # Each module at its own target (sm_90a for wgmma configs); warnings (wgmma serialization) kept.
  for f in "$FLASHSAMPLE_CACHE_DIR"/ptx/*.ptx; do
    arch=$(awk '$1 == ".target" { print $2; exit }' "$f")
    echo "== $f ($arch)"; ptxas -arch="$arch" -v "$f" -o /dev/null 2>&1 | grep -E "Compiling|registers|spill|arning"
  done >"$OUT/ptxas.txt" 2>&1
  summary+=("ptxas: $(grep -c '^==' "$OUT/ptxas.txt") modules, $(grep -c arning "$OUT/ptxas.txt") warnings")
fi
if has decode; then
  "$BIN/decode_loop" ${DECODE_ARGS:-} >"$OUT/decode.txt" 2>&1
  summary+=("decode_loop rc=$?: $(tail -3 "$OUT/decode.txt" | tr '\n' ' ')")
fi
if has before_after; then
  # The same gpu_bench arguments through each side's binary, alternating for AB_ROUNDS rounds in
  # one call (drift shows as a spread between rounds): the regression check of a refactor, or
  # several prepared branches at once. AB_SIDES lists the carried folders, baseline first
  # (default: the previous commit's .carry-before/, then this one's .carry/; pack each with
  # PACK_DIR=<folder> scripts/pack-carry). The fused, nucleus and per-config lines go to the
  # summary. Where every side carries score_bench, it alternates too (SCORE_AB_ARGS; fused and
  # rank columns to the summary), and so does spec_bench (SPEC_AB_ARGS; its table rows).
  sides=${AB_SIDES:-".carry-before $BIN"}
  scores=1 specs=1
  for dir in $sides; do [ -x "$dir/score_bench" ] || scores=0; [ -x "$dir/spec_bench" ] || specs=0; done
  for round in $(seq "${AB_ROUNDS:-2}"); do
    for dir in $sides; do
      side=${dir#.}
      "$dir/gpu_bench" ${AB_ARGS:---python none --reps 30} >"$OUT/bench-$side-$round.txt" 2>"$OUT/bench-$side-$round.log"
      summary+=("bench $side $round rc=$?")
      summary+=("$(grep -hE '^(fused|exact nucleus|nucleus split|  config)' "$OUT/bench-$side-$round.log" | sed 's/ (GpuConfig.*//; s/ GpuConfig.*//')")
      if [ $scores = 1 ]; then
        "$dir/score_bench" ${SCORE_AB_ARGS:---python none --reps 10} >"$OUT/score-$side-$round.txt" 2>&1
        summary+=("score $side $round rc=$?")
        summary+=("$(grep -E '^\| [0-9]' "$OUT/score-$side-$round.txt" | cut -d'|' -f2-7)")
      fi
      if [ $specs = 1 ]; then
        "$dir/spec_bench" ${SPEC_AB_ARGS:---python none --batches 16,64} >"$OUT/spec-$side-$round.txt" 2>&1
        summary+=("spec $side $round rc=$?")
        summary+=("$(grep -E '^\| [0-9]' "$OUT/spec-$side-$round.txt")")
      fi
    done
  done
fi
if has bench; then
  start=$SECONDS
  "$BIN/gpu_bench" --json-out "$OUT/bench.json" ${BENCH_ARGS:-} >"$OUT/bench.txt" 2>"$OUT/bench.log"
  summary+=("bench rc=$? ($((SECONDS - start)) s)")
fi
if has score; then
  # Scoring given tokens against torch.compile and Liger, whose wheel scripts/pack-carry puts in
  # .whl/ (carry it too; the machine has no network).
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  "$BIN/score_bench" --device cuda ${SCORE_ARGS:-} >"$OUT/score.txt" 2>"$OUT/score.log"
  summary+=("score_bench rc=$?")
fi
if has spec; then
  # Speculative verification (B 1/16/64 x k 3/7, both LM-head shapes) against a torch.compile'd
  # matmul + softmax + vLLM-style rejection sampler and against sampling the same rows.
  "$BIN/spec_bench" --device cuda ${SPEC_ARGS:-} >"$OUT/spec.txt" 2>"$OUT/spec.log"
  summary+=("spec_bench rc=$?")
fi
# The summary also goes to $OUT/0-summary.txt: a call brings back only its first few files (by
# name), and the printed tail is cut to its last characters.
echo "=================== summary"
printf '%s\n' "${summary[@]}" | tee "$OUT/0-summary.txt"
[ -f "$OUT/bench.txt" ] && cat "$OUT/bench.txt"
true
