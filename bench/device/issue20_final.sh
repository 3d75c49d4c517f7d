#!/usr/bin/env bash
# Issue 20: a build's GPU kernel suites and its forward + backward beside fla (bench/kernels/bench_kda_bwd.py),
# in one call. Carry .whl and .tcache (fla's autotune results; refreshed into $OUT/autotune.tgz).
#   BUILD=<commit> SHAPES="1,8192,32 8,4096,16" bash bench/device/issue20_final.sh
# Writes $OUT/kernels.xml, tests.log, h200_fwd_bwd_split.json (the committed file's other rows kept), bwd.log.
source bench/device/env.sh
export TRITON_CACHE_DIR=/tmp/tcache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .tcache/autotune.tgz ] && tar xzf .tcache/autotune.tgz -C "$TRITON_CACHE_DIR"
timeout "${TEST_S:-200}" python -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_chunk.py \
    tests/kernels/test_chunk_varlen.py tests/kernels/test_numerics.py tests/kernels/test_chunk_bwd.py \
    --junitxml="$OUT/kernels.xml" > "$OUT/tests.log" 2>&1
echo "tests rc $?" >> "$OUT/tests.log"
cp bench/results/h200_fwd_bwd_split.json "$OUT/h200_fwd_bwd_split.json"
timeout "${BENCH_S:-300}" python bench/kernels/bench_kda_bwd.py --out "$OUT/h200_fwd_bwd_split.json" \
    --shapes ${SHAPES:-1,8192,32} --build "${BUILD:-unknown}" > "$OUT/bwd.log" 2>&1
echo "bench rc $?" >> "$OUT/bwd.log"
(cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" | tar czf "$OUT/autotune.tgz" -T -)
tail -3 "$OUT/tests.log"; tail -8 "$OUT/bwd.log"
