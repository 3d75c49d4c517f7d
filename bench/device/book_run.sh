#!/usr/bin/env bash
# One device call that produces the H200 reports of the whole book, then the short benchmarks the chapters
# read, all of this build. Run from the repository root on the GPU machine, carrying .whl:
#
#   GPU_TEST_STAGES=unit bash bench/device/book_run.sh        (writes to $OUT; about 9 minutes)
#   GPU_TEST_STAGES=notebooks bash bench/device/book_run.sh   (a second call: the chapters alone on the GPU)
#
# 1. tools/gpu_test.sh: the unit suite or every chapter under nbval (default dtype); beside it, the
#    chapters that read kda_edu.device.DTYPE again with KDA_EDU_DTYPE=float16 (a T4's choice) and float32.
#    Chapter 14's experiment at GPU size runs beside them (it reports losses, not times).
# 2. On the then quiet GPU: bench/kernels/tf32_precision.py (chapter 7) and bench/kernels/cp_shard_costs.py (chapter 15).
# What comes back (at most 8 files): the JUnit reports, the two benchmark JSONs and logs.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
export PYTHONPATH="$PWD:$PWD/tests:$PYTHONPATH"
OUT=${OUT:?set OUT}
logs=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$logs/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >>"$logs/gpu.txt"


dtype_chapters=$(grep -lw "DTYPE" book/[0-9][0-9]_*.md | sed 's/\.md$/.ipynb/')
for dt in float16 float32; do
  KDA_EDU_DTYPE=$dt timeout -s INT -k 30 "${FORCED_SECONDS:-420}" python3 -m pytest -q -p no:cacheprovider \
    --nbval-lax --nbval-current-env --nbval-cell-timeout=400 --nbval-kernel-startup-timeout=300 \
    --junitxml="$OUT/notebooks_$dt.xml" $dtype_chapters >"$logs/notebooks_$dt.log" 2>&1 &
done
# chapter 14's experiment at GPU size (losses only, so it may share the GPU with the tests)
timeout "${K3_SECONDS:-400}" python3 -m bench.experiments.k3_experiment --gpu --budget-s "${K3_BUDGET:-300}" \
  --out "$OUT/k3_gpu.json" >"$logs/k3.log" 2>&1 &
GPU_TEST_WORKERS=${GPU_TEST_WORKERS:-11} GPU_NB_WORKERS=${GPU_NB_WORKERS:-5} GPU_TEST_SECONDS=${GPU_TEST_SECONDS:-420} \
  bash tools/gpu_test.sh "$logs/h200_tests" >"$logs/gpu_test.log" 2>&1
echo "gpu_test: exit $?" >>"$logs/gpu.txt"
wait
cp "$logs"/h200_tests/*.xml "$OUT/" 2>/dev/null

timeout 50 python3 -m bench.kernels.tf32_precision --out "$OUT/h200_tf32.json" >"$logs/tf32.log" 2>&1
timeout "${CP_SECONDS:-80}" python3 -m bench.kernels.cp_shard_costs --max-seconds "${CP_ROWS_SECONDS:-45}" \
  --out "$OUT/h200_cp_shard_costs.json" >"$logs/cp.log" 2>&1
tar -czf "$OUT/logs.tar.gz" -C "$logs" .
cat "$logs/gpu.txt"
tail -n 2 "$logs/h200_tests/unit.log" "$logs/h200_tests/notebooks.log" "$logs"/notebooks_float*.log
