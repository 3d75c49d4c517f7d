# Source at the start of every call on the GPU machine: install the carried wheels (fla) and set the paths.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:.:tests FLA_FLASH_KDA=0 PYTHONUNBUFFERED=1
export TRITON_CACHE_AUTOTUNING=1  # fla autotunes a shape once per machine, not once per process (Triton >= 3.3)
# A Triton cache carried from an earlier call (.triton_cache, git-ignored): kernels compiled there are not
# compiled again. Copy "$TRITON_CACHE_DIR" to $OUT at the end of a call to bring it back.
if [ -d .triton_cache ]; then export TRITON_CACHE_DIR=$PWD/.triton_cache; fi
