#!/usr/bin/env bash
# The whole book on a CUDA machine: the unit suite and every chapter under nbval, with JUnit reports.
#
#   bash tools/gpu_test.sh REPORT_DIR            # python3 must have torch (CUDA), triton, pytest,
#                                                 # pytest-xdist, nbval and the book's packages
#   KDA_EDU_DTYPE=float16 bash tools/gpu_test.sh REPORT_DIR   # force the chapters' GPU dtype (as on a T4)
#
# Unit tests and notebooks run side by side on the one GPU (each under its own time limit); every
# chapter keeps its cells in one worker (--dist loadfile). The reports are REPORT_DIR/unit.xml and
# REPORT_DIR/notebooks.xml; the logs sit beside them. Exit status: non-zero if either stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: tools/gpu_test.sh REPORT_DIR}
mkdir -p "$out"
# The chapters' kernels start in book/: they find kda_edu (and bench/, tests/) through absolute paths.
export PYTHONPATH="$PWD:$PWD/bench:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
workers=${GPU_TEST_WORKERS:-8}
nb_workers=${GPU_NB_WORKERS:-6}
limit=${GPU_TEST_SECONDS:-540}
python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU: tools/gpu_test.sh is for a GPU machine")' || exit 2

timeout -s INT -k 30 "$limit" python3 -m pytest tests -q -n "$workers" -p no:cacheprovider \
    --junitxml="$out/unit.xml" >"$out/unit.log" 2>&1 &
unit=$!
timeout -s INT -k 30 "$limit" python3 -m pytest -q -n "$nb_workers" --dist loadfile -p no:cacheprovider \
    --nbval-lax --nbval-current-env --nbval-cell-timeout=400 --nbval-kernel-startup-timeout=300 \
    --junitxml="$out/notebooks.xml" book/[0-9][0-9]_*.ipynb >"$out/notebooks.log" 2>&1 &
nb=$!
wait $unit; unit_rc=$?
wait $nb; nb_rc=$?
echo "unit: exit $unit_rc; notebooks: exit $nb_rc"
tail -n 3 "$out/unit.log" "$out/notebooks.log"
[ "$unit_rc" = 0 ] && [ "$nb_rc" = 0 ]
