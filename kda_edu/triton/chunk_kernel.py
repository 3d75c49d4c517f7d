"""Chapter 8's tools for taking `kda_edu.triton.chunk` apart: stage by stage, byte by byte, and its benchmark.

- `prepare` runs only the first kernel (`_chunk_prepare_kernel`) and returns its intermediates (w, u, qg, kd,
  Aqk, exp(gc_C)) as `[B, HV, NT, C, *]` tensors; `scan` runs the second kernel on them.
- `reference_intermediates` computes the same intermediates in float64 PyTorch, from the chunkwise pieces of
  chapter 6 (`kda_edu.chunkwise`).
- `product_form_inverse` is the kernel's triangular inverse, written in PyTorch so that its identity can be
  checked against `torch.linalg.inv`.
- `design_traffic` and `design_flops` count what the two kernels move and compute per token and head.
- `crossover`, `plot_times` and `plot_rates` draw bench/results/h200_forward.json (read with
  `kda_edu.book.bench_result`).
"""

import math

import torch
import triton

from kda_edu._chunks import to_chunks
from kda_edu.chunkwise import intra_chunk_matrices, ut_transform
from kda_edu.triton.chunk import CHUNK, SUB, _chunk_prepare_kernel, _chunk_scan_kernel, _pow2

# ---------------------------------------------------------------------------------------------------------
# The two kernels, one at a time


