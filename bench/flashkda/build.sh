#!/usr/bin/env bash
# Builds .flashkda/lib/libflashkda_shim.so: FlashKDA's forward (MIT, github.com/MoonshotAI/FlashKDA)
# behind the C functions of bench/flashkda/shim.cu, for the H200 (sm_90a). Needs nvcc (CUDA >= 12.9),
# no GPU and no torch. The sources go to .flashkda/src, which git ignores: they are never committed.
#
#   bash bench/flashkda/build.sh            # sources from the local mirrors (FLASHKDA_GIT, CUTLASS_GIT)
#   NVCC=/path/to/nvcc bash bench/flashkda/build.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DEST="$ROOT/.flashkda"
SRC="$DEST/src"
FLASHKDA_GIT="${FLASHKDA_GIT:-/work/.mirror/MoonshotAI+FlashKDA/repo}"
CUTLASS_GIT="${CUTLASS_GIT:-/work/.mirror/NVIDIA+cutlass/repo}"
FLASHKDA_REV="${FLASHKDA_REV:-HEAD}"
NVCC="${NVCC:-nvcc}"

if [ ! -f "$SRC/flashkda/csrc/smxx/fwd_launch.cu" ]; then
  mkdir -p "$SRC/flashkda" "$SRC/cutlass"
  git -C "$FLASHKDA_GIT" archive "$FLASHKDA_REV" csrc LICENSE | tar -x -C "$SRC/flashkda"
  git -C "$FLASHKDA_GIT" rev-parse "$FLASHKDA_REV" > "$SRC/flashkda/COMMIT"
  # FlashKDA pins CUTLASS as a submodule; take exactly that commit.
  CUTLASS_REV="$(git -C "$FLASHKDA_GIT" ls-tree "$FLASHKDA_REV" cutlass | awk '{print $3}')"
  git -C "$CUTLASS_GIT" archive "$CUTLASS_REV" include tools/util/include examples/common LICENSE.txt \
    | tar -x -C "$SRC/cutlass"
  echo "$CUTLASS_REV" > "$SRC/cutlass/COMMIT"
  # A partial mirror can lack blobs (git then complains about unrelated paths too): count what arrived.
  want=$(git -C "$CUTLASS_GIT" ls-tree -r --name-only "$CUTLASS_REV" \
    include tools/util/include examples/common LICENSE.txt | wc -l)
  got=$(find "$SRC/cutlass" -type f ! -name COMMIT | wc -l)
  [ "$want" -eq "$got" ] || { echo "CUTLASS extraction incomplete: $got of $want files" >&2; exit 1; }
fi

# FlashKDA's setup.py passes these to nvcc (minus the arch list, fixed to the H200 here).
FLAGS=(
  -O3 -std=c++17
  -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__
  -U__CUDA_NO_HALF2_OPERATORS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__
  --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math
  --ptxas-options=-v,--register-usage-level=10,--warn-on-spills
  -lineinfo --threads "${NVCC_THREADS:-2}"
  -gencode arch=compute_90a,code=sm_90a
  -Xcompiler -fPIC
  -I"$SRC/cutlass/include" -I"$SRC/cutlass/examples/common" -I"$SRC/cutlass/tools/util/include"
  -I"$SRC/flashkda/csrc"
)

mkdir -p "$DEST/obj" "$DEST/lib"
start=$(date +%s)
compiled=()
compile() {  # source, object name: recompiled when the object is missing or older than this script or the source
  local obj="$DEST/obj/$2.o"
  if [ "$obj" -nt "$1" ] && [ "$obj" -nt "$0" ]; then return; fi
  compiled+=("$2")
  "$NVCC" "${FLAGS[@]}" -c "$1" -o "$obj" 2> "$DEST/lib/ptxas_$2.log" || { cat "$DEST/lib/ptxas_$2.log"; exit 1; }
}
compile "$SRC/flashkda/csrc/smxx/fwd_launch.cu" fwd_launch  # FlashKDA's launcher and kernels: minutes
compile "$ROOT/bench/flashkda/shim.cu" shim
if [ ${#compiled[@]} -eq 0 ] && [ -f "$DEST/lib/libflashkda_shim.so" ]; then
  echo "$DEST/lib is up to date (build_info.json describes it)"; exit 0
fi
"$NVCC" -shared -cudart static -gencode arch=compute_90a,code=sm_90a \
  "$DEST/obj/fwd_launch.o" "$DEST/obj/shim.o" -o "$DEST/lib/libflashkda_shim.so"
seconds=$(( $(date +%s) - start ))

# What the benchmark records beside its timings. .flashkda/lib is what a GPU machine needs (carry it).
cat > "$DEST/lib/build_info.json" <<JSON
{
  "flashkda_commit": "$(cat "$SRC/flashkda/COMMIT")",
  "cutlass_commit": "$(cat "$SRC/cutlass/COMMIT")",
  "nvcc": "$("$NVCC" --version | grep -o "release.*")",
  "arch": "sm_90a",
  "shim_sha256": "$(sha256sum "$ROOT/bench/flashkda/shim.cu" | cut -d' ' -f1)",
  "so_bytes": $(stat -c %s "$DEST/lib/libflashkda_shim.so"),
  "build_seconds": $seconds,
  "compiled_this_run": "${compiled[*]}"
}
JSON
echo "built $DEST/lib/libflashkda_shim.so in ${seconds}s"
grep -hE "registers|spill" "$DEST"/lib/ptxas_*.log | sort | uniq -c | sort -rn | head -20 || true
