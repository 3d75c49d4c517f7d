# Source, then `mps_start` before the GPU jobs of a call and `mps_stop` after them.
#
# Without MPS the sweep's worker processes take turns on the GPU (one context at a time, time-sliced), and a
# recall run's kernels are far too small to fill an H200 on their own: eight workers trained about as many runs
# per minute as one (on an H200: 0.24 GPU-minutes per run; a run alone steps 7-9 times faster than inside
# the sweep). Under NVIDIA's Multi-Process Service the processes share one server context and their kernels run at
# the same time. The daemon is a user process with its pipes under /tmp; it changes no setting of the GPU, and
# `mps_stop` ends it. mps_start checks that a client can reach the GPU through it; if the daemon cannot start or
# a client fails, it stops it and the call goes on without MPS (KDA_EDU_MPS stays unset).
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/kda_edu_mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/kda_edu_mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d \
      && timeout 120 python3 -c "import torch; x = torch.ones(1024, device='cuda'); assert (x @ x).item() == 1024"; then
    export KDA_EDU_MPS=1
    echo "MPS on: server $(echo get_server_list | nvidia-cuda-mps-control)"
  else
    echo "MPS unavailable; going on without it"
    echo quit | nvidia-cuda-mps-control 2>/dev/null
    cat "$CUDA_MPS_LOG_DIRECTORY"/*.log 2>/dev/null | tail -20
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY KDA_EDU_MPS
  fi
}

mps_stop() {
  if [ "${KDA_EDU_MPS:-}" = 1 ]; then
    echo quit | nvidia-cuda-mps-control
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY KDA_EDU_MPS
  fi
}
