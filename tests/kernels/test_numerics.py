"""Adversarial numerics of every KDA path against an independent float64 loop (issue 18).

Each case builds inputs that once broke a fast path (strided cu_seqlens, g = -inf, a NaN at one step, nearly
parallel keys, hard resets, gates shared by the channels down to -300, random awkward shapes) and measures every
path against `kda_recurrent` in float64: the chunked PyTorch forms `kda_chunked` and chapter 6's
`kda_chunked_matmul` (float32), the Triton kernels `chunk_kda` and `fused_recurrent_kda` (float32; under
Triton's interpreter on a CPU, compiled on a GPU, where they also run in bfloat16), and chunk_kda's gradients
against autograd through the float64 loop.

The error is the relative norm `|x - ref| / |ref|` over the outputs (and the final state where there is one).
Tolerances: 1e-5 for float32 under the interpreter, whose products are exact float32 (the issue's target; the
float32 rounding of a 64-step chunk is about 1e-6). On a GPU float32 keeps 1e-4, the tolerance of the other
Triton tests there (different reduction orders; `input_precision="ieee"`), and bfloat16 inputs 1e-2 against a
reference fed the same rounded q, k, v (bf16's 8-bit mantissa: 4e-3 per rounding, a few roundings deep).

Run as a script (`python tests/kernels/test_numerics.py`) it prints the error of every case and path and, when the
environment variable OUT names a folder, writes them to `$OUT/numerics.json`: the table of issue 18.
"""

import json
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from kda_edu.kernels import _backend, chunk_kda, fused_recurrent_kda, raise_value_errors
from kda_edu.ops.chunkwise import kda_chunked_matmul
from kda_edu.ops.kda import kda_chunked, kda_recurrent

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5 if DEVICE == "cpu" else 1e-4, torch.bfloat16: 1e-2}
# Measured on the H200: with nearly parallel keys and beta = 1, chunk_kda's bf16
# path is 2.1e-2 from the loop on the same rounded inputs, over the 1e-2 of every other case: the solve turns
# each value into its difference with the last one, and the bf16 intermediates keep 8 bits of those. The
# claim for that case is the measured level with a margin, not 1e-2.
CASE_TOL = {("correlated_keys", torch.bfloat16): 3e-2}
DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float32, torch.bfloat16]


def make(B, T, H, K, V, HV=None, gate=-1.0, seed=0, h0=False, N=None):
    """Random inputs on DEVICE in float32: unit keys, gates uniform in [gate, 0], beta in (0, 1)."""
    HV = H if HV is None else HV
    gen = torch.Generator().manual_seed(seed)
    x = dict(
        q=torch.randn(B, T, H, K, generator=gen),
        k=F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        v=torch.randn(B, T, HV, V, generator=gen),
        g=gate * torch.rand(B, T, HV, K, generator=gen),
        beta=torch.rand(B, T, HV, generator=gen),
    )
    if h0:
        x["initial_state"] = torch.randn(B if N is None else N, HV, K, V, generator=gen)
    return {name: t.to(DEVICE) for name, t in x.items()}


def reference(inputs, cu_seqlens=None):
    """float64 loop, one sequence at a time with cu_seqlens: (o, final_state)."""
    x = {name: t.double() for name, t in inputs.items()}
    if cu_seqlens is None:
        return kda_recurrent(**x, output_final_state=True)
    cu = cu_seqlens.tolist()
    os_, hs = [], []
    for n, (bos, eos) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        part = {name: t[:, bos:eos] for name, t in x.items() if name != "initial_state"}
        h0 = x["initial_state"][n : n + 1] if "initial_state" in x else None
        o, h = kda_recurrent(**part, initial_state=h0, output_final_state=True)
        os_.append(o)
        hs.append(h)
    return torch.cat(os_, dim=1), torch.cat(hs)


