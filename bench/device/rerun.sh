#!/usr/bin/env bash
# One device call that re-runs what changed since the last full H200 run (tools/gpu_test.sh), so the
# committed reports can be completed with tools/merge_junit.py instead of re-running the whole book:
#
#   NOTEBOOKS="04_gated_delta 08_chunk_kernel" TESTS="tests/a.py tests/b.py" bash bench/device/rerun.sh
#
# Order: BEFORE (a command, e.g. a benchmark whose JSON a chapter reads: it writes into bench/results/ here,
# so the chapters see it) -> the chapters under nbval (-n one per chapter, --dist loadfile), beside them the
# chapters among them that read kda_edu.device.DTYPE with KDA_EDU_DTYPE=float16 and float32 -> TESTS alone on
# the GPU (-n TEST_WORKERS) -> AFTER (a command, e.g. an experiment). Writes $OUT/rerun.tar.gz: JUnit reports, logs, and bench/results/ files the
# BEFORE and AFTER commands wrote. Run from the repository root, carrying .whl.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
export PYTHONPATH="$PWD:$PWD/tests:$PYTHONPATH"
OUT=${OUT:?set OUT}
r=$(mktemp -d)
mkdir -p "$r/results"
nvidia-smi --query-gpu=name,driver_version --format=csv >"$r/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >>"$r/gpu.txt"
git rev-parse HEAD >>"$r/gpu.txt" 2>/dev/null
touch "$r/stamp"
if [ -n "${BEFORE:-}" ]; then
  timeout "${BEFORE_SECONDS:-150}" bash -c "$BEFORE" >"$r/before.log" 2>&1
  echo "before: exit $?" >>"$r/gpu.txt"
fi
nb_args=(--nbval-lax --nbval-current-env --nbval-cell-timeout=400 --nbval-kernel-startup-timeout=300)
if [ -n "${NOTEBOOKS:-}" ]; then
  nbs=(); for n in $NOTEBOOKS; do nbs+=("book/$n.ipynb"); done
  dtype_nbs=$(grep -lw "DTYPE" "${nbs[@]/%.ipynb/.md}" 2>/dev/null | sed 's/\.md$/.ipynb/')
  for dt in float16 float32; do
    [ -n "$dtype_nbs" ] || break
    KDA_EDU_DTYPE=$dt timeout -s INT -k 30 "${NB_SECONDS:-330}" python3 -m pytest -q -p no:cacheprovider \
      "${nb_args[@]}" --junitxml="$r/notebooks_$dt.xml" $dtype_nbs >"$r/notebooks_$dt.log" 2>&1 &
  done
  timeout -s INT -k 30 "${NB_SECONDS:-330}" python3 -m pytest -q -p no:cacheprovider -n "${#nbs[@]}" \
    --dist loadfile "${nb_args[@]}" --junitxml="$r/notebooks.xml" "${nbs[@]}" >"$r/notebooks.log" 2>&1
  echo "notebooks: exit $?" >>"$r/gpu.txt"
  wait
fi
if [ -n "${TESTS:-}" ]; then
  timeout -s INT -k 30 "${TEST_SECONDS:-150}" python3 -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-8}" \
    --junitxml="$r/unit.xml" $TESTS >"$r/unit.log" 2>&1
  echo "unit: exit $?" >>"$r/gpu.txt"
fi
if [ -n "${AFTER:-}" ]; then
  timeout "${AFTER_SECONDS:-150}" bash -c "$AFTER" >"$r/after.log" 2>&1
  echo "after: exit $?" >>"$r/gpu.txt"
fi
find bench/results -newer "$r/stamp" -type f -exec cp {} "$r/results/" \;
tar -czf "$OUT/rerun.tar.gz" -C "$r" .
cat "$r/gpu.txt"
tail -n 3 "$r"/*.log
