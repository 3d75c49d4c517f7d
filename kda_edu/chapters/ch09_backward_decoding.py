"""Chapter 9's experiments: the chunkwise backward pass in plain PyTorch, and the numbers of decoding.

- `kda_chunked_backward`: the gradients of `kda_edu.ops.kda.kda_chunked`, written out by hand chunk by chunk in
  float64, in the order the Triton backward (`kda_edu.kernels.chunk_bwd`) computes them. It also returns the
  state gradient at every chunk boundary, the quantity that runs backwards through time.
- `make_inputs`: random KDA inputs with an initial state and upstream gradients, the chapter's test cases.
- `input_grads`: autograd's answer for any KDA function, the reference the hand-written and Triton
  gradients are compared with.
- `recompute_vs_store`: bytes per token a forward would have to keep for the backward against the FLOPs
  the backward spends recomputing them instead (chapter 8's `design_flops`, by kernel).
- `outputs_and_grads` / `per_sequence_grads`: the same for one packed variable-length row (`cu_seqlens`) and
  for each of its sequences run alone, to show that packing changes nothing.
- `record_launches`: every kernel launch of `chunk_kda`'s forward and backward, recorded (name, grid, switches).
- `backward_memory`: the buffers the Triton backward allocates, kernel after kernel, and its peak; `versus`,
  `versus_range`: time ratios in words; `decode_bytes`, and the figures of the decode and forward + backward
  benchmarks (`plot_decode`, `plot_fwd_bwd`).
"""

import contextlib
from typing import NamedTuple
from unittest import mock

import torch

from kda_edu.ops._checks import check_kda_inputs, resolve_scale
from kda_edu.ops._chunks import chunk_inputs, from_chunks, state_passing, to_chunks

NAMES = ("q", "k", "v", "g", "beta", "h0")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error `||x - ref|| / ||ref||` (Frobenius norms), computed in float64."""
    ref = ref.double()
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def outputs_and_grads(
    fn, inputs: dict, do: torch.Tensor, dht: torch.Tensor, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Output, final state and autograd gradients of `L = sum(o * do) + sum(S_T * dht)`.

    Args:
        fn: a KDA function with the contract of `kda_edu.ops.kda.kda_recurrent` (`chunk_kda`, `kda_chunked`, ...),
            called as `fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)`.
        inputs: `{"q", "k", "v", "g", "beta", "h0"}`, cast to `dtype` before the call.
        do, dht: the upstream gradients of the output `[B, T, HV, V]` and of the final state `[B, HV, K, V]`
            (`[N, HV, K, V]`, one per sequence, when `fn` packs N sequences with `cu_seqlens`).

    Returns:
        `(o, S_T, {name: gradient})`: o and S_T detached, the gradients of the six inputs in `dtype`.
    """
    xs = {n: inputs[n].detach().to(dtype).requires_grad_() for n in NAMES}
    o, ht = fn(
        xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], initial_state=xs["h0"], output_final_state=True
    )
    loss = (o.double() * do.double()).sum() + (ht.double() * dht.double()).sum()
    loss.backward()
    return o.detach(), ht.detach(), {n: x.grad for n, x in xs.items()}


