"""Random inputs, error measure and shape sweep shared by the tests of the reference implementations."""

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from kda_edu.ops._checks import compute_dtype
from kda_edu.ops.kda import kda_recurrent

# Tolerances on the relative error ||x - ref|| / ||ref|| (issue 3). The reference is always the float64 loop on
# the same inputs, i.e. the exact answer: comparing two float32 results instead would add their rounding errors,
# which exceeds 1e-5 on ill-conditioned draws (T = 1 with q . k close to 0 cancels three digits).
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}

# (B, T, H, HV, K, V, chunk_size): every case the issue names, each at least once.
EDGE_CASES = {
    "T=1": (1, 1, 1, 1, 4, 4, 16),
    "T_not_multiple_of_C": (1, 37, 1, 1, 8, 8, 16),
    "T_one_past_C": (1, 17, 1, 1, 8, 8, 16),
    "K_ne_V": (1, 20, 1, 1, 12, 5, 8),
    "HV_gt_H": (1, 20, 2, 6, 8, 8, 8),
    "B_gt_1": (3, 20, 2, 2, 8, 8, 8),
    "C=1": (2, 9, 1, 2, 4, 3, 1),
    "C_gt_T": (2, 9, 1, 2, 4, 3, 64),
}


def make_inputs(B, T, H, HV, K, V, *, dtype=torch.float64, gate="channel", g_min=-1.0, seed=0):
    """Random inputs in the layout of kda_edu, drawn from `seed`.

    q ~ N(0, 1) and L2-normalised k `[B, T, H, K]`; v ~ N(0, 1) `[B, T, HV, V]`; g uniform in [g_min, 0],
    `[B, T, HV, K]` for gate="channel", `[B, T, HV]` for gate="head"; beta uniform in [0, 1) `[B, T, HV]`;
    initial_state ~ N(0, 1) `[B, HV, K, V]` in the state dtype. Unit-length keys and beta <= 1 keep the delta
    rule stable, as the gates of a real layer do.
    """
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    g_shape = (B, T, HV, K) if gate == "channel" else (B, T, HV)
    return dict(
        q=torch.randn(B, T, H, K, **f64).to(dtype),
        k=F.normalize(torch.randn(B, T, H, K, **f64), dim=-1).to(dtype),
        v=torch.randn(B, T, HV, V, **f64).to(dtype),
        g=(g_min * torch.rand(g_shape, **f64)).to(dtype),
        beta=torch.rand(B, T, HV, **f64).to(dtype),
        initial_state=torch.randn(B, HV, K, V, **f64).to(compute_dtype(dtype)),
    )


def float64(x: dict) -> dict:
    """The same inputs in float64 (exact copies of their values), for the exact reference."""
    return {n: t.double() for n, t in x.items()}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (0 when both are zero)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@st.composite
