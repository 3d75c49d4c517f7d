# Continue the GPU recall sweep: sweep.sh GPUS WORKERS MAX_MINUTES TIMEOUT_S [TASK:LEN ...], GPUS e.g. 1 or 0,1
# Runs not started by MAX_MINUTES stay pending, and so do runs not expected to end 30 s before TIMEOUT_S (the
# file's own timings; the longest start first); runs still going at TIMEOUT_S are lost. Logs and results go to $OUT;
# copy $OUT/recall_gpu.json back into bench/results/ after the call (the .csv beside it is for reading by eye and
# is not committed). Keep TIMEOUT_S below the call's limit_s, which is less than timeout_s when little device
# time is left.
# SWEEP_OPTS (environment) adds options, e.g. SWEEP_OPTS="--runs-per-worker 20"; the log ends with --cost's line.
source bench/device/env.sh
GPU=$1; WORKERS=$2; MAXMIN=$3; TMO=$4; shift 4
TAG=${GPU//,/_}  # file names that come back from $OUT: letters, digits, . _ - only
export CUDA_VISIBLE_DEVICES=$GPU
nvidia-smi dmon -s u -d 15 > "$OUT/dmon_$TAG.log" 2>&1 &
DMON=$!
SKIP=()
[ $# -gt 0 ] && SKIP=(--skip "$@")
# The sweep writes its file in $OUT itself (atomically, after every run): a call stopped at its limit still
# brings back every finished run (a copy at the end would never run).
cp bench/results/recall_gpu.json "$OUT/recall_gpu.json"
timeout "$TMO" python -m kda_edu.training.sweep --preset gpu --out "$OUT/recall_gpu.json" \
    --workers "$WORKERS" --max-minutes "$MAXMIN" --deadline-minutes "$(python3 -c "print(($TMO - 30) / 60)")" \
    $SWEEP_OPTS "${SKIP[@]}" > "$OUT/sweep_$TAG.log" 2>&1
echo "sweep exit $?" >> "$OUT/sweep_$TAG.log"
rm -f "$OUT/recall_gpu.tmp"
python -m kda_edu.training.sweep --preset gpu --out "$OUT/recall_gpu.json" --cost >> "$OUT/sweep_$TAG.log" 2>&1
kill $DMON
