"""Find which kernel of chunk_bwd.py's backward goes wrong: every buffer each kernel writes, against a float64
PyTorch recomputation of the same quantity, and against a second run of the same backward (bit for bit).

The kernels have no atomics and no program writes what another program of its launch reads, so two runs on
the same inputs must give identical bits; a difference means a race inside a program (shared memory, async
copies, wgmma) or a compiler bug. An error against float64 far above the dtype's rounding (bf16 about 1e-2,
float32 about 1e-5) names the first kernel whose output is wrong; the later kernels inherit it.

    python bench/diagnostics/diagnose_bwd.py                         # GPU test case (2, 1000, 2, 4, 128, 64), bf16 + fp32
    python bench/diagnostics/diagnose_bwd.py --dtype fp32 --knobs lv_warps=4,lk_warps=8
    python bench/diagnostics/diagnose_bwd.py --shape 1,130,1,2,32,16 --dtype fp32   # small enough for the interpreter
    TRITON_INSTRUMENTATION_MODE=consan python bench/diagnostics/diagnose_bwd.py --shape 1,200,1,2,128,64 --repeat 1
        # Triton's concurrency sanitizer (3.6 has it): a device-side assert at a shared-memory race

Buffers, by kernel (layouts as in chunk_bwd.py; only the valid K / V columns are compared):
    prepare (STORE_X): w u qg kd aqk gl x        states: h (S0) vn (U)        dstates: dh dvn dh0
    local_v: dv, dA (sum of the key blocks' shares), dAqk, dgc_end, dbeta share (sum), dq / dk / dgc partial
    local_k: dq dk dg (before the head-group sum), dbeta share (sum)
"""

import argparse
import functools
import inspect
import os
import sys

import torch

# this file is bench/diagnostics/<name>.py: the repository is two folders up
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# this checkout's kda_edu, and the tests' helpers
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "kernels")]

from kda_edu.kernels import chunk_bwd, chunk_kda  # noqa: E402  (after the sys.path set-up above)

KERNEL_OUTPUTS = {  # kernel name in chunk_bwd -> the arguments it writes (captured right after its launch)
    "_chunk_prepare_kernel": ("w", "u", "qg", "kd", "aqk", "gl", "x_inv"),
    "_states_kernel": ("h", "vn"),
    "_dstates_kernel": ("dh", "dvn", "dh0"),
    "_local_v_kernel": ("dv", "dq", "dk", "dgc", "dgc_end", "db_part", "dA_part", "dAqk"),
    "_local_k_kernel": ("dq", "dk", "dgc", "dbeta_part"),
}
SHORT = {"_chunk_prepare_kernel": "prepare", "_states_kernel": "states", "_dstates_kernel": "dstates",
         "_local_v_kernel": "local_v", "_local_k_kernel": "local_k"}  # fmt: skip


class _Spy:
    """Stands in for a kernel in chunk_bwd's namespace: launches it, then clones the buffers it wrote."""

    def __init__(self, name, kernel, store):
        self.name, self.kernel, self.store = name, kernel, store
        self.arg_names = list(inspect.signature(kernel.fn).parameters)

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            out = launch(*args, **kwargs)
            for arg in KERNEL_OUTPUTS[self.name]:
                i = self.arg_names.index(arg)
                x = args[i] if i < len(args) else kwargs.get(arg)
                if x is not None:
                    self.store[f"{SHORT[self.name]}.{arg}"] = x.detach().clone()
            return out

        return run


def capture(inputs, do, dht, dtype, with_state, knobs):
    """One forward + backward through chunk_kda with every kernel's outputs captured."""
    store = {}
    originals = {n: getattr(chunk_bwd, n) for n in KERNEL_OUTPUTS}
    for n, k in originals.items():
        setattr(chunk_bwd, n, _Spy(n, k, store))
    bwd = chunk_bwd.chunk_kda_bwd
    chunk_bwd.chunk_kda_bwd = functools.partial(bwd, **knobs)
    try:
        xs = [x.detach().clone() for x in inputs[: 6 if with_state else 5]]
        xs[:3] = [x.to(dtype) for x in xs[:3]]
        xs = [x.requires_grad_() for x in xs]
        o, ht = chunk_kda(*xs[:5], initial_state=xs[5] if with_state else None, output_final_state=True)
        ((o.double() * do.double()).sum() + (ht.double() * dht.double()).sum()).backward()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        for n, k in originals.items():
            setattr(chunk_bwd, n, k)
        chunk_bwd.chunk_kda_bwd = bwd
    store["grads"] = [x.grad.detach().clone() for x in xs]
    return store


