#!/usr/bin/env bash
# Issue 20, the split prepare: the A/B benchmark (bench/kernels/bench_prepare_split.py, the current build beside
# the build in .builds/old and fla) and then the GPU kernel suites of this build, in one call. Carry .whl and
# .builds/old (and .tcache, fla's autotune results from an earlier call, when there is one):
#   BENCH_ARGS="--shapes 1,8192,32" bash bench/device/issue20_split.sh
# Writes $OUT/h200_prepare_split.json, bench.log, kernels_split.xml, tests.log, autotune.tgz (fla's choices).
source bench/device/env.sh
export TRITON_CACHE_DIR=/tmp/tcache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .tcache/autotune.tgz ] && tar xzf .tcache/autotune.tgz -C "$TRITON_CACHE_DIR"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$OUT/gpu.txt"
OLD=(); [ -d .builds/old ] && OLD=(--old .builds/old)
timeout "${BENCH_S:-360}" python bench/kernels/bench_prepare_split.py "${OLD[@]}" ${BENCH_ARGS:-} \
    --out "$OUT/h200_prepare_split.json" > "$OUT/bench.log" 2>&1
echo "bench rc $?" >> "$OUT/bench.log"
timeout "${TEST_S:-200}" python -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_chunk.py \
    tests/kernels/test_chunk_varlen.py tests/kernels/test_numerics.py tests/kernels/test_chunk_bwd.py \
    --junitxml="$OUT/kernels_split.xml" > "$OUT/tests.log" 2>&1
echo "tests rc $?" >> "$OUT/tests.log"
(cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" | tar czf "$OUT/autotune.tgz" -T -)
tail -3 "$OUT/tests.log"; grep -v "^{" "$OUT/bench.log" | tail -20
