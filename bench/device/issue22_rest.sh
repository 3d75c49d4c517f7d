# Issue 22's remainder in one call (bench/NOTES.md, session 14), after `source bench/device/env.sh`:
#   bash bench/device/issue22_rest.sh            (carry .whl and .builds: c08120f and 3590420 exported)
# Under MPS, at the same time:
# - the DeltaNet NaN (MQAR 1024, 3e-3, seed 0) on the build that recorded it (c08120f) and on 3590420, each
#   as its sweep ran it (its own run_one, the CUDA graph) and with --watch (global hooks name the first
#   non-finite value; no graph; WATCH_STEPS steps, WATCH_COPIES copies, each saving the inputs of the first
#   module whose output went non-finite from finite inputs: PLAIN=0 skips the graph runs);
# - the MQAR 1024 runs of LONG_RUNS through issue22_long.sh (checkpoints in .ckpt/ stay on the machine).
# Results in $OUT/bisect.tgz and $OUT/long.tgz.
source bench/device/mps.sh
mps_start
mkdir -p /tmp/i22
E=bench/experiments
NAN=(--task mqar --seq-len 1024 --mixer deltanet --lr 3e-3)
for b in ${NAN_BUILDS:-c08120f 3590420}; do
  [ "${PLAIN:-1}" = 1 ] && python $E/bisect_recall_run.py --build .builds/$b "${NAN[@]}" \
    --out /tmp/i22/nan_$b.json > /tmp/i22/nan_$b.log 2>&1 &
  for i in $(seq 1 "${WATCH_COPIES:-1}"); do  # the NaN's step varies from run to run: several copies
    python $E/bisect_recall_run.py --build .builds/$b "${NAN[@]}" --watch --watch-steps "${WATCH_STEPS:-400}" \
      --capture /tmp/i22/capture_${b}_$i.pt --out /tmp/i22/nan_watch_${b}_$i.json \
      > /tmp/i22/nan_watch_${b}_$i.log 2>&1 &
  done
done
bash bench/device/issue22_long.sh &
wait
mps_stop
tar -czf "$OUT/bisect.tgz" -C /tmp/i22 .
ls -la /tmp/i22 .ckpt
