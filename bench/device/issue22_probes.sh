# Issue 22's one-off GPU experiments, run beside the sweep in one call (bench/NOTES.md, plan after session 11):
#   bash bench/device/issue22_probes.sh &   # after `source bench/device/env.sh` (and mps.sh's mps_start)
# Needs `.builds/` carried (bench/device/export_builds.sh c08120f 2422adb). Each job logs to $OUT/probes/;
# $OUT/probes.tgz holds the short jobs' logs and JSON files once they have ended, $OUT/probes_x4.tgz the long one's.
P="$OUT/probes"; mkdir -p "$P"; SHORT=()
E=bench/experiments
GDN=(--task palindrome --seq-len 128 --mixer gated_deltanet --lr 1e-3)
KDA=(--task mqar --seq-len 256 --mixer kda --lr 1e-3)
# The collapse: the build of session 5 and the fix of the one-chunk fault, each with its own run_one and preset.
for b in c08120f 2422adb; do
  python $E/bisect_recall_run.py --build .builds/$b "${GDN[@]}" --out "$P/bisect_$b.json" > "$P/bisect_$b.log" 2>&1 &
  SHORT+=($!)
done
# The same run on the current build under the same sharing as the sweep (MPS or not): it reached 0.958 alone.
python $E/ablate_recall_run.py "${GDN[@]}" --variants preset --out "$P/ablate_gdn_pal128_shared.json" \
  > "$P/ablate_gdn_pal128_shared.log" 2>&1 &
SHORT+=($!)
# KDA's MQAR drop after the weight-decay fix: the old rule back (dt_bias decayed), seeds 0 and 1, and four
# times the steps under the new rule (seed 0); separate files so the short ones land first.
python $E/ablate_recall_run.py "${KDA[@]}" --variants preset decayed_dt_bias --out "$P/ablate_kda_mqar256.json" \
  > "$P/ablate_kda_mqar256.log" 2>&1 &
SHORT+=($!)
python $E/ablate_recall_run.py "${KDA[@]}" --seed 1 --variants decayed_dt_bias \
  --out "$P/ablate_kda_mqar256_seed1.json" > "$P/ablate_kda_mqar256_seed1.log" 2>&1 &
SHORT+=($!)
mkdir -p "$P/x4"
python $E/ablate_recall_run.py "${KDA[@]}" --variants steps_x4 --out "$P/x4/ablate_kda_mqar256_x4.json" \
  > "$P/x4/ablate_kda_mqar256_x4.log" 2>&1 &
LONG=$!
wait "${SHORT[@]}"
tar -czf "$OUT/probes.tgz" -C "$OUT" --exclude probes/x4 probes
wait $LONG
tar -czf "$OUT/probes_x4.tgz" -C "$P" x4 && rm -rf "$P"