def _chunks(x, NT, BT):
    """[B, T, HV, C] -> [HV, B * NT, BT, C], zero rows past T (the kernels' padding)."""
    B, T, HV, C = x.shape
    xp = x.new_zeros(B, NT * BT, HV, C)
    xp[:, :T] = x
    return xp.view(B, NT, BT, HV, C).permute(3, 0, 1, 2, 4).reshape(HV, B * NT, BT, C)


def _unchunk(x, B, T):
    """[HV, B * NT, BT, C] -> [B, T, HV, C]."""
    HV, NCH, BT, C = x.shape
    return x.view(HV, B, NCH // B, BT, C).permute(1, 2, 3, 0, 4).reshape(B, -1, HV, C)[:, :T]


def reference(q, k, v, g, beta, scale, h0, do, dht, BT=64):
    """Every intermediate of the backward in float64, in the kernels' [HV, chunk, row, column] order."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT = -(-T // BT)
    rep = HV // H
    q, k, v, g, beta, do = (x.double() for x in (q, k, v, g, beta, do))
    qh, kh = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    Q, Kc, Vc, Gc, dO = (_chunks(x, NT, BT) for x in (qh * scale, kh, v, g, do))
    bt = _chunks(beta[..., None], NT, BT)[..., 0]  # [HV, NCH, BT]
    gc = Gc.cumsum(2)
    r = torch.arange(BT, device=q.device)
    lower, strict = r[:, None] >= r[None, :], r[:, None] > r[None, :]
    # exp(gc_i - gc_j) for i >= j (exponent <= 0); zero above the diagonal
    ex = torch.where(lower[..., None], gc[..., :, None, :] - gc[..., None, :, :], float("-inf")).exp()
    A = torch.einsum("...ic,...jc,...ijc->...ij", Kc, Kc, ex) * strict
    Aqk = torch.einsum("...ic,...jc,...ijc->...ij", Q, Kc, ex) * lower
    del ex
    eye = torch.eye(BT, dtype=A.dtype, device=A.device)
    X = torch.linalg.solve_triangular(
        eye + bt[..., None] * A, eye.expand_as(A), upper=False, unitriangular=True
    )
    eg, gl = gc.exp(), gc[..., -1, :].exp()  # gl [HV, NCH, K]
    ed = (gc[..., -1:, :] - gc).exp()
    w = X @ (bt[..., None] * Kc * eg)
    u = X @ (bt[..., None] * Vc)
    qg, kd = Q * eg, Kc * ed
    # the two passes, per (value head, batch row), over its NT chunks
    sh = lambda x: x.view(HV, B, NT, *x.shape[2:])  # noqa: E731
    S = (h0.double().permute(1, 0, 2, 3).clone() if h0 is not None
         else torch.zeros(HV, B, K, V, dtype=torch.float64, device=q.device))  # fmt: skip
    S0 = torch.empty(HV, B, NT, K, V, dtype=torch.float64, device=q.device)
    U = torch.empty_like(sh(u))
    for n in range(NT):
        S0[:, :, n] = S
        U[:, :, n] = sh(u)[:, :, n] - sh(w)[:, :, n] @ S
        S = sh(gl)[:, :, n, :, None] * S + sh(kd)[:, :, n].transpose(-1, -2) @ U[:, :, n]
    dS = dht.double().permute(1, 0, 2, 3).clone() if dht is not None else torch.zeros_like(S)
    dSn, dU = torch.empty_like(S0), torch.empty_like(U)
    for n in reversed(range(NT)):
        dSn[:, :, n] = dS
        dU[:, :, n] = sh(Aqk)[:, :, n].transpose(-1, -2) @ sh(dO)[:, :, n] + sh(kd)[:, :, n] @ dS
        dS = (sh(gl)[:, :, n, :, None] * dS + sh(qg)[:, :, n].transpose(-1, -2) @ sh(dO)[:, :, n]
              - sh(w)[:, :, n].transpose(-1, -2) @ dU[:, :, n])  # fmt: skip
    fl = lambda x: x.reshape(HV, B * NT, *x.shape[3:])  # noqa: E731
    S0, U, dSn, dU = fl(S0), fl(U), fl(dSn), fl(dU)
    # local_v
    dup = X.transpose(-1, -2) @ dU
    dwp = X.transpose(-1, -2) @ (-dU @ S0.transpose(-1, -2))
    dA = -(dup @ u.transpose(-1, -2) + dwp @ w.transpose(-1, -2)) * strict
    dAqk = (dO @ U.transpose(-1, -2)) * lower
    dkd = U @ dSn.transpose(-1, -2)
    dgc_end = (Kc * ed * dkd).sum(-2) + gl * (S0 * dSn).sum(-1)
    db = (dup * Vc).sum(-1) + (dwp * Kc * eg).sum(-1)
    return {
        "prepare.w": w, "prepare.u": u, "prepare.qg": qg, "prepare.kd": kd, "prepare.aqk": Aqk,
        "prepare.gl": gl, "prepare.x_inv": X, "states.h": S0, "states.vn": U, "dstates.dh": dSn,
        "dstates.dvn": dU, "dstates.dh0": dS.permute(1, 0, 2, 3),
        "local_v.dv": _unchunk(bt[..., None] * dup, B, T), "local_v.dA": dA, "local_v.dAqk": dAqk,
        "local_v.dgc_end": dgc_end, "local_v.dbeta": _unchunk(db[..., None], B, T)[..., 0],
    }  # fmt: skip


def kernel_view(name, x, B, T, H, HV, K, V, BT=64):
    """A captured buffer in the reference's layout (valid columns only)."""
    NCH = B * (-(-T // BT))
    kind = name.split(".")[1]
    if kind in ("w", "qg", "kd"):
        return x.view(HV, NCH, BT, -1)[..., :K]
    if kind in ("u", "vn", "dvn"):
        return x.view(HV, NCH, BT, -1)[..., :V]
    if kind in ("aqk", "x_inv", "dAqk"):
        return x.view(HV, NCH, BT, BT)
    if kind in ("gl", "dgc_end"):
        return x.view(HV, NCH, -1)[..., :K]
    if kind in ("h", "dh"):
        return x.view(HV, NCH, x.shape[1], x.shape[2])[..., :K, :V]
    if kind == "dA_part":
        return x.sum(0).view(HV, NCH, BT, BT)
    if kind in ("db_part", "dbeta_part"):
        return x.sum(0).view(B, T, HV)
    return x


def rel(a, r):
    a, r = a.double(), r.double()
    return ((a - r).norm() / r.norm().clamp_min(1e-30)).item()


def main():
    from test_chunk_bwd import NAMES, make_inputs, oracle  # the GPU test's inputs and float64 oracle

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="2,1000,2,4,128,64", help="B,T,H,HV,K,V")
    p.add_argument("--dtype", default="both", choices=["bf16", "fp32", "both"])
    p.add_argument("--no-state", action="store_true", help="no initial state (the second GPU case)")
    p.add_argument("--knobs", default="", help="e.g. lv_warps=4,lk_warps=8,lv_block=128,lk_block=128")
    p.add_argument("--repeat", type=int, default=2, help="runs compared bit for bit")
    a = p.parse_args()
    shape = tuple(int(s) for s in a.shape.split(","))
    B, T, H, HV, K, V = shape
    knobs = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in a.knobs.split(",") if kv}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and os.environ.get("TRITON_INSTRUMENTATION_MODE") == "consan":
        import triton  # the sanitizer keeps its state in global scratch memory, which needs an allocator

        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    with_state = not a.no_state
    dtypes = {"bf16": [torch.bfloat16], "fp32": [torch.float32], "both": [torch.bfloat16, torch.float32]}[
        a.dtype
    ]
    print(f"device {device}, shape {shape}, state {with_state}, knobs {knobs or 'defaults'}", flush=True)
    for dtype in dtypes:
        inputs, do, dht = make_inputs(*shape, gate=-5.0, seed=3, device=device)
        inputs[:3] = [x.to(dtype).float() for x in inputs[:3]]  # the reference sees the rounded q, k, v
        runs = [capture(inputs, do, dht, dtype, with_state, knobs) for _ in range(a.repeat)]
        # the reference sees the inputs and dO as the kernels do (dO arrives in o's dtype)
        q, k, v, g, beta, h0 = inputs
        ref = reference(q, k, v, g, beta, K**-0.5, h0 if with_state else None, do.to(dtype), dht)
        print(f"\n== {str(dtype).split('.')[-1]}: buffer, rel. error vs float64, run-to-run", flush=True)
        for name, x in runs[0].items():
            if name == "grads":
                continue
            key = {"local_v.dA_part": "local_v.dA", "local_v.db_part": "local_v.dbeta"}.get(name, name)
            got = kernel_view(name, x, B, T, H, HV, K, V)
            err = f"{rel(got, ref[key]):.2e}" if key in ref else "   -    "
            same = all(torch.equal(x, r[name]) for r in runs[1:])
            diff = (
                ""
                if same
                else f" DIFFERS (max {max((x - r[name]).abs().max().item() for r in runs[1:]):.2e})"
            )
            print(f"  {name:22s} {err}  {'bit-identical' if same else ''}{diff}", flush=True)
        ref_grads = oracle(inputs, do, dht, with_state=with_state)
        for name, x, r in zip(NAMES, runs[0]["grads"], ref_grads, strict=False):
            same = all(torch.equal(x, rr["grads"][NAMES.index(name)]) for rr in runs[1:])
            print(f"  grad d{name:16s} {rel(x, r):.2e}  {'bit-identical' if same else 'DIFFERS'}", flush=True)


if __name__ == "__main__":
    main()