def shapes(draw, max_T: int = 80) -> dict:
    """A random case: sizes, chunk size, whether to pass an initial state, and a seed for the values."""
    H = draw(st.integers(1, 2))
    return dict(
        B=draw(st.integers(1, 2)),
        T=draw(st.integers(1, max_T)),
        H=H,
        HV=H * draw(st.integers(1, 3)),
        K=draw(st.integers(1, 12)),
        V=draw(st.integers(1, 12)),
        chunk_size=draw(st.sampled_from([1, 3, 8, 16, 64])),
        with_state=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def kda_oracle(q, k, v, g, beta, h0=None, scale=None):
    """The float64 KDA loop on the same inputs: `(o, final_state)`, the reference every kernel is held to."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    h0 = None if h0 is None else h0.double()
    return kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)


def contribution_sizes(recurrent, x64: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the absolute contributions to each output and final-state entry (float64 loop `recurrent`).

    Every model tested here is linear in (v, h0) for fixed q, k, g, beta: o_t = sum_s C_ts v_s + D_t h0, and
    the final state likewise. One batched run of the loop with one step's v (or h0) kept and the rest zeroed
    gives each term; the result is sum_s |C_ts v_s| + |D_t h0|, entry by entry. It is >= |o_t| (the triangle
    inequality), with equality when no terms cancel."""
    B, T = x64["v"].shape[:2]
    n = T + ("initial_state" in x64)  # copy s < T keeps v_s only; copy T (with h0) keeps h0 only
    copy = torch.arange(n, dtype=torch.float64).repeat_interleave(B)  # the copy each batch row belongs to
    rep = {name: t.repeat(n, *([1] * (t.dim() - 1))) for name, t in x64.items()}
    step = torch.arange(T, dtype=torch.float64)
    rep["v"] = rep["v"] * (copy[:, None] == step).double()[:, :, None, None]
    if "initial_state" in x64:
        rep["initial_state"] = rep["initial_state"] * (copy == T).double()[:, None, None, None]
    o, s = recurrent(**rep, output_final_state=True)
    return o.view(n, B, *o.shape[1:]).abs().sum(0), s.view(n, B, *s.shape[1:]).abs().sum(0)


def cond_err(x: torch.Tensor, ref: torch.Tensor, size: torch.Tensor) -> float:
    """||x - ref|| / ||size||, size the sums of absolute contributions (`contribution_sizes`)."""
    return ((x.double() - ref).norm() / size.norm().clamp_min(1e-300)).item()


def assert_forms_agree(
    recurrent, chunked, case: dict, dtype: torch.dtype, *, args: str, gate: str = "channel"
):
    """Both forms of one model, on fresh inputs of `case`'s sizes, equal the float64 loop within TOL[dtype].

    The error is measured against the sum of absolute contributions (`contribution_sizes`, `cond_err`), not
    against ||ref||: a sum of terms of both signs is rounded in proportion to its terms, not to its value.
    Where they cancel, ||x - ref|| / ||ref|| measures the cancellation, not the code (T = 7, K = V = 1, chunks
    of 3, seed 53: a final state of 5.3e-4 from terms whose sizes add up to 4.0e-2 is 1.7e-5 from float64
    relative to ||ref||, 2.3e-7 relative to the terms). The denominator is >= ||ref||, and equal to it when
    nothing cancels: there this is exactly TOL relative to ||ref||. A wrong term is a wrong contribution and
    still shows at its own size.

    `args` names the model's inputs among q, k, v, g, beta (e.g. "q k v beta" for DeltaNet). Returns the
    inputs and the float64 inputs, for checks a test adds on top.
    """
    drawn = make_inputs(*(case[n] for n in "B T H HV K V".split()), dtype=dtype, gate=gate, seed=case["seed"])
    x = {n: drawn[n] for n in args.split()}
    if case["with_state"]:
        x["initial_state"] = drawn["initial_state"]
    x64 = float64(x)
    o_ref, s_ref = recurrent(**x64, output_final_state=True)
    o_size, s_size = contribution_sizes(recurrent, x64)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for o, s in (
        recurrent(**x, output_final_state=True),
        chunked(**x, output_final_state=True, chunk_size=case["chunk_size"]),
    ):
        assert o.dtype == dtype and o.shape == x["v"].shape and s.dtype == state_dtype
        assert cond_err(o, o_ref, o_size) <= TOL[dtype] and cond_err(s, s_ref, s_size) <= TOL[dtype]
    return x, x64


def edge_case(name: str, with_state: bool) -> dict:
    """EDGE_CASES[name] as a case dict like `shapes()` draws, with a seed of its own."""
    B, T, H, HV, K, V, C = EDGE_CASES[name]
    seed = list(EDGE_CASES).index(name)
    return dict(B=B, T=T, H=H, HV=HV, K=K, V=V, chunk_size=C, with_state=with_state, seed=seed)


# Bad cu_seqlens for T = 4 with the error each must raise (the kernels share `kda_edu.ops.varlen.check_cu_seqlens`).
BAD_CU_SEQLENS = [
    ([1, 2, 4], ValueError, "start at 0 and end at T = 4"),
    ([0, 2, 3], ValueError, "start at 0 and end at T = 4"),
    ([0, 3, 2, 4], ValueError, "nondecreasing"),
    ([0], ValueError, "N \\+ 1 >= 2"),
    ([[0, 4]], ValueError, "1-D"),
    ([0.0, 4.0], TypeError, "int32 or int64"),
]
BAD_CU_IDS = ["not_from_0", "not_to_T", "decreasing", "one_entry", "2d", "float"]
