"""Replay, on the CPU, the layer input that a training run's `--watch` capture saved when its output went non-finite.

DeltaNet on MQAR 1024 at 3e-3 had a NaN held-out loss on two early builds (those whose diagonal inverses took
the product form) and not on later ones. `bisect_recall_run.py --watch --capture FILE` found the first module whose output went
non-finite from finite inputs (layer 1's mixer) and saved its parameters and one batch row of its input. This
script rebuilds that mixer from the same build, takes the kernel's inputs (q, k, v, beta as the mixer hands
them to `chunk_kda`, q, k and v rounded to the kernel's bfloat16) and asks which arithmetic breaks them:

- the float64 delta-rule recurrence (the answer);
- a float64 chunked forward (chunks of 64, the kernel's four 16 x 16 diagonal blocks and block forward
  substitution) whose diagonal-block inverses come from one of: the exact float64 inverse, the product form
  (I - L)(I + L^2)(I + L^4)(I + L^8) with float32 products, the same with TF32 products (operands rounded to
  10 mantissa bits, as the GPU's tf32 `tl.dot` does for 16-bit inputs), or row-by-row forward substitution
  in float32 (the current kernel's method). Everything else stays float64, so a difference between them is
  the inverse's alone;
- the build's own Triton kernel through the interpreter (float32 products: the interpreter has no TF32).

For each it records the first non-finite output token, the largest error against the recurrence before it, and
the state's norm after every chunk; for the inverses, their largest error against float64 over the sequence's
16-row blocks.

    python -m bench.experiments.replay_nonfinite --build .builds/3590420 \\
        --capture CAPTURE.pt --out $OUT/nonfinite_replay.json
"""

import argparse
from pathlib import Path

import torch

from bench.common import write_result
from bench.experiments.bisect_recall_run import load_build

CHUNK, BLOCK = 64, 16


def tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 rounded to TF32's 10 mantissa bits (nearest, ties away from zero, as cvt.rna.tf32.f32)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def tf32_truncated(x: torch.Tensor) -> torch.Tensor:
    """float32 with its 13 low mantissa bits dropped: what a tensor core reads of a float32 register that
    reaches a tf32 product unconverted."""
    return (x.float().contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def product(rounding):
    """A float32 product of two operands after `rounding` (exact accumulation, then float32)."""
    return lambda a, b: (rounding(a).double() @ rounding(b).double()).float().double()


def product_inverse(L: torch.Tensor, rounding) -> torch.Tensor:
    """(I + L)^-1 of strictly lower 16 x 16 blocks by the product form, products in float32 after `rounding`."""
    L = L.float()
    X = torch.eye(L.shape[-1]) - L
    P = L
    for _ in range(3):
        P = (rounding(P).double() @ rounding(P).double()).float()  # L^2, L^4, L^8
        X = X + (rounding(X).double() @ rounding(P).double()).float()
    return X.double()


def substitution_inverse(L: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 row by row in float32: row i = e_i - sum_{j<i} L_ij row j."""
    L = L.float()
    n = L.shape[-1]
    X = torch.zeros_like(L)
    for i in range(n):
        X[..., i, :] = torch.nn.functional.one_hot(torch.tensor(i), n).float() - torch.einsum(
            "...j,...jc->...c", L[..., i, :i], X[..., :i, :]
        )
    return X.double()


INVERSES = {
    "exact float64": lambda L: torch.linalg.inv(torch.eye(L.shape[-1], dtype=torch.float64) + L.double()),
    "product form, float32": lambda L: product_inverse(L, lambda x: x),
    "product form, TF32": lambda L: product_inverse(L, tf32),
    "product form, TF32 truncated": lambda L: product_inverse(L, tf32_truncated),
    "substitution, float32": substitution_inverse,
}


def recurrence(q, k, v, beta, scale):
    """Float64 delta rule, one head: S_t = S_{t-1} + b_t k_t (v_t - S_{t-1}^T k_t)^T, o_t = scale S_t^T q_t."""
    T, K = k.shape
    S = torch.zeros(K, v.shape[1], dtype=torch.float64)
    out = torch.empty(T, v.shape[1], dtype=torch.float64)
    for t in range(T):
        S = S + beta[t] * torch.outer(k[t], v[t] - S.T @ k[t])
        out[t] = scale * S.T @ q[t]
    return out


def exact(a, b):
    return a @ b


def block_solve(X: dict, L: torch.Tensor, B: torch.Tensor, mm) -> torch.Tensor:
    """Rows of (I + L)^-1 B, 16 at a time, with X[a] the inverse of diagonal block a (the kernel's substitution)."""
    R = torch.empty_like(B)
    for a in sorted(X):
        R[a : a + BLOCK] = mm(X[a], B[a : a + BLOCK] - mm(L[a : a + BLOCK, :a], R[:a]))
    return R


def chunked(q, k, v, beta, scale, inverse, mm=exact, low=lambda x: x):
    """Chunked delta rule with the diagonal blocks of (I + L)^-1 from `inverse`; returns the outputs, the state
    norm after each chunk and the inverse's largest error per block against float64. Float64 throughout by
    default; `mm` (the products of the substitution and of the state pass) and `low` (the rounding of what
    the GPU kernel keeps in 16 bits: w, u, qg, kd, Aqk, and the state and u as the state pass multiplies
    them) emulate the build's bf16 path."""
    T, K = k.shape
    S = torch.zeros(K, v.shape[1], dtype=torch.float64)
    out = torch.empty(T, v.shape[1], dtype=torch.float64)
    norms, errors = [], []
    for c0 in range(0, T, CHUNK):
        kc, vc, qc, bc = k[c0 : c0 + CHUNK], v[c0 : c0 + CHUNK], q[c0 : c0 + CHUNK], beta[c0 : c0 + CHUNK]
        n = kc.shape[0]
        L = torch.tril(bc[:, None] * (kc @ kc.T), -1)
        blocks = range(0, n, BLOCK)
        X = {a: inverse(L[a : a + BLOCK, a : a + BLOCK]) for a in blocks}
        for a in blocks:
            exact = torch.linalg.inv(
                torch.eye(X[a].shape[0], dtype=torch.float64) + L[a : a + BLOCK, a : a + BLOCK]
            )
            errors.append((X[a] - exact).abs().max().item())

        W, U = low(block_solve(X, L, bc[:, None] * kc, mm)), low(block_solve(X, L, bc[:, None] * vc, mm))
        Aqk, qs, kd = low(torch.tril(qc @ kc.T) * scale), low(qc * scale), low(kc)
        s_lo = low(S)
        Unew = U - mm(W, s_lo)
        u_lo = low(Unew)
        out[c0 : c0 + n] = mm(qs, s_lo) + mm(Aqk, u_lo)
        S = S + mm(kd.T, u_lo)
        norms.append(S.norm().item())
    return out, norms, errors


def first_nonfinite(o: torch.Tensor) -> int | None:
    bad = (~torch.isfinite(o)).flatten(1).any(1).nonzero()
    return int(bad[0]) if len(bad) else None


def summary(o, ref):
    t = first_nonfinite(o)
    good = o[:t] if t is not None else o
    err = ((good - ref[: len(good)]).abs().max() / ref[: len(good)].abs().max()).item() if len(good) else None
    return {"first non-finite token": t, "max error before it (relative to max |o|)": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", type=Path, required=True)
    ap.add_argument("--capture", type=Path, required=True)
    ap.add_argument("--kernel", action="store_true", help="also run the build's Triton kernel (interpreter)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    sweep, commit = load_build(args.build)
    import kda_edu.triton as build_triton  # the build's: load_build put it first on the path
    from kda_edu.mixers import MixerConfig, TokenMixer

    cap = torch.load(args.capture)
    x = cap["args"][0].float()
    state = cap["state"]
    kind = "deltanet" if not any(n.startswith("f_proj") for n in state) else None
    if kind is None:
        raise SystemExit("this replay handles DeltaNet captures (no gate) only")
    cfg = MixerConfig(kind=kind, **sweep.PRESETS["gpu"]["mixer"])
    mixer = TokenMixer(x.shape[-1], cfg)
    mixer.load_state_dict(state)
    seen = {}
    kernel = build_triton.chunk_kda

    def capture_inputs(q, k, v, g, beta, *a, **kw):
        seen.update(q=q, k=k, v=v, g=g, beta=beta)
        return torch.zeros_like(v), None

    build_triton.chunk_kda = capture_inputs
    with torch.no_grad():
        mixer(x)
    build_triton.chunk_kda = kernel
    q, k, v, beta = (seen[n] for n in ("q", "k", "v", "beta"))
    H, K = q.shape[2], q.shape[3]
    scale = K**-0.5
    result = {
        "commit": commit,
        "capture": str(args.capture),
        "captured": cap["record"],
        "captured output first non-finite token": first_nonfinite(cap["output"][0]),
        "kernel inputs": {n: str(seen[n].dtype) for n in ("q", "k", "v", "beta")},
        "heads": {},
    }
    for h in range(H):
        qh, kh, vh = (t[0, :, h].double() for t in (q, k, v))
        bh = beta[0, :, h].double()
        ref = recurrence(qh, kh, vh, bh, scale)
        head = {"recurrence max |o|": ref.abs().max().item(), "inverses": {}}
        variants = {name: (inverse, exact, lambda x: x) for name, inverse in INVERSES.items()}
        for name in (
            "exact float64",
            "product form, TF32",
            "product form, TF32 truncated",
            "substitution, float32",
        ):
            for mm_name, mm in (("TF32", product(tf32)), ("TF32 truncated", product(tf32_truncated))):
                variants[f"{name}; bf16 path, {mm_name} products"] = (INVERSES[name], mm, bf16)
        for name, (inverse, mm, low) in variants.items():
            o, norms, errors = chunked(qh, kh, vh, bh, scale, inverse, mm, low)
            head["inverses"][name] = {
                **summary(o, ref),
                "state norm after each chunk": [float(f"{n:.4g}") for n in norms],
                "largest inverse error over the blocks": max(errors),
            }
            print(h, name, head["inverses"][name]["first non-finite token"], f"{max(errors):.3g}", flush=True)
        blocks = torch.stack(
            [torch.tril(bh[a : a + BLOCK, None] * (kh[a : a + BLOCK] @ kh[a : a + BLOCK].T), -1)
             for a in range(0, len(kh), BLOCK)]
        )  # fmt: skip
        L8 = torch.linalg.matrix_power(blocks, 8)
        head["largest |L^8| entry over the blocks"] = L8.abs().max().item()
        head["largest |k_i . k_j| (i != j) within a block"] = max(
            (torch.tril(kh[a : a + BLOCK] @ kh[a : a + BLOCK].T, -1).abs().max().item())
            for a in range(0, len(kh), BLOCK)
        )
        result["heads"][h] = head
    if args.kernel:
        o, _ = kernel(q.float(), k.float(), v.float(), seen["g"].float(), beta.float())
        result["build kernel (interpreter, float32 products)"] = {
            "first non-finite token": first_nonfinite(o[0]),
        }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
