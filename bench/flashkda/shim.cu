// A C interface to FlashKDA's forward launcher, so that Python can call it through ctypes
// without building a torch extension. FlashKDA (MIT, https://github.com/MoonshotAI/FlashKDA)
// is not part of this repository: build.sh fetches its source and compiles this file with it.
//
// Layouts, as the launcher reads them (T_total = B * T, all tensors contiguous):
//   q, k, v, g, out  bf16 [T_total, H, 128]
//   beta_ht          bf16 [H, T_total]        (beta's logits, transposed: heads first)
//   A_log            fp32 [H],  dt_bias fp32 [H, 128]
//   states           bf16 or fp32 [B, H, 128 (V), 128 (K)], or null
#include <cstdint>
#include <cuda_runtime.h>

#include "fwd.h"

namespace {

constexpr int64_t kChunk = 16;  // rows per tile of FlashKDA's kernels
constexpr int kDim = 128;       // the only head dimension FlashKDA is built for

using bf16 = cutlass::bfloat16_t;

template <bool In, bool Out, bool Fp32>
void launch(const bf16* q, const bf16* k, const bf16* v, const bf16* g, const bf16* beta_ht,
            const void* state_in, void* state_out, bf16* out, void* workspace, float scale,
            int B, int T, int H, const float* A_log, const float* dt_bias, float gate_scale,
            cudaStream_t stream) {
    // Without cu_seqlens every sequence has T tokens, so the tile count is exact.
    const int total_tiles = int(B * ((int64_t(T) + kChunk - 1) / kChunk));
    launch_fwd<kDim, In, Out, Fp32, false>(q, k, v, g, beta_ht, state_in, scale, state_out, out,
                                           workspace, total_tiles, B * T, H, B, nullptr, A_log,
                                           dt_bias, gate_scale, stream);
}

}  // namespace

extern "C" {

// Bytes of scratch memory the launcher needs for n_seq sequences of n_tokens tokens in all.
// Per (head, tile): three bf16 [16, 128] blocks (k and q times their decays, k restored),
// one fp32 [128] chunk total of the gate, two bf16 [16, 16] blocks (the inverse and the
// masked q k^T); tiles are counted generously (one extra per sequence); after them an int32
// prefix over the sequences' tiles, rounded up to 128 bytes.
int64_t fkda_workspace_bytes(int64_t n_tokens, int64_t n_heads, int64_t n_seq) {
    const int64_t tiles = (n_tokens + kChunk - 1) / kChunk + n_seq;
    const int64_t per_tile = 3 * kChunk * kDim * 2 + kDim * 4 + 2 * kChunk * kChunk * 2;
    const int64_t prefix = ((n_seq + 1) * 4 + 127) / 128 * 128;
    return n_heads * tiles * per_tile + prefix;
}

// Runs FlashKDA's forward on `stream`. `lower_bound` is the natural-log gate floor; the
// kernels work in base 2, so it is handed on times log2(e). Returns the CUDA error code of
// the launches (0 when they were accepted).
int fkda_forward(const void* q, const void* k, const void* v, const void* g, const void* beta_ht,
                 const void* state_in, void* state_out, int state_fp32, void* out,
                 void* workspace, float scale, int B, int T, int H, const float* A_log,
                 const float* dt_bias, float lower_bound, cudaStream_t stream) {
    const float gate_scale = float(double(lower_bound) * 1.4426950408889634);
    auto q_ = static_cast<const bf16*>(q), k_ = static_cast<const bf16*>(k);
    auto v_ = static_cast<const bf16*>(v), g_ = static_cast<const bf16*>(g);
    auto b_ = static_cast<const bf16*>(beta_ht);
    auto o_ = static_cast<bf16*>(out);
    const bool in = state_in != nullptr, fin = state_out != nullptr;
#define FKDA_LAUNCH(IN, OUT, FP32)                                                          \
    launch<IN, OUT, FP32>(q_, k_, v_, g_, b_, state_in, state_out, o_, workspace, scale, B, \
                          T, H, A_log, dt_bias, gate_scale, stream)
    if (!in && !fin) {
        FKDA_LAUNCH(false, false, false);
    } else if (state_fp32) {
        if (in && fin) FKDA_LAUNCH(true, true, true);
        else if (in) FKDA_LAUNCH(true, false, true);
        else FKDA_LAUNCH(false, true, true);
    } else {
        if (in && fin) FKDA_LAUNCH(true, true, false);
        else if (in) FKDA_LAUNCH(true, false, false);
        else FKDA_LAUNCH(false, true, false);
    }
#undef FKDA_LAUNCH
    return int(cudaGetLastError());
}

}  // extern "C"
