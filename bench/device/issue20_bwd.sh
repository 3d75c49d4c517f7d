#!/usr/bin/env bash
# Issue 20, the backward: one build's GPU kernel suites, its forward + backward at bench_kda_bwd.py's shapes
# with peak and held memory (every keep_intermediates mode beside fla). No forward-only timings:
# issue20_build.sh has those. (Session 19's version also ran the local_k experiments, one process per variant;
# those experiments are concluded and removed, see bench/NOTES.md.)
#   BUILD=<commit> [SHAPES="1,8192,32 ..."] bash bench/device/issue20_bwd.sh
# Writes $OUT/kernels.xml, tests.log, h200_fwd_bwd.json, bwd.log, autotune.tgz.
source bench/device/env.sh
export TRITON_CACHE_DIR=/tmp/tcache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .tcache/autotune.tgz ] && tar xzf .tcache/autotune.tgz -C "$TRITON_CACHE_DIR"
timeout "${TEST_S:-170}" python -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_chunk.py \
    tests/kernels/test_chunk_varlen.py tests/kernels/test_numerics.py tests/kernels/test_chunk_bwd.py \
    --junitxml="$OUT/kernels.xml" > "$OUT/tests.log" 2>&1
echo "tests rc $?" >> "$OUT/tests.log"
cp bench/results/h200_fwd_bwd.json "$OUT/h200_fwd_bwd.json"
timeout "${BWD_S:-330}" python bench/kernels/bench_kda_bwd.py --out "$OUT/h200_fwd_bwd.json" \
    --build "${BUILD:-unknown}" ${SHAPES:+--shapes $SHAPES} > "$OUT/bwd.log" 2>&1
echo "bench rc $?" >> "$OUT/bwd.log"
(cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" | tar czf "$OUT/autotune.tgz" -T -)
tail -3 "$OUT/tests.log"; grep -v "^{" "$OUT/bwd.log" | tail -6
