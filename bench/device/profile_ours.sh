#!/usr/bin/env bash
# Nsight Compute profile of kda_edu's kernels alone (forward + backward at one shape; profile.sh profiles
# them beside fla's), then the GPU kernel suites of the same build.
#   OUT=<dir> bash bench/device/profile_ours.sh [B T H]
# Writes $OUT/ncu_ours.log (ncu's raw CSV), ncu_ours.json (per launch), kernels.xml, tests.log.
source bench/device/env.sh
SHAPE=(${@:-1 8192 32})
SECTIONS=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats)
timeout "${PROFILE_S:-240}" ncu --profile-from-start off --clock-control none --csv --page raw "${SECTIONS[@]}" \
    --log-file "$OUT/ncu_ours.log" python -m bench.kernels.profile_ncu --shape "${SHAPE[@]}" --backward \
    --methods kda_edu
python -m bench.kernels.profile_ncu --summarize "$OUT/ncu_ours.log" --out "$OUT/ncu_ours.json" > "$OUT/ncu_summary.txt"
cat "$OUT/ncu_summary.txt"
timeout "${TEST_S:-200}" python -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_chunk.py \
    tests/kernels/test_chunk_varlen.py tests/kernels/test_numerics.py tests/kernels/test_chunk_bwd.py \
    --junitxml="$OUT/kernels.xml" > "$OUT/tests.log" 2>&1
echo "tests rc $?" >> "$OUT/tests.log"
tail -3 "$OUT/tests.log"
