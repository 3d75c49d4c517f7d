# Nsight Compute profile of the KDA kernels, ours beside fla's: bash bench/device/profile.sh [B T H]
# after `source bench/device/env.sh` (fla from the carried wheels). Forward, then forward + backward, each in
# its own process: warm-up and fla's autotuning run outside the profiled range (bench/kernels/profile_ncu.py).
# Writes $OUT/ncu_{forward,fwd_bwd}.log (ncu's raw CSV and messages) and .json (the summary per launch).
SHAPE=(${@:-1 8192 32})
SECTIONS=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis)
for what in forward fwd_bwd; do
  extra=(); [ "$what" = fwd_bwd ] && extra=(--backward)
  ncu --profile-from-start off --clock-control none --csv --page raw "${SECTIONS[@]}" \
      --log-file "$OUT/ncu_$what.log" python -m bench.kernels.profile_ncu --shape "${SHAPE[@]}" "${extra[@]}"
  python -m bench.kernels.profile_ncu --summarize "$OUT/ncu_$what.log" --out "$OUT/ncu_$what.json"
done