def prepare(q, k, v, g, beta, scale: float | None = None) -> dict:
    """Run `_chunk_prepare_kernel` alone (float32 inputs) and return its outputs, chunk by chunk.

    Returns a dict of `[B, HV, NT, C, *]` tensors, trimmed to K / V columns: `w`, `u`, `qg`, `kd` (`[.., K]` or
    `[.., V]`), `aqk` (`[.., C, C]`, lower triangle; the kernel never writes above the diagonal blocks), `gl`
    (`[B, HV, NT, K]`, exp(gc_C)), and `flat`: the padded buffers as the scan kernel reads them.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    BT, BK, BV = CHUNK, _pow2(K), _pow2(V)
    NT = triton.cdiv(T, BT)
    rows = B * HV * NT * BT
    f32 = dict(device=q.device, dtype=torch.float32)
    flat = dict(
        w=torch.empty(rows, BK, **f32),
        u=torch.empty(rows, BV, **f32),
        qg=torch.empty(rows, BK, **f32),
        kd=torch.empty(rows, BK, **f32),
        aqk=torch.empty(rows, BT, **f32),
        gl=torch.empty(B * HV * NT, BK, **f32),
    )
    lmat = torch.empty(rows, BT, **f32)
    q, k, v, g, beta = (x.contiguous().float() for x in (q, k, v, g, beta))
    _chunk_prepare_kernel[(NT, B * HV)](
        q, k, v, g, beta, *flat.values(), lmat, T, H, HV, K, V, scale,
        BT=BT, BC=SUB, BK=BK, BV=BV, PREC="ieee", num_warps=4 if BK <= 64 else 8,
    )  # fmt: skip

    def view(name, cols):
        return flat[name].view(B, HV, NT, BT, -1)[..., :cols]

    out = dict(w=view("w", K), u=view("u", V), qg=view("qg", K), kd=view("kd", K), aqk=view("aqk", BT).tril())
    out["gl"] = flat["gl"].view(B, HV, NT, BK)[..., :K]
    out["flat"] = flat
    out["sizes"] = dict(B=B, T=T, HV=HV, K=K, V=V, NT=NT)
    return out


def scan(prepared: dict, initial_state: torch.Tensor | None = None, bv: int = 16):
    """Run `_chunk_scan_kernel` on the outputs of `prepare`; returns `(o [B, T, HV, V], final state)`.

    `bv` value columns per program; the pipeline depth follows the launcher `_chunk_kda_fwd`.
    """
    s = prepared["sizes"]
    flat = prepared["flat"]
    o = torch.empty(s["B"], s["T"], s["HV"], s["V"], device=flat["w"].device)
    ht = torch.empty(s["B"], s["HV"], s["K"], s["V"], device=flat["w"].device)
    _chunk_scan_kernel[(triton.cdiv(s["V"], bv), s["B"] * s["HV"])](
        *flat.values(), o, initial_state, ht, s["T"], s["HV"], s["K"], s["V"], s["NT"],
        BT=CHUNK, BK=_pow2(s["K"]), BVP=_pow2(s["V"]), BV=bv,
        USE_H0=initial_state is not None, STORE_HT=True, PREC="ieee", num_warps=4,
        num_stages=1 if _pow2(s["K"]) * 4 > 512 else 2,  # as the launcher: two stages of float32 tiles fit up to K = 128
    )  # fmt: skip
    return o, ht


def reference_intermediates(q, k, v, g, beta, scale: float | None = None) -> dict:
    """The prepare kernel's outputs computed in float64 PyTorch, `[B, HV, NT, C, *]` like `prepare`.

    Also returns `gc` (the within-chunk cumulative log decay), `A` (= Diag(beta) A of chapter 6, strictly lower
    triangular) and `X` = (I + A)^-1.
    """
    B, T, H, K = q.shape
    HV = v.shape[2]
    scale = K**-0.5 if scale is None else scale
    f64 = torch.float64
    q_c = to_chunks(q.repeat_interleave(HV // H, dim=2), CHUNK, f64) * scale
    k_c = to_chunks(k.repeat_interleave(HV // H, dim=2), CHUNK, f64)
    v_c, g_c, beta_c = (to_chunks(x, CHUNK, f64) for x in (v, g, beta))
    gc = g_c.cumsum(dim=-2)
    A, aqk = intra_chunk_matrices(q_c, k_c, gc, beta_c, SUB)
    eye = torch.eye(CHUNK, dtype=f64, device=q.device)
    X = torch.linalg.inv(eye + A)
    rhs = beta_c[..., None] * torch.cat([k_c * gc.exp(), v_c], dim=-1)
    w, u = ut_transform(A, rhs).split([K, v.shape[3]], -1)
    gc_end = gc[..., -1:, :]
    return dict(
        w=w, u=u, qg=q_c * gc.exp(), kd=k_c * (gc_end - gc).exp(), aqk=aqk, gl=gc_end.squeeze(-2).exp(),
        gc=gc, A=A, X=X,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# The triangular inverse by products


def product_form_inverse(L: torch.Tensor, block: int = SUB) -> torch.Tensor:
    """`(I + L)^-1` for strictly lower-triangular L `[..., C, C]` the way the prepare kernel computes it.

    Ld = the diagonal `block x block` blocks of L, Lo = the rest. I + L = (I + Ld)(I + N), N = (I + Ld)^-1 Lo.
    Ld^block = 0, so (I + Ld)^-1 = (I - Ld)(I + Ld^2)(I + Ld^4)...(I + Ld^(block/2)); N is zero on and above
    the diagonal blocks, so N^(C/block) = 0 and (I + N)^-1 = I - N + N^2 - ... (C/block terms).
    """
    C = L.shape[-1]
    i = torch.arange(C, device=L.device)
    same = (i // block)[:, None] == (i // block)[None, :]
    eye = torch.eye(C, dtype=L.dtype, device=L.device)
    P = -torch.where(same, L, 0)
    D = eye + P  # (I - Ld)
    for _ in range(int(math.log2(block)) - 1):
        P = P @ P  # Ld^2, Ld^4, ... (even powers: the sign is +)
        D = D + D @ P  # D (I + P)
    N = D @ torch.where(same, 0, L)
    series, term = eye.clone(), eye.clone()
    for _ in range(C // block - 1):
        term = -term @ N
        series = series + term
    return series @ D


# ---------------------------------------------------------------------------------------------------------
# What the design moves and computes, per token and value head


def design_traffic(K: int, V: int, C: int = CHUNK, in_bytes: int = 2, mid_bytes: int = 2) -> dict[str, float]:
    """Bytes per token and value head that the two kernels move through memory (each tensor once).

    `in_bytes`: element size of q, k, v, beta and o (2 for bfloat16); g is float32. `mid_bytes`: element size
    of the intermediates w, qg, kd, u, Aqk. exp(gc_C) is float32, K numbers per chunk. The float32 scratch L
    (C numbers per row, written and read back by the same program) is listed apart: it may stay in cache.
    """
    inputs = in_bytes * (2 * K + V + 1) + 4 * K
    between = mid_bytes * (3 * K + V + C) + 4 * K / C
    return {
        "prepare reads the inputs": inputs,
        "prepare writes w, qg, kd, u, Aqk, exp(gc_C)": between,
        "scan reads them back": between,
        "scan writes o": in_bytes * V,
        "scratch L, written and read (float32)": 2 * 4 * C,
    }


def floor_bytes(K: int, V: int, in_bytes: int = 2) -> int:
    """Bytes per token and value head any KDA forward must move: q, k, v, beta, o once, g in float32."""
    return in_bytes * (2 * K + 2 * V + 1) + 4 * K


def design_flops(K: int, V: int, C: int = CHUNK, sub: int = SUB) -> dict[str, float]:
    """FLOPs per token and value head of the two kernels, by phase (2 FLOPs per multiply-add)."""
    nb = C // sub
    pairs = (
        nb * (nb + 1) // 2
    )  # blocks (a, c) with c <= a, each two products (A and Aqk) of [sub, K] x [K, sub]
    # (I + Ld)^-1: log2(sub) - 1 squarings, each with one update; N, its powers up to N^(nb-1), the final product
    products = 2 * (int(math.log2(sub)) - 1) + nb  # ten for C = 64, sub = 16
    return {
        "prepare: A and Aqk blocks": pairs * 2 * 2 * sub * sub * K / C,
        "prepare: inverse X (C x C products)": products * 2 * C**3 / C,
        "prepare: w = X (..), u = X (..)": 2 * C * (K + V),
        "scan: w S, qg S, kd^T U": 3 * 2 * K * V,
        "scan: Aqk U": 2 * C * V,
    }


def algorithm_flops(d: int, C: int = CHUNK) -> int:
    """The chunked algorithm's FLOPs per token and head, 6 d^2 + 3 C d + C^2 (the benchmark's count)."""
    return 6 * d * d + 3 * C * d + C * C


# ---------------------------------------------------------------------------------------------------------
# The committed benchmark


def times(rows: list[dict], method: str) -> tuple[list[int], list[float]]:
    """(T, ms) of `method` over benchmark rows, skipping rows where it did not run."""
    pts = [(r["T"], r["methods"][method]["ms"]) for r in rows if "ms" in r["methods"].get(method, {})]
    return [t for t, _ in pts], [m for _, m in pts]


def crossover(T: list[float], t_a: list[float], t_b: list[float]) -> float | None:
    """The length at which method a stops being slower than b (first sign change of t_a - t_b), or None.

    Between the two measured lengths that bracket the change, both times are taken as power laws (straight
    lines on log-log axes), so the crossover is where the lines meet.
    """
    r = [math.log(a / b) for a, b in zip(t_a, t_b, strict=True)]
    for i in range(len(T) - 1):
        if r[i] > 0 >= r[i + 1]:
            x0, x1 = math.log(T[i]), math.log(T[i + 1])
            return math.exp(x0 + (x1 - x0) * r[i] / (r[i] - r[i + 1]))
    return None


STYLE = {
    "kda_edu chunk_kda": dict(marker="o", color="C3"),
    "fla chunk_kda": dict(marker="s", color="C0"),
    "fla chunk_gated_delta_rule": dict(marker="^", color="C2"),
    "torch sdpa flash causal": dict(marker="x", color="k"),
    "kda_edu kda_chunked (PyTorch)": dict(marker="d", color="C7"),
}


def plot_times(ax, bench: dict) -> None:
    """Time against T (log-log) for every method of the benchmark's sweep."""
    for method, style in STYLE.items():
        T, ms = times(bench["sweep"], method)
        if T:
            ax.loglog(T, ms, label=method, **style)
    ax.legend(fontsize=8)


