# Issue 22's one-off GPU experiments, run beside the sweep in one call (bench/NOTES.md, session 12):
#   BUILDS="3590420 e059318" bash bench/device/issue22_probes.sh &   # after env.sh (and mps.sh's mps_start)
# BUILDS: exported builds (bench/device/export_builds.sh; carry `.builds`) that each train Gated DeltaNet's
# collapsing run (Palindrome 128, 1e-3, seed 0) with their own run_one and preset. KDA_REPEAT: copies of KDA's
# MQAR 256 run (1e-3, seed 0) exactly as the sweep trains it, plus one with deterministic algorithms (KDA_VARIANTS picks others), to
# measure the GPU path's run-to-run spread. Logs and JSON go to $OUT/probes/, packed into $OUT/probes.tgz once
# every job has ended.
P="$OUT/probes"; mkdir -p "$P"
E=bench/experiments
GDN=(--task palindrome --seq-len 128 --mixer gated_deltanet --lr 1e-3)
KDA=(--task mqar --seq-len 256 --mixer kda --lr 1e-3)
for b in $BUILDS; do
  python $E/bisect_recall_run.py --build .builds/$b "${GDN[@]}" --out "$P/bisect_$b.json" > "$P/bisect_$b.log" 2>&1 &
done
if [ "${KDA_REPEAT:-0}" -gt 0 ]; then
  python $E/ablate_recall_run.py "${KDA[@]}" --variants ${KDA_VARIANTS:-preset deterministic} --repeat "$KDA_REPEAT" \
    --out "$P/repeat_kda_mqar256.json" > "$P/repeat_kda_mqar256.log" 2>&1 &
fi
wait
tar -czf "$OUT/probes.tgz" -C "$OUT" probes && rm -rf "$P"
