# Issue 22's longer MQAR runs and the nondeterminism probe, beside the sweep in one call (bench/NOTES.md,
# session 13):   DEADLINE_MIN=8 bash bench/device/issue22_long.sh &   # after env.sh and mps.sh's mps_start
# Each run of LONG_RUNS ("name:options", defaults below) trains in segments with long_recall_run.py; its
# checkpoint and JSON live in .ckpt/ (git-ignored: carry it to the next call, which continues every unfinished
# run). PROBE=1 also runs nondeterminism_probe.py (KDA, MQAR 256, with and without deterministic algorithms).
# The JSON and logs of .ckpt/ end in $OUT/long.tgz; the checkpoints stay on the machine (too large to come
# back from $OUT: session 13 lost a 32 MB tarball), so a later call continues them only while it stays warm.
mkdir -p .ckpt
E=bench/experiments
MQ=(--task mqar --lr 1e-3)
if [ "${PROBE:-0}" = 1 ]; then
  (python $E/nondeterminism_probe.py "${MQ[@]}" --seq-len 256 --mixer kda --out .ckpt/nondet_kda_mqar256.json
   python $E/nondeterminism_probe.py "${MQ[@]}" --seq-len 256 --mixer kda --deterministic \
     --out .ckpt/nondet_kda_mqar256_deterministic.json) > .ckpt/nondet.log 2>&1 &
fi
DEFAULT_RUNS=(
  "kda_mqar1024_steps6000:--seq-len 1024 --mixer kda --steps 6000"
  "gdn_mqar1024_steps6000:--seq-len 1024 --mixer gated_deltanet --steps 6000"
  "kda_mqar1024_head128:--seq-len 1024 --mixer kda --head-dim 128"
  "gdn_mqar1024_head128:--seq-len 1024 --mixer gated_deltanet --head-dim 128"
  "kda_mqar512_steps6000:--seq-len 512 --mixer kda --steps 6000"
  "gdn_mqar512_steps6000:--seq-len 512 --mixer gated_deltanet --steps 6000"
)
if [ -n "${LONG_RUNS:-}" ]; then mapfile -t RUNS <<< "$LONG_RUNS"; else RUNS=("${DEFAULT_RUNS[@]}"); fi
for r in "${RUNS[@]}"; do
  name=${r%%:*}; opts=${r#*:}
  # shellcheck disable=SC2086  # opts is a list of options
  python $E/long_recall_run.py "${MQ[@]}" $opts --checkpoint ".ckpt/$name.safetensors" \
    --deadline-minutes "${DEADLINE_MIN:-8}" --out ".ckpt/$name.json" >> ".ckpt/$name.log" 2>&1 &
done
wait
tar -czf "$OUT/long.tgz" --exclude='*.safetensors' --exclude='*.pt' .ckpt