def rel(x, ref):
    """Relative norm error; inf when x is not finite where ref is."""
    x, ref = x.double(), ref.double()
    if not bool(torch.isfinite(x).all()):
        return math.inf
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run(path, inputs, dtype=torch.float32, **kw):
    """One fast path on inputs with q, k, v in `dtype`: (o, final_state) in float32."""
    x = dict(inputs)
    x.update({name: x[name].to(dtype) for name in ("q", "k", "v")})
    if path in CHUNKED:
        o, h = CHUNKED[path](**x, output_final_state=True, **kw)
    else:
        fn = chunk_kda if path == "chunk_kda" else fused_recurrent_kda
        o, h = fn(**x, output_final_state=True, **kw)
    return o.float(), h


def rounded(inputs, dtype):
    """inputs with q, k, v rounded to `dtype` (the reference then sees what the kernel sees)."""
    return {n: (t.to(dtype).float() if n in ("q", "k", "v") else t) for n, t in inputs.items()}


def error(path, inputs, dtype=torch.float32, cu_seqlens=None, **kw):
    ins = rounded(inputs, dtype)
    ref_o, ref_h = reference(ins, cu_seqlens)
    extra = {} if cu_seqlens is None else dict(cu_seqlens=cu_seqlens)
    o, h = run(path, ins, dtype, **extra, **kw)
    return max(rel(o, ref_o), rel(h, ref_h))


# ---------------------------------------------------------------------------------------------------------
# The cases


def correlated_keys(T=64, K=32, seed=0):
    """Nearly parallel keys (e_0 plus 1e-3 noise, normalised), g = 0, beta = 1: the unit-lower inverse's
    hardest case (its Neumann powers grow like binomial coefficients)."""
    x = make(1, T, 1, K, K, seed=seed)
    e = torch.zeros(K, device=DEVICE)
    e[0] = 1
    gen = torch.Generator().manual_seed(seed + 1)
    x["k"] = F.normalize(e + 1e-3 * torch.randn(1, T, 1, K, generator=gen).to(DEVICE), dim=-1)
    x["g"] = torch.zeros_like(x["g"])
    x["beta"] = torch.ones_like(x["beta"])
    return x


def hard_resets(T=100, every=7, value=-1000.0, K=32):
    """Gates at `value` every `every` steps (a reset: exp(-1000) = 0), small gates otherwise."""
    x = make(1, T, 1, K, K, HV=2, h0=True, seed=3, gate=-0.1)
    x["g"][:, every - 1 :: every] = value
    return x


def minus_inf_gates(T=100, K=32):
    """g = -inf (a decay of exactly zero: a legitimate reset) at a few steps and channels."""
    x = make(1, T, 2, K, 16, h0=True, seed=4)
    x["g"][:, 10, 0] = -math.inf
    x["g"][:, 40:43, 1, :5] = -math.inf
    x["g"][:, T - 23] = -math.inf
    return x


def shared_gates(T=100, K=32, low=-300.0):
    """One gate per head and step, shared by every key channel, uniform in [low, 0]: most steps are resets
    (below GATE_FLOOR), the rest decay hard; the pairwise branch of the diagonal blocks on every block."""
    x = make(1, T, 1, K, K, HV=2, h0=True, seed=12)
    g = low * torch.rand(1, T, 2, 1, generator=torch.Generator().manual_seed(13))
    x["g"] = g.expand(1, T, 2, K).contiguous().to(DEVICE)
    return x


def awkward_shapes(seed):
    """Random sizes: K != V, HV > H, odd T, an initial state; gates at KDA's usual bound."""
    gen = torch.Generator().manual_seed(seed)
    H = int(torch.randint(1, 3, (1,), generator=gen))
    HV = H * int(torch.randint(1, 4, (1,), generator=gen))
    K, V = (int(torch.randint(3, 40, (1,), generator=gen)) for _ in range(2))
    T = 2 * int(torch.randint(33, 50, (1,), generator=gen)) + 1  # 67 .. 99: two chunks, the second partial
    return make(1, T, H, K, V, HV=HV, gate=-5.0, seed=seed, h0=True)


STRIDED_CU = [0, 9, 30, 9, 70, 9]  # [::2] is [0, 30, 70], a view with stride 2


def strided_cu():
    return torch.tensor(STRIDED_CU, dtype=torch.int32, device=DEVICE)[::2]


