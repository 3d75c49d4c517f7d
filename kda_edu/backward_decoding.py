"""Chapter 9's experiments: the chunkwise backward pass in plain PyTorch, and the numbers of decoding.

- `kda_chunked_backward`: the gradients of `kda_edu.kda.kda_chunked`, written out by hand chunk by chunk in
  float64, in the order the Triton backward (`kda_edu.triton.chunk_bwd`) computes them. It also returns the
  state gradient at every chunk boundary, the quantity that runs backwards through time.
- `input_grads`: autograd's answer for any KDA function, the reference the hand-written and Triton
  gradients are compared with.
- `recompute_vs_store`: bytes per token a forward would have to keep for the backward against the FLOPs
  the backward spends recomputing them instead.
- `decode_bytes` and the two plotting helpers for the decode and forward + backward benchmarks.
"""

from typing import NamedTuple

import torch

from kda_edu._checks import check_kda_inputs, resolve_scale
from kda_edu._chunks import from_chunks, to_chunks

NAMES = ("q", "k", "v", "g", "beta", "h0")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error `||x - ref|| / ||ref||` (Frobenius norms), computed in float64."""
    ref = ref.double()
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def input_grads(fn, inputs: dict, do: torch.Tensor, dht: torch.Tensor, dtype: torch.dtype = torch.float64):
    """Autograd gradients of `L = sum(o * do) + sum(S_T * dht)` for `fn(q, k, v, g, beta, initial_state=h0)`.

    Args:
        fn: a KDA function with the contract of `kda_edu.kda.kda_recurrent` (`chunk_kda`, `kda_chunked`, ...).
        inputs: `{"q", "k", "v", "g", "beta", "h0"}`, cast to `dtype` before the call.
        do, dht: the upstream gradients of the output `[B, T, HV, V]` and of the final state `[B, HV, K, V]`.

    Returns:
        `{name: gradient}` for the six inputs, in `dtype`.
    """
    xs = {n: inputs[n].detach().to(dtype).requires_grad_() for n in NAMES}
    o, ht = fn(
        xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], initial_state=xs["h0"], output_final_state=True
    )
    loss = (o.double() * do.double()).sum() + (ht.double() * dht.double()).sum()
    loss.backward()
    return {n: x.grad for n, x in xs.items()}


class ChunkGrads(NamedTuple):
    """Gradients of the chunkwise form. `dS[n]` is dL/dS at the start of chunk n; `dS[-1]` is dht."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dh0: torch.Tensor
    dS: list


def _pairwise_decay(gc: torch.Tensor, strict: bool) -> torch.Tensor:
    """`E_ijc = exp(gc_ic - gc_jc)` for j < i (strict) or j <= i, else 0: `[..., C, C, K]`, exponents <= 0."""
    C = gc.shape[-2]
    i = torch.arange(C, device=gc.device)
    keep = i[:, None] > i if strict else i[:, None] >= i
    diff = gc[..., :, None, :] - gc[..., None, :, :]
    return diff.masked_fill(~keep[:, :, None], float("-inf")).exp()