def make_inputs(T, H=1, K=16, V=16, HV=None, B=1, lower_bound=-1.0, seed=0, device="cpu"):
    """Random KDA inputs (`kda_edu.ops.chunkwise.random_inputs`) with an initial state `h0`, and the upstream
    gradients `(do, dht)`: returns `(inputs, do, dht)`, all float32 on `device`."""
    from kda_edu.ops.chunkwise import random_inputs

    x = random_inputs(B, T, H, K, V, HV=HV, lower_bound=lower_bound, seed=seed, device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    hv = HV or H
    x["h0"] = torch.randn(B, hv, K, V, generator=gen).to(device)
    do, dht = (
        torch.randn(B, T, hv, V, generator=gen).to(device),
        torch.randn(B, hv, K, V, generator=gen).to(device),
    )
    return x, do, dht


def input_grads(fn, inputs: dict, do: torch.Tensor, dht: torch.Tensor, dtype: torch.dtype = torch.float64):
    """Autograd gradients `{name: gradient}` of `L = sum(o * do) + sum(S_T * dht)`; see `outputs_and_grads`."""
    return outputs_and_grads(fn, inputs, do, dht, dtype)[2]


def per_sequence_grads(
    fn, inputs: dict, do: torch.Tensor, dht: torch.Tensor, cu_seqlens: torch.Tensor, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """`outputs_and_grads` for each sequence of a packed row alone, put back together in the packed layout.

    Args:
        fn, dtype: as for `outputs_and_grads`; `fn` is called once per non-empty sequence, without cu_seqlens.
        inputs: one packed row (B = 1) of q, k, v, g, beta along T, and h0 `[N, HV, K, V]`, one per sequence.
        do: `[1, T, HV, V]`; dht: `[N, HV, K, V]`.
        cu_seqlens: `[N + 1]` cumulative lengths, FlashAttention's convention.

    Returns:
        `(o [1, T, HV, V], S_T [N, HV, K, V], {name: gradient})` in the packed layout. An empty sequence has no
        output, its final state is its initial state and so the gradient of its h0 is its dht.
    """
    o = torch.zeros_like(do, dtype=dtype)
    ht = inputs["h0"].detach().to(dtype).clone()
    grads = {n: torch.zeros_like(inputs[n], dtype=dtype) for n in NAMES}
    grads["h0"] = dht.to(dtype).clone()
    bounds = cu_seqlens.tolist()
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if bos == eos:
            continue
        alone = {m: inputs[m][:, bos:eos] for m in NAMES[:5]} | {"h0": inputs["h0"][n : n + 1]}
        o_n, ht_n, g_n = outputs_and_grads(fn, alone, do[:, bos:eos], dht[n : n + 1], dtype)
        o[:, bos:eos], ht[n : n + 1] = o_n, ht_n
        for m in NAMES[:5]:
            grads[m][:, bos:eos] = g_n[m]
        grads["h0"][n : n + 1] = g_n["h0"]
    return o, ht, grads


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
        q, k, v, g, beta, scale, initial_state, chunk_size: as for `kda_edu.ops.kda.kda_chunked`.
        do: dL/do `[B, T, HV, V]`.
        dht: dL/dS_T `[B, HV, K, V]`; zeros when None.

    Returns:
        `ChunkGrads` in float64: dq, dk `[B, T, H, K]`, dv `[B, T, HV, V]`, dg `[B, T, HV, K]`, dbeta `[B, T, HV]`,
        dh0 `[B, HV, K, V]`, and dS, a list of NC + 1 state gradients `[B, HV, K, V]` at the chunk boundaries.
    """
    B, T, H, HV, K, V = check_kda_inputs(q, k, v, g, beta, initial_state)
    scale, C, f64 = resolve_scale(scale, K), chunk_size, torch.float64
    rep = HV // H  # value heads per query/key head
    # [B, HV, NC, C, *]
    qs, kc, vc, _, gcum, bc = chunk_inputs(q, k, v, g, beta, scale=scale, chunk_size=C, dtype=f64)
    bc, doc = bc[..., None], to_chunks(do, C, f64)
    NC = qs.shape[2]
    eye = torch.eye(C, dtype=f64, device=q.device)

    # Forward, keeping what the backward needs (the Triton backward recomputes it instead): the matrices of
    # each chunk, then the state pass of `kda_chunked` with the states entering the chunks.
    fwd = []
    for n in range(NC):
        qn, kn, vn, bn, gc = qs[:, :, n], kc[:, :, n], vc[:, :, n], bc[:, :, n], gcum[:, :, n]
        E, Eqk = _pairwise_decay(gc, strict=True), _pairwise_decay(gc, strict=False)
        Akk = torch.einsum("...ic,...ijc,...jc->...ij", kn, E, kn)  # A = Diag(beta) Akk
        Aqk = torch.einsum("...ic,...ijc,...jc->...ij", qn, Eqk, kn)
        X = torch.linalg.inv(eye + bn * Akk)
        eg, ed, gl = gc.exp(), (gc[..., -1:, :] - gc).exp(), gc[..., -1, :].exp()  # gl: exp(gc_C), [B, HV, K]
        u, w = X @ (bn * vn), X @ (bn * kn * eg)
        fwd.append(dict(E=E, Eqk=Eqk, Akk=Akk, Aqk=Aqk, X=X, eg=eg, ed=ed, gl=gl, u=u, w=w))
    S = q.new_zeros(B, HV, K, V, dtype=f64) if initial_state is None else initial_state.to(f64)
    Aqk, w, u = (torch.stack([f[name] for f in fwd], dim=2) for name in ("Aqk", "w", "u"))
    S0 = state_passing(qs, kc, gcum, Aqk, w, u, S, entering=True)[2]  # [B, HV, NC, K, V]
    for n, f in enumerate(fwd):
        f.update(S0=S0[:, :, n], U=f["u"] - f["w"] @ S0[:, :, n])  # the values chunk n wrote

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


RECOMPUTED = ("gram", "inverse", "wu")  # the kernels the backward runs again: the forward's prepare kernels
# (chunk.KERNELS' names, which prefix chapter 8's `design_flops` entries)


def recompute_vs_store(K: int, V: int, C: int = 64, in_bytes: int = 2) -> dict:
    """Per token and value head: what a forward would keep for the backward, and what recomputing costs.

    The chunk-local intermediates the backward needs are w, qg, kd (K numbers each), u (V), one row of Aqk
    (C) in the input dtype, and one row of X = (I + A)^-1 (C numbers, float32). Recomputing them is the
    forward's three prepare kernels run again (`kda_edu.kernels.chunk_fwd.prepare_chunks`, keeping the X buffer
    the inverse kernel writes anyway), counted as chapter 8 counts the kernels
    (`kda_edu.chapters.ch08_chunk_kernel.design_flops`, whose entries are named by kernel): gram, inverse and
    wu. X costs nothing beyond them. The forward it is compared with is all four kernels: the scan's products
    against the state and against U, and the gram kernel's masked 64-row products, are most of its FLOPs.
    The inputs the Triton backward saves instead are q, k, v (input dtype), g (float32) and beta (input dtype).

    Returns:
        `{"stored": {name: bytes}, "stored_bytes", "saved_input_bytes", "recompute_flops": {kernel: FLOPs},
        "forward_flops"}`, all per token and head.
    """
    from kda_edu.chapters.ch08_chunk_kernel import design_flops  # here, not at the top: it sets up Triton

    flops = design_flops(K, V, C)
    stored = {
        "w": K * in_bytes,
        "qg": K * in_bytes,
        "kd": K * in_bytes,
        "u": V * in_bytes,
        "Aqk": C * in_bytes,
        "X (float32)": C * 4,
    }
    recompute = {kern: sum(f for n, f in flops.items() if n.startswith(kern + ":")) for kern in RECOMPUTED}
    return dict(
        stored=stored,
        stored_bytes=sum(stored.values()),
        saved_input_bytes=(2 * K + V) * in_bytes + 4 * K + in_bytes,
        recompute_flops=recompute,
        forward_flops=sum(flops.values()),
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
    """Bar chart of one decoding step's time from a committed decode benchmark, with the floor."""
    from kda_edu.plotting import COLORS, figure, finish

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
    colors = [COLORS["kda_edu"]] * 4 + [COLORS["fla"]]
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


def versus(ratio: float, digits: int = 1) -> str:
    """A time ratio `ours / theirs` in words: "2.4x slower" above 1, "1.3x faster" (theirs / ours) below."""
    return f"{ratio:.{digits}f}x slower" if ratio >= 1 else f"{1 / ratio:.{digits}f}x faster"


def versus_range(ratios, digits: int = 1) -> str:
    """Several ratios `ours / theirs` in words: "2.4x to 2.5x slower", or each on its own when they straddle 1."""
    lo, hi = min(ratios), max(ratios)
    if lo < 1 <= hi:
        return f"{versus(lo, digits)} to {versus(hi, digits)}"
    a, b, word = (lo, hi, "slower") if lo >= 1 else (1 / hi, 1 / lo, "faster")
    if f"{a:.{digits}f}" == f"{b:.{digits}f}":
        return f"{a:.{digits}f}x {word}"
    return f"{a:.{digits}f}x to {b:.{digits}f}x {word}"


FORWARD_KERNELS = (  # kda_edu/kernels/chunk_fwd.py's, in launch order: three prepare kernels, then the scan
    "_chunk_gram_kernel",
    "_chunk_inverse_kernel",
    "_chunk_wu_kernel",
    "_chunk_scan_kernel",
)
BACKWARD_KERNELS = (  # in launch order: chunk_fwd.py's three prepare kernels again, then chunk_bwd.py's five
    "_chunk_gram_kernel",
    "_chunk_inverse_kernel",
    "_chunk_wu_kernel",
    "_states_kernel",
    "_dstates_kernel",
    "_local_v_kernel",
    "_local_k_kernel",
    "_local_dg_kernel",
)


class _Recorded:
    """A kernel stand-in: records each launch (name, FIRST, grid, keyword arguments), then launches the kernel."""

    def __init__(self, name, kernel, records):
        self.name, self.kernel, self.records = name, kernel, records

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.records.append((self.name, kwargs.get("FIRST"), tuple(grid), kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


@contextlib.contextmanager
def record_launches():
    """Inside, every launch of chunk_fwd.py's four kernels and chunk_bwd.py's own five is recorded, in order, as
    (name, FIRST, grid, keyword arguments), into the list this yields; each kernel still runs.

    chunk_fwd.py's kernels are launched by chunk_fwd.py's code (`prepare_chunks`, `chunk_kda_fwd`) in the forward
    and the backward alike, so they are replaced in chunk_fwd.py; chunk_bwd.py's own in chunk_bwd.py.
    """
    from kda_edu.kernels import chunk_bwd, chunk_fwd

    records = []
    own = [n for n in BACKWARD_KERNELS if n not in FORWARD_KERNELS]
    with contextlib.ExitStack() as stack:
        for module, names in ((chunk_fwd, FORWARD_KERNELS), (chunk_bwd, own)):
            for name in names:
                stand_in = _Recorded(name, getattr(module, name), records)
                stack.enter_context(mock.patch.object(module, name, stand_in))
        yield records


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def backward_memory(
    B: int,
    T: int,
    H: int,
    HV: int,
    K: int,
    V: int,
    in_bytes: int = 2,
    chunk: int = 64,
    lv_block: int = 64,
    lk_block: int = 32,
    work_bytes: int | None = None,
) -> dict:
    """Bytes that `chunk_kda`'s forward + backward allocates beyond its inputs and dO, buffer by buffer.

    Follows `kda_edu.kernels.chunk_bwd.chunk_kda_bwd` (without cu_seqlens and without an initial state):
    every intermediate has one padded chunk of `chunk` rows per (chunk, value head) and K, V padded to powers
    of two. Alive through the whole backward: the output o (the caller holds it) and the gradients dv, dg and
    dbeta (float32), and dq, dk in float32 until the casts. Then, kernel after kernel: the recomputed
    intermediates (w, u, qg, kd, Aqk, exp(gc_C) and X = (I + A)^-1, all written by the forward's three
    prepare kernels, `prepare_chunks` with store_x=True, which keeps the X buffer); the chunk states S0 and
    their gradients dS with U and dU; qg and kd are freed after the two passes, dAqk reuses Aqk's buffer,
    and dgc_end is added. `_local_v_kernel` (5) runs over
    cdiv(K, lv_block) blocks of key channels, each writing its share of dA ([rows, chunk] float32) and of
    dbeta ([B T HV] float32) beside X. After it X is freed and the dbeta shares are summed and freed; the dA
    shares stay, for `_local_k_kernel` (6) adds them as it loads them. 6 runs over cdiv(K, lk_block) blocks,
    each with a share of dbeta, beside `floor_hit` (one int32 per chunk and value head, alive to the end).
    With one value head per key head (HV == H) and 16-bit inputs, 6 writes the
    finished dq and dk in the input dtype into two new buffers, allocated before it runs, and the float32
    dq, dk are freed after it. The dA and dbeta shares are freed before the casts. Last, the casts to the
    inputs' dtype: of dbeta only when 6 wrote dq and dk, else of dq, dk and dbeta (after the sums over value
    heads sharing a key head when HV > H). The forward's own intermediates are freed before the backward
    starts. Not counted: the sum of the dbeta shares (one [B T HV] float32 vector) that exists for a moment
    between the kernels, smaller than the shares it replaces.

    `lv_block`, `lk_block`: `chunk_kda_bwd`'s knobs of the same names (its defaults). `work_bytes`: bytes per
    number of the intermediates the backward keeps in the input dtype (w, u, qg, kd, Aqk, S0, dS, U); None
    means `in_bytes`, as on a GPU, while Triton's interpreter keeps them in float32 (4).

    Returns:
        `{"peak": bytes, "phases": {phase: bytes alive at its end}, "at_peak": {buffer: bytes},
        "buffers": {phase: {buffer: bytes}}}`.
    """
    f32, lo = 4, in_bytes
    wk = in_bytes if work_bytes is None else work_bytes
    NCH = B * -(-T // chunk)  # chunks, the last of each sequence padded
    rows, BK, BVP = HV * NCH * chunk, _pow2(K), _pow2(V)
    tok = B * T
    held = {
        "output o": tok * HV * V * lo,
        "dv": tok * HV * V * lo,
        "dq, dk (float32)": 2 * tok * HV * K * f32,
        "dg (float32)": tok * HV * K * f32,
        "dbeta (float32)": tok * HV * f32,
    }
    prepare = {
        "w, u": rows * (BK + BVP) * wk,
        "qg, kd": 2 * rows * BK * wk,
        "Aqk, then dAqk": rows * chunk * wk,
        "X = (I + A)^-1 (float32)": rows * chunk * f32,
        "exp(gc_C) (float32)": HV * NCH * BK * f32,
    }
    passes = {
        "S0 of every chunk": HV * NCH * BK * BVP * wk,
        "dS of every chunk": HV * NCH * BK * BVP * wk,
        "U": rows * BVP * wk,
        "dU (float32)": rows * BVP * f32,
    }
    cast = (2 * tok * H * K + tok * HV) * lo if lo < f32 else 0  # dq, dk, dbeta in the input dtype
    finish = {"dq, dk summed over value heads": 2 * tok * H * K * f32} if HV != H else {}
    finish |= {"dq, dk, dbeta cast to the input dtype": cast} if cast else {}
    kept = {n: b for n, b in (held | prepare | passes).items() if n != "qg, kd"}  # after the two passes
    live = {"recompute (kernels 1-2)": held | prepare, "state passes (3-4)": held | prepare | passes}
    nv = -(-K // min(BK, lv_block))  # key blocks of _local_v_kernel, each with its shares of dA and dbeta
    nk = -(-K // min(BK, lk_block))  # key blocks of _local_k_kernel, each with its share of dbeta
    kept |= {"dgc_end (float32)": HV * NCH * BK * f32}
    dA_shares = {"dA, local_v's shares (float32)": nv * rows * chunk * f32}
    no_x = {n: b for n, b in kept.items() if n != "X = (I + A)^-1 (float32)"}  # X is freed after local_v
    out, at_end = {}, no_x
    if HV == H and lo < f32:  # _local_k_kernel writes dq, dk in the input dtype: only dbeta is cast
        out = {"dq, dk in the input dtype (written by local_k)": 2 * tok * H * K * lo}
        at_end = {n: b for n, b in no_x.items() if n != "dq, dk (float32)"} | out
        finish = {"dbeta cast to the input dtype": tok * HV * lo}
    floor = {"floor_hit (int32, per chunk and value head)": HV * NCH * 4}  # from 6 to the end
    at_end |= floor
    local_k = dA_shares | {"dbeta, local_k's shares (float32)": nk * tok * HV * f32} | out | floor
    live |= {
        "local_v (5)": kept | dA_shares | {"dbeta, local_v's shares (float32)": nv * tok * HV * f32},
        "local_k (6)": no_x | local_k,
        "casts": at_end | finish,
    }
    phases = {name: sum(bufs.values()) for name, bufs in live.items()}
    top = max(phases, key=phases.get)
    return dict(peak=phases[top], phases=phases, at_peak=live[top], buffers=live)


MEMORY_GROUPS = {  # backward_memory's buffers, grouped for the figure
    "output o": ("output o",),
    "gradients (float32 partials, casts)": (
        "dv",
        "dq, dk (float32)",
        "dg (float32)",
        "dbeta (float32)",
        "dq, dk in the input dtype (written by local_k)",
        "dq, dk summed over value heads",
        "dq, dk, dbeta cast to the input dtype",
        "dbeta cast to the input dtype",
    ),
    "recomputed w, u, Aqk, X, exp(gc_C)": (
        "w, u",
        "qg, kd",
        "Aqk, then dAqk",
        "X = (I + A)^-1 (float32)",
        "exp(gc_C) (float32)",
    ),
    "S0, dS, U, dU of every chunk": ("S0 of every chunk", "dS of every chunk", "U", "dU (float32)"),
    "dA, dbeta shares, dgc_end": (
        "dgc_end (float32)",
        "dA, local_v's shares (float32)",
        "dbeta, local_v's shares (float32)",
        "dbeta, local_k's shares (float32)",
        "floor_hit (int32, per chunk and value head)",
    ),
}


MEMORY_COLORS = ("#fcbba1", "#fb6a4a", "#de2d26", "#a50f15", "#67000d")  # shades of kda_edu's red


def plot_fwd_bwd(steps: dict, memory: dict, memory_shape: tuple, fla_gib: float):
    """Two panels: forward + backward time of ours and fla's chunk_kda per shape (`steps`, `{(B, T, H):
    (ours ms, fla ms)}`), with 1.25x fla's time marked; and at `memory_shape` the peak beyond the inputs,
    ours as `backward_memory` counts it (`memory`, split into `MEMORY_GROUPS`) beside fla's measured
    `fla_gib`."""
    from kda_edu.plotting import COLORS, figure, finish

    ratios = [ours / fla for ours, fla in steps.values()]
    ours_gib = memory["peak"] / 2**30
    fig, axes = figure(
        f"Forward + backward: ours {versus_range(ratios)} than fla's; counted peak memory "
        f"{ours_gib / fla_gib:.2f}x fla's measured",
        [
            ("B, T, H (bf16, K = V = 128)", "forward + backward time (ms)"),
            ("B={}, T={}, H={}".format(*memory_shape), "peak memory beyond the inputs (GiB)"),
        ],
        width=6.0,
        height=4.2,
    )
    ax = axes[0]
    x = list(range(len(steps)))
    ours_ms = [o for o, _ in steps.values()]
    fla_ms = [f for _, f in steps.values()]
    ax.bar([i - 0.2 for i in x], ours_ms, width=0.4, color=COLORS["kda_edu"], label="kda_edu chunk_kda")
    ax.bar([i + 0.2 for i in x], fla_ms, width=0.4, color=COLORS["fla"], label="fla chunk_kda")
    ax.plot([], [], color="k", ls=":", label="1.25x fla")
    for i, (t, f, r) in enumerate(zip(ours_ms, fla_ms, ratios, strict=True)):
        ax.text(i - 0.2, t, f"{r:.2f}x", ha="center", va="bottom", fontsize=9)
        ax.plot([i + 0.0, i + 0.4], [1.25 * f] * 2, color="k", ls=":")
    ax.set_xticks(x, ["{}, {}, {}".format(*shape) for shape in steps])
    ax.set_ylim(0, max(ours_ms) * 1.15)
    ax.legend(fontsize=8, loc="upper left")

    ax = axes[1]
    bottom = 0.0
    for (group, members), color in zip(MEMORY_GROUPS.items(), MEMORY_COLORS, strict=True):
        gib = sum(memory["at_peak"].get(m, 0) for m in members) / 2**30
        ax.bar(0, gib, bottom=bottom, color=color, label=f"ours (counted): {group}")
        bottom += gib
    ax.bar(1, fla_gib, color=COLORS["fla"], label="fla (measured)")
    ax.set_xticks([0, 1], ["kda_edu chunk_kda", "fla chunk_kda"])
    ax.legend(fontsize=7, loc="upper left")
    ax.set_ylim(0, max(ours_gib, fla_gib) * 1.8)
    finish(fig)
    return fig