CASES = {
    "correlated_keys": lambda: correlated_keys(),
    "hard_resets_-1000_every_7": lambda: hard_resets(),
    "g_minus_inf": lambda: minus_inf_gates(),
    "shared_gates_to_-300": lambda: shared_gates(*((100, 32) if DEVICE == "cuda" else (40, 16))),
    "awkward_shapes_0": lambda: awkward_shapes(0),
    "awkward_shapes_1": lambda: awkward_shapes(1),
}
PATHS = ("kda_chunked", "chunk_kda", "fused_recurrent_kda")
# The PyTorch chunked forms (float32 only): the reference and chapter 6's matrix-product form. The latter is
# held to the cases of issue 18 here, not to the causality of bad values (its masked products spread a NaN).
CHUNKED = {"kda_chunked": kda_chunked, "kda_chunked_matmul": kda_chunked_matmul}


@pytest.mark.parametrize("path", [*PATHS, "kda_chunked_matmul"])
@pytest.mark.parametrize("case", CASES)
def test_fast_paths_match_the_float64_loop(case, path):
    if (case, path) == ("shared_gates_to_-300", "kda_chunked_matmul"):
        pytest.skip("chapter 6's form holds gates above GATE_FLOOR to sub_chunk * |g| < 88 (its docstring)")
    for dtype in DTYPES if path not in CHUNKED else [torch.float32]:
        err = error(path, CASES[case](), dtype)
        print(f"{case} {path} {dtype}: {err:.2e}")
        assert err <= CASE_TOL.get((case, dtype), TOL[dtype]), (case, path, dtype, err)


@pytest.mark.parametrize("path", ["chunk_kda", "fused_recurrent_kda"])
def test_strided_cu_seqlens(path):
    """A cu_seqlens view with stride 2 means the values it shows, [0, 30, 70]."""
    cu = strided_cu()
    assert not cu.is_contiguous()
    err = error(path, make(1, 70, 1, 16, 24, HV=2, h0=True, N=2, seed=5), cu_seqlens=cu)
    assert err <= TOL[torch.float32], err


BAD_STEP = 37  # row 5 of the third 16-row block of the first chunk: earlier rows in its block and before it


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("where", ["k", "v", "q"])
def test_a_bad_value_never_travels_back_in_time(path, where):
    """A NaN and an inf at step t (k, v or q, which no path checks) leave every output before t exact; from
    t on the outputs may be NaN (the loop's own answer: the state is NaN after a NaN write)."""
    x = make(1, 50, 2, 16, 16, h0=True, seed=6)
    y = {n: t.clone() for n, t in x.items()}
    y[where][:, BAD_STEP, 0, 3] = math.nan
    y[where][:, BAD_STEP, 1, 5] = math.inf
    o, _ = run(path, y)
    ref = reference({n: t[:, :BAD_STEP] if n != "initial_state" else t for n, t in x.items()})[0]
    err = rel(o[:, :BAD_STEP], ref)
    assert err <= TOL[torch.float32], err
    assert not bool(torch.isfinite(o[:, BAD_STEP]).all()), "the bad step's output must not look valid"


@pytest.mark.parametrize(
    "where, bad",
    [
        ("g", (math.nan, math.inf)),
        ("g", (0.5, 100.0)),
        ("beta", (math.nan, math.inf)),
        ("beta", (1.5, -1e38)),
    ],
)
def test_unchecked_bad_gates_never_travel_back_in_time(where, bad):
    """With check_inputs=False an invalid gate (NaN, +inf, growth, even one whose exponent overflows) or write
    strength (NaN, inf, outside [0, 1]) reaches the kernels: only the outputs from its step on are spoilt,
    to NaN, never a finite wrong answer."""
    x = make(1, 50, 2, 16, 16, h0=True, seed=6)
    y = {n: t.clone() for n, t in x.items()}
    y[where][:, BAD_STEP, 0] = bad[0]
    y[where][:, BAD_STEP, 1] = bad[1]
    o = chunk_kda(**y, check_inputs=False)[0]
    ref = reference({n: t[:, :BAD_STEP] if n != "initial_state" else t for n, t in x.items()})[0]
    assert rel(o[:, :BAD_STEP], ref) <= TOL[torch.float32]
    assert not bool(torch.isfinite(o[:, BAD_STEP:]).any()), "every output from the bad step on must be NaN"