def kda_chunked_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> ChunkGrads:
    """The gradients of `kda_chunked` (and so of KDA), by hand, in float64.

    The loss is `sum(o * do) + sum(S_T * dht)`. Per chunk (notation of `kda_chunked`; E the pairwise decays):

        forward:  U = u - w S0,  O = qg S0 + Aqk U,  S_C = Diag(exp(gc_C)) S0 + kd^T U
        backward: dU  = Aqk^T dO + kd dS
                  dS0 = qg^T dO + Diag(exp(gc_C)) dS - w^T dU          (runs backwards over chunks)
                  dqg = dO S0^T,  dkd = U dS^T,  dw = -dU S0^T,  dAqk = dO U^T
        UT transform (u = X bv, w = X bw, X = (I + A)^-1):
                  du' = X^T dU,  dw' = X^T dw,  dA = -(du' u^T + dw' w^T) below the diagonal
        gates:    every factor exp(f(gc)) sends x * dx to dgc; dg = reverse cumsum of dgc in the chunk.

    The pairwise decays are built as a `[C, C, K]` tensor per chunk (a reference for small sizes, not a kernel).

    Args:
        q, k, v, g, beta, scale, initial_state, chunk_size: as for `kda_edu.kda.kda_chunked`.
        do: dL/do `[B, T, HV, V]`.
        dht: dL/dS_T `[B, HV, K, V]`; zeros when None.

    Returns:
        `ChunkGrads` in float64: dq, dk `[B, T, H, K]`, dv `[B, T, HV, V]`, dg `[B, T, HV, K]`, dbeta `[B, T, HV]`,
        dh0 `[B, HV, K, V]`, and dS, a list of NC + 1 state gradients `[B, HV, K, V]` at the chunk boundaries.
    """
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, g, beta, initial_state)
    scale, C, f64 = resolve_scale(scale, K), chunk_size, torch.float64
    rep = HV // H  # value heads per query/key head
    qs = to_chunks(q.repeat_interleave(rep, dim=2), C, f64) * scale  # [B, HV, NC, C, K]
    kc = to_chunks(k.repeat_interleave(rep, dim=2), C, f64)
    vc, gcum, bc = to_chunks(v, C, f64), to_chunks(g, C, f64).cumsum(-2), to_chunks(beta, C, f64)[..., None]
    doc = to_chunks(do, C, f64)
    NC = qs.shape[2]
    eye = torch.eye(C, dtype=f64, device=q.device)

    # Forward, keeping what the backward needs (the Triton backward recomputes it instead).
    S = q.new_zeros(B, HV, K, V, dtype=f64) if initial_state is None else initial_state.to(f64)
    fwd = []
    for n in range(NC):
        qn, kn, vn, bn, gc = qs[:, :, n], kc[:, :, n], vc[:, :, n], bc[:, :, n], gcum[:, :, n]
        E, Eqk = _pairwise_decay(gc, strict=True), _pairwise_decay(gc, strict=False)
        Akk = torch.einsum("...ic,...ijc,...jc->...ij", kn, E, kn)  # A = Diag(beta) Akk
        Aqk = torch.einsum("...ic,...ijc,...jc->...ij", qn, Eqk, kn)
        X = torch.linalg.inv(eye + bn * Akk)
        eg, ed, gl = gc.exp(), (gc[..., -1:, :] - gc).exp(), gc[..., -1, :].exp()  # gl: exp(gc_C), [B, HV, K]
        u, w = X @ (bn * vn), X @ (bn * kn * eg)
        U = u - w @ S
        fwd.append(dict(S0=S, E=E, Eqk=Eqk, Akk=Akk, Aqk=Aqk, X=X, eg=eg, ed=ed, gl=gl, u=u, w=w, U=U))
        S = gl[..., None] * S + (kn * ed).transpose(-1, -2) @ U

    # Backward, last chunk first.
    dS = torch.zeros_like(S) if dht is None else dht.to(f64)
    dS_list = [dS]
    dqs, dkc, dvc, dgc, dbc = (torch.zeros_like(x) for x in (qs, kc, vc, gcum, bc[..., 0]))
    for n in reversed(range(NC)):
        f, qn, kn, vn, bn, dO = fwd[n], qs[:, :, n], kc[:, :, n], vc[:, :, n], bc[:, :, n], doc[:, :, n]
        S0, U, X, eg, ed, gl = f["S0"], f["U"], f["X"], f["eg"], f["ed"], f["gl"]
        qg, kd = qn * eg, kn * ed
        # The state pass: the only part that couples chunks.
        dU = f["Aqk"].transpose(-1, -2) @ dO + kd @ dS
        dS0 = qg.transpose(-1, -2) @ dO + gl[..., None] * dS - f["w"].transpose(-1, -2) @ dU
        dqg, dkd, dw = dO @ S0.transpose(-1, -2), U @ dS.transpose(-1, -2), -dU @ S0.transpose(-1, -2)
        dAqk = (dO @ U.transpose(-1, -2)).tril()
        dgl = (S0 * dS).sum(-1) * gl  # d exp(gc_C) times exp(gc_C): the chunk-end gate term
        # The UT transform: u = X Diag(beta) V and w = X Diag(beta) (K exp(gc)).
        du_, dw_ = X.transpose(-1, -2) @ dU, X.transpose(-1, -2) @ dw
        dA = -(du_ @ f["u"].transpose(-1, -2) + dw_ @ f["w"].transpose(-1, -2)).tril(-1)
        dvc[:, :, n] = bn * du_
        dbc[:, :, n] = (du_ * vn).sum(-1) + (dw_ * kn * eg).sum(-1) + (dA * f["Akk"]).sum(-1)
        dAkk = bn * dA
        # Element-wise factors: qg = qs exp(gc), bw = beta k exp(gc), kd = k exp(gc_C - gc).
        dq_n = eg * dqg
        dk_n = bn * eg * dw_ + ed * dkd
        dg_n = qg * dqg + bn * kn * eg * dw_ - kd * dkd
        dg_n[..., -1, :] += (kd * dkd).sum(-2) + dgl
        # The gated Gram matrices M_ij = sum_c a_ic b_jc E_ijc: Akk (a = b = k) and Aqk (a = qs, b = k).
        for dM, a, Em in ((dAkk, kn, f["E"]), (dAqk, qn, f["Eqk"])):
            da = torch.einsum("...ij,...ijc,...jc->...ic", dM, Em, kn)
            db = torch.einsum("...ij,...ijc,...ic->...jc", dM, Em, a)
            dk_n = dk_n + db + (da if a is kn else 0)
            dq_n = dq_n + (da if a is qn else 0)
            dg_n = dg_n + a * da - kn * db
        dqs[:, :, n], dkc[:, :, n] = dq_n, dk_n
        dgc[:, :, n] = dg_n.flip(-2).cumsum(-2).flip(-2)  # gc = cumsum(g): dg_t = sum over i >= t of dgc_i
        dS = dS0
        dS_list.insert(0, dS)

    def heads(x):  # [B, HV, NC, C, K] -> [B, T, H, K], summing the value heads that share a key head
        return from_chunks(x, T, f64).unflatten(2, (H, rep)).sum(3)

    return ChunkGrads(
        dq=heads(dqs * scale),
        dk=heads(dkc),
        dv=from_chunks(dvc, T, f64),
        dg=from_chunks(dgc, T, f64),
        dbeta=from_chunks(dbc[..., None], T, f64)[..., 0],
        dh0=dS,
        dS=dS_list,
    )


