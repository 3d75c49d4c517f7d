"""Session 15's crash, isolated: `_chunk_wu_kernel` with bf16 products (PREC="bf16") on one chunk, K = 32, at V = 16
and V = 32, each in its own process (an illegal address spoils the process's CUDA context).

    python bench/experiments/wu_bf16_repro.py            # runs both cases as subprocesses, prints each outcome
"""

import subprocess
import sys

import torch


def case(V, prec, kd_total):
    from kda_edu.kernels.chunk import _chunk_wu_kernel

    torch.manual_seed(0)
    dev, BT, K = "cuda", 64, 32
    k = torch.randn(1, BT, 1, K, device=dev).bfloat16()
    v = torch.randn(1, BT, 1, V, device=dev).bfloat16()
    g = -torch.rand(1, BT, 1, K, device=dev)
    beta = torch.rand(1, BT, 1, device=dev).bfloat16()
    x = torch.eye(BT, device=dev)
    w, kd = (torch.empty(BT, K, device=dev, dtype=torch.bfloat16) for _ in range(2))
    u = torch.empty(BT, V, device=dev, dtype=torch.bfloat16)
    gl = torch.empty(1, K, device=dev)
    _chunk_wu_kernel[(1, 1)](
        k, v, g, beta, x, w, u, kd, gl, None, BT, 1, 1, K, V, 1, 1, 0, 0, 1,
        BT=BT, BK=K, BV=V, KC=32, VC=min(32, V), PREC=prec, KD_TOTAL=kd_total, IS_VARLEN=False, num_warps=4,
    )  # fmt: skip
    torch.cuda.synchronize()
    ref = beta.float()[0, :, 0, None] * v.float()[0, :, 0]
    print(
        f"V={V} PREC={prec} KD_TOTAL={kd_total}: ok, max |u - beta v| = {(u.float() - ref).abs().max().item():.2e}"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        case(int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1")
    else:
        for args in [("16", "bf16", "1"), ("16", "bf16", "0"), ("16", "tf32", "1"), ("32", "bf16", "1")]:
            r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
            print(" ".join(args), "rc", r.returncode, (r.stdout + r.stderr).strip().splitlines()[-1:])