@pytest.mark.parametrize(
    "change", [("g", 0.5), ("g", math.nan), ("beta", 1.5), ("beta", -0.1), ("beta", math.nan)]
)
@pytest.mark.parametrize("mode", [True, "sync"])
def test_chunk_kda_checks_values_like_kda_chunked(change, mode):
    """The values kda_chunked rejects, chunk_kda rejects too (unless told not to look). On a GPU the default
    check runs inside the kernels, and its error comes with the next call or `raise_value_errors()`."""
    x = make(1, 20, 1, 16, 16, seed=9)
    x[change[0]][:, 3] = change[1]
    with pytest.raises(ValueError, match=f"^{change[0]} of shape"):
        kda_chunked(**x)
    with pytest.raises(ValueError, match=f"^{change[0]} of shape"):
        chunk_kda(**x, check_inputs=mode)
        raise_value_errors()
    assert chunk_kda(**x, check_inputs=False)[0].shape == x["v"].shape
    raise_value_errors()  # nothing is pending after an unchecked call


def test_check_inputs_takes_three_values():
    x = make(1, 20, 1, 16, 16, seed=9)
    with pytest.raises(ValueError, match="check_inputs must be True, False or \"sync\", got 'later'"):
        chunk_kda(**x, check_inputs="later")


@pytest.mark.skipif(DEVICE != "cuda", reason="the in-kernel check runs on CUDA tensors")
def test_the_in_kernel_check_raises_at_the_next_call():
    """A bad g on the GPU: the call returns NaN from that step on at once (no synchronisation), and the
    next call that finds the verdict ready raises, naming g; the call after that is clean."""
    x = make(1, 20, 1, 16, 16, seed=9)
    y = {n: t.clone() for n, t in x.items()}
    y["g"][:, 7] = 0.25
    o = chunk_kda(**y)[0]
    torch.cuda.synchronize()  # the verdict has arrived
    assert not bool(torch.isfinite(o[:, 7:]).any()) and bool(torch.isfinite(o[:, :7]).all())
    with pytest.raises(ValueError, match=r"^g of shape .*an earlier chunk_kda call"):
        chunk_kda(**x)
    assert bool(torch.isfinite(chunk_kda(**x)[0]).all())
    raise_value_errors()


def gradients(fn, x, dtype=torch.float32, seed=8, **kw):
    """Gradients of sum(o * do) + sum(final_state * dht), do and dht random, with respect to every input in x;
    q, k, v in `dtype` (float64: every input in float64, the reference). None when o has no gradient."""
    xs = {
        n: (t.double() if dtype == torch.float64 else t.to(dtype) if n in "qkv" else t)
        .detach()
        .requires_grad_()
        for n, t in x.items()
    }
    o, h = fn(**xs, output_final_state=True, **kw)
    if not o.requires_grad:
        return None
    gen = torch.Generator().manual_seed(seed)
    do, dht = (torch.randn(t.shape, generator=gen, dtype=torch.float64).to(DEVICE) for t in (o, h))
    ((o.double() * do).sum() + (h.double() * dht).sum()).backward()
    return {n: t.grad for n, t in xs.items()}


def grad_errors(got, ref):
    return {n: rel(got[n], ref[n]) for n in ref}


def per_sequence(cu):
    """kda_recurrent run on each sequence of cu alone, as one packed call: (o, final states)."""
    bounds = cu.tolist()

    def fn(initial_state, output_final_state, **parts):
        os_, hs = [], []
        for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            if eos == bos:  # an empty sequence: its final state is its initial state
                hs.append(initial_state[n : n + 1])
                continue
            p = {name: t[:, bos:eos] for name, t in parts.items()}
            o, h = kda_recurrent(**p, initial_state=initial_state[n : n + 1], output_final_state=True)
            os_.append(o)
            hs.append(h)
        return torch.cat(os_, dim=1), torch.cat(hs)

    return fn