def recompute_vs_store(K: int, V: int, C: int = 64, in_bytes: int = 2) -> dict:
    """Per token and value head: what a forward would keep for the backward, and what recomputing costs.

    The chunk-local intermediates the backward needs are w, qg, kd (K numbers each), u (V), one row of Aqk
    (C) in the input dtype, and one row of X = (I + A)^-1 (C numbers, float32). Recomputing them (the
    backward's prepare kernel) costs, per token: the two Gram matrices A and Aqk (2 C K multiply-adds each),
    the triangular inverse (C^2 / 3 multiply-adds per row, a third of C^3 per chunk), and w and u (C K and
    C V multiply-adds), at 2 FLOPs per multiply-add. The inputs the Triton backward saves instead are q, k, v
    (input dtype), g (float32) and beta (input dtype).

    Returns:
        `{"stored": {name: bytes}, "stored_bytes", "saved_input_bytes", "recompute_flops",
        "forward_flops"}`, all per token and head; forward_flops is 6 K V + 3 C K + C^2 (ANCHORS.md's count
        for K = V).
    """
    stored = {
        "w": K * in_bytes,
        "qg": K * in_bytes,
        "kd": K * in_bytes,
        "u": V * in_bytes,
        "Aqk": C * in_bytes,
        "X (float32)": C * 4,
    }
    return dict(
        stored=stored,
        stored_bytes=sum(stored.values()),
        saved_input_bytes=(2 * K + V) * in_bytes + 4 * K + in_bytes,
        recompute_flops=2 * (2 * C * K + 2 * C * K + C * C / 3 + C * K + C * V),
        forward_flops=6 * K * V + 3 * C * K + C * C,
    )


