#!/usr/bin/env bash
# One build's GPU kernel suites, its forward at the four headline shapes beside fla
# (bench/kernels/bench_kda.py, no sweep) and its forward + backward at bench_kda_bwd.py's three shapes with
# peak memory, in one run, so that every timing comes with the correctness tests of the same build.
# .tcache/autotune.tgz, when present, holds fla's autotune results from an earlier run (refreshed into
# $OUT/autotune.tgz), so fla does not autotune every shape again.
#   OUT=<dir> BUILD=<commit> [SHAPES="1,8192,32 ..."] [SKIP_FORWARD=1] bash bench/device/kernel_timings.sh
# Writes $OUT/kernels.xml, tests.log, h200_forward_split.json, fwd.log, h200_fwd_bwd.json, bwd.log, autotune.tgz.
source bench/device/env.sh
export TRITON_CACHE_DIR=/tmp/tcache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .tcache/autotune.tgz ] && tar xzf .tcache/autotune.tgz -C "$TRITON_CACHE_DIR"
timeout "${TEST_S:-200}" python -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_chunk.py \
    tests/kernels/test_chunk_varlen.py tests/kernels/test_numerics.py tests/kernels/test_chunk_bwd.py \
    --junitxml="$OUT/kernels.xml" > "$OUT/tests.log" 2>&1
echo "tests rc $?" >> "$OUT/tests.log"
if [ -z "${SKIP_FORWARD:-}" ]; then  # SKIP_FORWARD=1: the suites and forward + backward only
  timeout "${FWD_S:-150}" python -m bench.kernels.bench_kda --no-sweep --methods "kda_edu chunk_kda" \
      "fla chunk_kda" --build "${BUILD:-unknown}" --out "$OUT/h200_forward_split.json" > "$OUT/fwd.log" 2>&1
  echo "forward rc $?" >> "$OUT/fwd.log"
fi
cp bench/results/h200_fwd_bwd.json "$OUT/h200_fwd_bwd.json"
timeout "${BWD_S:-240}" python -m bench.kernels.bench_kda_bwd --out "$OUT/h200_fwd_bwd.json" \
    --build "${BUILD:-unknown}" ${SHAPES:+--shapes $SHAPES} > "$OUT/bwd.log" 2>&1
echo "bench rc $?" >> "$OUT/bwd.log"
(cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" | tar czf "$OUT/autotune.tgz" -T -)
tail -3 "$OUT/tests.log"; [ -f "$OUT/fwd.log" ] && tail -8 "$OUT/fwd.log"; grep -v "^{" "$OUT/bwd.log" | tail -6