def plot_rates(axes, bench: dict) -> None:
    """Achieved GB/s and TFLOP/s of each method at the headline shapes, with the measured ceilings."""
    rows = bench["headline"]
    methods = [m for m in STYLE if any("ms" in r["methods"].get(m, {}) for r in rows)]
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        for ax, key in zip(axes, ("GBps", "TFLOPs"), strict=True):
            x = [i + j * width for i, r in enumerate(rows) if key in r["methods"][method]]
            y = [r["methods"][method][key] for r in rows if key in r["methods"][method]]
            ax.bar(x, y, width, label=method, color=STYLE[method]["color"])
    labels = [f"B={r['B']}\nT={r['T'] // 1024}K\nH={r['H']}" for r in rows]
    for ax, ceiling, name in zip(
        axes,
        (bench["copy_bandwidth_TBps"] * 1e3, bench["bf16_matmul_TFLOPs"]),
        ("copy", "bf16 matmul"),
        strict=True,
    ):
        ax.axhline(ceiling, color="k", ls="--", lw=1)
        ax.text(
            len(rows) - 0.2, ceiling * 0.75, f"{name} ceiling {ceiling:.0f}", fontsize=8, ha="right", va="top"
        )
        ax.set_yscale("log")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], labels, fontsize=8)
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