GRAD_TOL = 1e-4 if DEVICE == "cpu" else 2e-3  # float32 gradients, as test_chunk_bwd.py's (CPU: 10x tighter)


@pytest.mark.parametrize("varlen", [False, True])
def test_fused_recurrent_gradients_match_the_float64_loop(varlen):
    """fused_recurrent_kda with inputs that require grad returns a differentiable output whose gradients
    (the chunked backward's) match autograd through the float64 loop."""
    cu = torch.tensor([0, 5, 5, 40], device=DEVICE) if varlen else None
    x = make(1, 40, 1, 16, 16, HV=2, h0=True, seed=7, gate=-2.0, N=3 if varlen else None)
    ref = gradients(kda_recurrent if cu is None else per_sequence(cu), x, torch.float64)
    got = gradients(fused_recurrent_kda, x, **({} if cu is None else dict(cu_seqlens=cu)))
    for name, err in grad_errors(got, ref).items():
        assert err <= GRAD_TOL, (name, err)


def test_fused_recurrent_gradient_limits_raise():
    x = make(1, 4, 1, 16, 16, h0=True)
    x["q"].requires_grad_()
    with pytest.raises(ValueError, match="inplace_final_state=False"):
        fused_recurrent_kda(**x, inplace_final_state=True)
    with torch.no_grad():  # decoding: no gradient, in place is fine
        fused_recurrent_kda(**x, inplace_final_state=True)


# Gradients through resets (CPU: float32 under the interpreter). The backward takes every decay as a sum of
# consecutive gates, never as a difference of two cumsums (which after resets of -1000 are ~-1400 and round by
# ~1e-4 of an exponent): dq, dk and dg are within 3e-6 of float64 (measured 1.1e-6 at most). dv and dbeta pass
# through the forward's intermediates (kd, the diagonal blocks of A and Aqk, from differences of 16-row gate
# cumsums in chunk.py): measured 5e-6 and 7e-6, held to the 1e-5. On a GPU, GRAD_TOL for all.
RESET_GRAD_TOL = (
    {"q": 3e-6, "k": 3e-6, "g": 3e-6, "v": 1e-5, "beta": 1e-5, "initial_state": 3e-6}
    if DEVICE == "cpu"
    else dict.fromkeys(("q", "k", "g", "v", "beta", "initial_state"), GRAD_TOL)
)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["hard_resets", "g_minus_inf"])
def test_resets_in_the_backward(case):
    """Gradients through hard resets (-1000 every 7 steps, over a chunk boundary) and g = -inf against
    autograd through the float64 loop."""
    x = hard_resets(T=70, K=16) if case == "hard_resets" else minus_inf_gates(T=45, K=16)
    errors = grad_errors(gradients(chunk_kda, x), gradients(kda_recurrent, x, torch.float64))
    for name, err in errors.items():
        assert err <= RESET_GRAD_TOL[name], (name, err)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_shared_gates_to_minus_300_in_the_backward(dtype):
    """One gate per head and step shared by all channels, uniform in [-300, 0] (mostly resets; every
    diagonal block in its pairwise branch): finite gradients close to float64; bf16 on a GPU (1e-2, as the
    strong-gate test below). CPU float32: 1e-5 (measured 3.4e-6 on dg)."""
    x = shared_gates(*((100, 32) if DEVICE == "cuda" else (40, 16)))
    ref = gradients(kda_recurrent, rounded(x, dtype), torch.float64)
    got = gradients(chunk_kda, x, dtype)
    tol = {torch.float32: 1e-5 if DEVICE == "cpu" else GRAD_TOL, torch.bfloat16: 1e-2}[dtype]
    for name, err in grad_errors(got, ref).items():
        assert err <= tol, (name, err)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_gates_at_the_bound_over_whole_chunks_in_the_backward(dtype):
    """Every gate at KDA's lower bound (-5, every channel, every step: whole chunks at the bound) gives
    finite gradients close to float64.

    dg is held against the size of what it is summed from, not against its own size. With every gate at -5
    the output hardly depends on the gates (a decay of e^-5 per step), so ||dg|| is ~1/150 of the products
    q * dq and k * dk that the backward adds up to form it: bf16 intermediates (eps 3.9e-3) then leave dg
    0.34 from float64 relative to ||dg|| (H200, session 8), while its error is 2.3e-3 of the size of those
    products, under bf16's epsilon. So in bf16 dg's error is measured against ||dg|| + ||(q dq, k dk)||
    (float64 reference), within 1e-2 as the other gradients; in float32 against ||dg|| alone, within 1e-3
    (sums of very different sizes, as test_chunk_bwd.py's strong-gate test)."""
    x = _at_the_bound()
    ref = gradients(kda_recurrent, rounded(x, dtype), torch.float64)
    got = gradients(chunk_kda, x, dtype)
    tol = {torch.float32: 1e-3 if DEVICE == "cpu" else 2e-3, torch.bfloat16: 1e-2}[dtype]
    for name, err in grad_errors(got, ref).items():
        assert torch.isfinite(got[name]).all(), name
        if name == "g" and dtype == torch.bfloat16:
            q, k = rounded(x, dtype)["q"].double(), rounded(x, dtype)["k"].double()
            scale = q.shape[-1] ** -0.5
            terms = torch.cat([(scale * q * ref["q"]).flatten(), (k * ref["k"]).flatten()]).norm()
            size = ref["g"].norm() + terms
            err = ((got["g"].double() - ref["g"]).norm() / size).item()
        assert err <= tol, (name, err)