def decode_bytes(B: int, H: int, HV: int, K: int, V: int, in_bytes: int = 2, state_bytes: int = 4) -> dict:
    """Bytes one decoding step (T = 1) must move: the state read once and written once, plus the token's
    q, k `[B, H, K]`, v and o `[B, HV, V]`, beta `[B, HV]` in the input dtype and g `[B, HV, K]` in float32.
    """
    state = B * HV * K * V * state_bytes
    token = (2 * B * H * K + 2 * B * HV * V + B * HV) * in_bytes + B * HV * K * 4
    return dict(state=state, state_read_write=2 * state, token=token, total=2 * state + token)


DECODE_BARS = {
    "ours, in place": "ours_inplace",
    "ours, in place (again)": "ours_inplace_again",
    "ours, new state": "ours_new_state",
    "ours, in place, CUDA graph": "ours_inplace_cudagraph",
    "fla fused_recurrent_kda": "fla",
}


def plot_decode(result: dict):
    """Bar chart of one decoding step's time from `bench/results/h200_decode.json`, with the floor."""
    from kda_edu.plotting import figure, finish

    s = result["shape"]
    ratios = [result["ms"][key] / result["floor_ms"] for key in DECODE_BARS.values()]
    fig, (ax,) = figure(
        f"Decoding is memory-bound: every kernel within {max(ratios):.2f}x of reading + writing the state once",
        [("kernel (H200, one decoding step)", "time per decoding step (ms)")],
        width=8.0,
        height=3.8,
    )
    names = list(DECODE_BARS)
    times = [result["ms"][key] for key in DECODE_BARS.values()]
    colors = ["C0", "C0", "C2", "C1", "C3"]
    ax.bar(range(len(names)), times, color=colors)
    for i, (t, r) in enumerate(zip(times, ratios, strict=True)):
        ax.text(i, t, f"{t * 1e3:.1f} us\n{r:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.axhline(
        result["floor_ms"],
        color="k",
        ls="--",
        label=f"floor: 2 x state / copy bandwidth = {result['floor_ms'] * 1e3:.1f} us",
    )
    ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
    ax.set_ylim(0, max(times) * 1.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(
        f"{result['device']}, B={s['B']}, HV={s['HV']}, K=V={s['K']}, fp32 state ({result['state_bytes'] / 2**20:.0f} MiB)",
        fontsize=9,
    )
    finish(fig)
    return fig


def plot_fwd_bwd(result: dict):
    """Forward + backward time of ours and fla's chunk_kda from `bench/results/h200_fwd_bwd.json`."""
    from kda_edu.plotting import figure, finish

    rows = [
        r for r in result["rows"] if "kda_edu chunk_kda fwd+bwd ms" in r and "fla chunk_kda fwd+bwd ms" in r
    ]
    labels = [f"B={r['B']}, T={r['T']}, H={r['H']}" for r in rows]
    ours = [r["kda_edu chunk_kda fwd+bwd ms"] for r in rows]
    fla = [r["fla chunk_kda fwd+bwd ms"] for r in rows]
    worst = max(o / f for o, f in zip(ours, fla, strict=True))
    fig, (ax,) = figure(
        f"Forward + backward on {result['device']}: ours at most {worst:.2f}x fla's time",
        [("shape (bf16, K = V = 128)", "forward + backward time (ms)")],
        width=7.0,
    )
    x = torch.arange(len(rows)).tolist()
    ax.bar([i - 0.2 for i in x], ours, width=0.4, label="kda_edu chunk_kda")
    ax.bar([i + 0.2 for i in x], fla, width=0.4, label="fla chunk_kda")
    ax.set_xticks(x, labels, fontsize=8)
    ax.legend()
    finish(fig)
    return fig
