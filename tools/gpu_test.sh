#!/usr/bin/env bash
# The whole book on a CUDA machine: the unit suite and every chapter under nbval, with JUnit reports.
#
#   bash tools/gpu_test.sh REPORT_DIR            # python3 must have torch (CUDA), triton, pytest,
#                                                 # pytest-xdist, nbval and the book's packages
#   KDA_EDU_DTYPE=float16 bash tools/gpu_test.sh REPORT_DIR   # force the chapters' GPU dtype (as on a T4)
#   GPU_TEST_STAGES=notebooks bash tools/gpu_test.sh DIR      # one stage only ("unit" or "notebooks")
#
# The stages run one after the other, each alone on the GPU: the chapters' timing and memory checks failed
# when the chapters shared the GPU with the unit suite (seen on an H200). Every chapter keeps its
# cells in one worker (--dist loadfile). The reports are REPORT_DIR/unit.xml and REPORT_DIR/notebooks.xml;
# the logs sit beside them. A stage past its time limit is stopped with SIGINT, so its report is still
# written (with what ran). Exit status: non-zero if a stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: tools/gpu_test.sh REPORT_DIR}
mkdir -p "$out"
# The chapters' kernels start in book/: they find kda_edu, the bench package and tests/ through absolute paths.
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
stages=${GPU_TEST_STAGES:-unit notebooks}
workers=${GPU_TEST_WORKERS:-12}
nb_workers=${GPU_NB_WORKERS:-3}
limit=${GPU_TEST_SECONDS:-540}
python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU: tools/gpu_test.sh is for a GPU machine")' || exit 2

status=0
for stage in $stages; do
  case $stage in
    unit) args=(tests -n "$workers") ;;
    notebooks) args=(-n "$nb_workers" --dist loadfile --nbval-lax --nbval-current-env --nbval-cell-timeout=400
                     --nbval-kernel-startup-timeout=300 book/[0-9][0-9]_*.ipynb) ;;
    *) echo "unknown stage $stage (unit or notebooks)"; exit 2 ;;
  esac
  timeout -s INT -k 30 "$limit" python3 -m pytest -q -p no:cacheprovider --junitxml="$out/$stage.xml" \
    "${args[@]}" >"$out/$stage.log" 2>&1
  rc=$?
  echo "$stage: exit $rc"
  tail -n 2 "$out/$stage.log"
  [ "$rc" = 0 ] || status=1
done
exit $status