def test_kernels_refuse_tensors_they_cannot_reach(monkeypatch):
    """Compiled kernels (simulated: the interpreter flag off) refuse CPU tensors; the interpreter refuses
    tensors off the CPU. The error names the argument and what to do."""
    from kda_edu.kernels.chunk import chunk_kda as launch_chunk

    x = make(1, 8, 1, 16, 16)
    off_cpu = {n: t.to("meta") for n, t in x.items()}
    if DEVICE == "cpu":
        with pytest.raises(
            ValueError, match="q is on meta, but Triton runs kernels through its CPU interpreter"
        ):
            launch_chunk(**off_cpu, check_inputs=False)
        monkeypatch.setattr(_backend, "interpreting", lambda: False)
        for fn in (launch_chunk, fused_recurrent_kda):
            with pytest.raises(
                ValueError, match=r"q is on cpu, but the Triton kernels are compiled .*\(q\.cuda\(\)\)"
            ):
                fn(**x)
    else:
        with pytest.raises(ValueError, match="q is on cpu, but the Triton kernels are compiled"):
            launch_chunk(**{n: t.cpu() for n, t in x.items()})
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
        with pytest.raises(ValueError, match="bfloat16, which this GPU .*7.5.* float16 or float32"):
            fused_recurrent_kda(**{n: t.bfloat16() if n in "qkv" else t for n, t in x.items()})


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_value_check_is_skipped_while_a_cuda_graph_is_captured():
    """train.py records whole training steps as CUDA graphs: chunk_kda's value check (its read-back of the
    verdict) must stand aside during the capture, and the replay gives the eager result (same kernels, same
    inputs)."""
    x = make(1, 70, 1, 16, 16, seed=11)
    eager = chunk_kda(**x)[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph asks
        chunk_kda(**x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chunk_kda(**x)[0]
    graph.replay()
    torch.cuda.synchronize()
    assert rel(captured, eager) <= 1e-6


# ---------------------------------------------------------------------------------------------------------
# The table of issue 18 (run as a script)


def _try(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except Exception as e:  # the table records what a call did, an error included
        return f"{type(e).__name__}: {str(e)[:60]}"


def _grad_error(path, dtype=torch.float32):
    """Largest relative error of the gradients of `path` against autograd through the float64 loop."""
    x = make(1, 67, 1, 16, 16, HV=2, h0=True, seed=7, gate=-2.0)
    got = gradients({"chunk_kda": chunk_kda, "fused_recurrent_kda": fused_recurrent_kda}[path], x, dtype)
    if got is None:
        return "o.requires_grad is False"
    return max(grad_errors(got, gradients(kda_recurrent, rounded(x, dtype), torch.float64)).values())


def _grad_case(x, dtype):
    """chunk_kda's gradients on inputs x (q, k, v in `dtype`): the relative error of each against float64."""
    got = gradients(chunk_kda, x, dtype)
    return {
        n: f"{e:.1e}"
        for n, e in grad_errors(got, gradients(kda_recurrent, rounded(x, dtype), torch.float64)).items()
    }


def _at_the_bound():
    """Every gate at KDA's lower bound, -5, on every channel and step (whole chunks at the bound)."""
    x = make(1, 70, 1, 16, 16, h0=True, seed=10)
    x["g"] = torch.full_like(x["g"], -5.0)
    return x


GPU = DEVICE == "cuda"
GRAD_CASES = {  # the backward's cases of issue 18 (larger on a GPU)
    "hard resets -1000 every 7": lambda: hard_resets(T=100, K=32) if GPU else hard_resets(T=70, K=16),
    "g = -inf": lambda: minus_inf_gates(T=100 if GPU else 45, K=32 if GPU else 16),
    "shared gates to -300": lambda: shared_gates(*((100, 32) if GPU else (40, 16))),
    "gates at -5 over whole chunks": _at_the_bound,
}


def _causality(path, where):
    """Error of the outputs before a NaN at step BAD_STEP of `where`, against the float64 loop on those steps."""
    x = make(1, 50, 2, 16, 16, h0=True, seed=6)
    y = {n: t.clone() for n, t in x.items()}
    y[where][:, BAD_STEP, :, 3] = math.nan
    o, _ = run(path, y)
    ref = reference({n: t[:, :BAD_STEP] if n != "initial_state" else t for n, t in x.items()})[0]
    return rel(o[:, :BAD_STEP], ref)


def _contract():
    """What chunk_kda does with g > 0, beta > 1 and a NaN gate (kda_chunked raises on each)."""
    out = {}
    for name, change in (("g>0", ("g", 0.5)), ("beta>1", ("beta", 1.5)), ("g NaN", ("g", math.nan))):
        x = make(1, 20, 1, 16, 16, seed=9)
        x[change[0]][:, 3] = change[1]
        out[name] = _try(lambda x=x: "no error, o finite: " + str(bool(chunk_kda(**x)[0].isfinite().all())))
    return out


def measure() -> dict:
    """Every case of issue 18 on every path: the relative error against the float64 loop, or what happened."""
    table = {}
    for case, build in CASES.items():
        for path in (*PATHS, "kda_chunked_matmul"):
            for dtype in DTYPES if path not in CHUNKED else [torch.float32]:
                table[f"{case} / {path} / {str(dtype)[6:]}"] = _try(error, path, build(), dtype)
    for path in ("chunk_kda", "fused_recurrent_kda"):
        x = make(1, 70, 1, 16, 24, HV=2, h0=True, N=2, seed=5)
        table[f"strided cu_seqlens / {path}"] = _try(error, path, x, cu_seqlens=strided_cu())
        for dtype in DTYPES:
            table[f"gradients vs float64 / {path} / {str(dtype)[6:]}"] = _try(_grad_error, path, dtype)
    for case, build in GRAD_CASES.items():
        for dtype in DTYPES:
            table[f"gradients, {case} / chunk_kda / {str(dtype)[6:]}"] = _try(_grad_case, build(), dtype)
    for path in PATHS:
        for where in ("k", "v", "q"):
            table[f"NaN in {where} at t={BAD_STEP}, outputs before t / {path}"] = _try(
                _causality, path, where
            )
    table["chunk_kda contract"] = _contract()
    return table


if __name__ == "__main__":
    torch.set_num_threads(1) if DEVICE == "cpu" else None
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (Triton interpreter)"}
    result["errors"] = measure()
    for key, value in result["errors"].items():
        print(f"{key:70s} {value if isinstance(value, str | dict) else f'{value:.2e}'}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "numerics.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
    sys.exit(0)
