"""Gradients of kda_edu.kernels.chunk_kda against float64 autograd through the KDA loop.

The target: autograd through `kda_recurrent` in float64. The first test checks that target against autograd
through `kda_chunked` (the algorithm the kernels implement), so the derivation in chunk_bwd.py's docstring is
checked on the PyTorch level before any kernel runs. On a CPU the kernels run through Triton's interpreter in
float32 (tiny shapes, relative RMS error <= 1e-5); on a CUDA machine the same tests run compiled, plus bf16
(<= 1e-2) and float32 (<= 2e-3) checks at larger shapes. The varlen tests (cu_seqlens) hold a packed row to
the float64 loop run on each sequence alone, and to chunk_kda's own backward on each sequence alone.
"""

import functools
import types
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from test_chunk_varlen import LENGTHS, cu_of, per_sequence

from kda_edu.kernels import chunk as chunk_mod
from kda_edu.kernels import chunk_bwd, chunk_common, chunk_fwd, chunk_kda
from kda_edu.ops.kda import kda_chunked, kda_recurrent

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("q", "k", "v", "g", "beta", "h0")


def make_inputs(B, T, H, HV, K, V, gate=-5.0, seed=0, device=DEVICE, n_states=None):
    """Inputs, dO and dht; h0 and dht have n_states rows (one per sequence with cu_seqlens), else B."""
    gen = torch.Generator().manual_seed(seed)
    S = B if n_states is None else n_states
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = gate * torch.rand(B, T, HV, K, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(S, HV, K, V, generator=gen)
    do = torch.randn(B, T, HV, V, generator=gen)
    dht = torch.randn(S, HV, K, V, generator=gen)
    return [x.to(device) for x in (q, k, v, g, beta, h0)], do.to(device), dht.to(device)


def grads(fn, inputs, do, dht, dtype=None, with_state=True, use_ht=True):
    """Gradients of sum(o * do) + sum(ht * dht) with respect to every input (h0 only when used)."""
    n = 6 if with_state else 5
    xs = [x.detach().clone() for x in inputs[:n]]
    if dtype is not None:  # q, k, v in `dtype`; g, beta, h0 stay float32 (float64 for the oracle)
        xs[:3] = [x.to(dtype) for x in xs[:3]]
        if dtype == torch.float64:
            xs = [x.double() for x in xs]
    xs = [x.requires_grad_() for x in xs]
    o, ht = fn(*xs[:5], initial_state=xs[5] if with_state else None, output_final_state=use_ht)
    loss = (o.double() * do.double()).sum()
    if use_ht:
        loss = loss + (ht.double() * dht.double()).sum()
    loss.backward()
    return [x.grad for x in xs]


def rel_rms(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def oracle(inputs, do, dht, **kw):
    """float64 autograd through the loop (on the GPU when there is one: the loop is launch-bound)."""
    return grads(kda_recurrent, inputs, do, dht, dtype=torch.float64, **kw)


def test_chunked_autograd_is_the_target():
    """The derivation's starting point: autograd through kda_chunked equals autograd through the loop."""
    inputs, do, dht = make_inputs(1, 45, 1, 2, 8, 6)
    ref = oracle(inputs, do, dht)

    def chunked(*a, **kw):
        return kda_chunked(*a, chunk_size=16, **kw)

    got = grads(chunked, inputs, do, dht, dtype=torch.float64)
    for name, x, r in zip(NAMES, got, ref, strict=False):
        assert rel_rms(x, r) < 1e-10, name


CASES = {
    # (B, T, H, HV, K, V), gate, with_state, use_ht
    "one_chunk": ((1, 64, 1, 1, 16, 16), -5.0, True, True),
    "tail_two_batches": ((2, 100, 1, 1, 32, 16), -5.0, True, True),
    "K_ne_V_non_pow2_zero_state": ((1, 70, 1, 1, 48, 40), -5.0, False, True),
    "grouped_values_no_final_state": ((1, 80, 1, 2, 32, 32), -5.0, True, False),
    "T=1": ((1, 1, 1, 1, 16, 16), -5.0, True, True),
    "strong_gates_pairwise_path": ((1, 40, 1, 1, 16, 16), -20.0, True, True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_gradients_match_fp64_loop(case):
    shape, gate, with_state, use_ht = case
    inputs, do, dht = make_inputs(*shape, gate=gate)
    kw = dict(with_state=with_state, use_ht=use_ht)
    ref = oracle(inputs, do, dht, **kw)
    got = grads(chunk_kda, inputs, do, dht, **kw)
    tol = 1e-5 if DEVICE == "cpu" else 2e-3
    for name, x, r in zip(NAMES, got, ref, strict=False):
        assert x.shape == r.shape and x.dtype == inputs[NAMES.index(name)].dtype, name
        assert torch.isfinite(x).all(), name
        assert rel_rms(x, r) <= tol, (name, rel_rms(x, r))


def test_forward_with_autograd_is_the_inference_forward():
    """Inputs that require gradients go through the autograd Function (`ChunkKDAFunction`), inputs that do not
    through the plain forward; both launch the same kernels on the same inputs in the same order, so the
    outputs agree bit for bit (a Function that launched another tile size or precision would not)."""
    inputs, _, _ = make_inputs(1, 70, 1, 2, 16, 16)
    plain = chunk_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    trained = chunk_kda(*xs[:5], initial_state=xs[5], output_final_state=True)
    assert plain[0].grad_fn is None and type(trained[0].grad_fn).__name__.startswith("ChunkKDAFunction")
    assert torch.equal(plain[0], trained[0].detach()) and torch.equal(plain[1], trained[1].detach())


@pytest.mark.slow
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_kept_intermediates_give_the_same_bits(varlen):
    """keep_intermediates hands some of the forward's buffers to the backward instead of recomputing them
    (all of them; or X, Aqk and qg, and the w/u kernel remakes the rest): the same arithmetic on the same
    inputs, so outputs and all six gradients agree with those of "none" within 1e-6 relative (a few float32
    roundings; chapter 9 states the same bound; a buffer handed over wrongly is off by order 1). The first
    backward empties the kept buffers; a second one (retain_graph) recomputes and agrees too. The dense case
    spells "all" as True, its documented synonym. Both modes against one run that keeps nothing. One value head
    here; buffers of two value heads handed over are test_gradients_after_a_forward_in_pieces's."""
    if varlen:
        inputs, do, dht = make_inputs(1, 75, 1, 1, 16, 32, n_states=2)
        cu = torch.tensor([0, 70, 75], device=DEVICE)
    else:
        inputs, do, dht = make_inputs(1, 70, 1, 1, 16, 32)
        cu = None

    def run(keep, backwards=1):
        kept_names = set(chunk_common.KEEP_MODES[chunk_common.keep_mode(keep)]) if keep else set()
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        o, ht = chunk_kda(
            *xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu, keep_intermediates=keep
        )
        kept = o.grad_fn.kept
        assert (set(kept) if kept is not None else set()) == kept_names
        loss = (o * do).sum() + (ht * dht).sum()
        out = []
        for i in range(backwards):
            got = torch.autograd.grad(loss, xs, retain_graph=i + 1 < backwards)
            out.append(got)
            assert o.grad_fn.kept is None  # the buffers were handed over (or never kept)
        return (o.detach(), ht.detach()), out

    (o_a, ht_a), (grads_a,) = run(False)
    for mode in ("matrices", "all"):
        (o_b, ht_b), (grads_b, grads_again) = run(True if mode == "all" and not varlen else mode, backwards=2)
        assert rel_rms(o_b, o_a) <= 1e-6 and rel_rms(ht_b, ht_a) <= 1e-6, mode
        for name, a, b, c in zip(NAMES, grads_a, grads_b, grads_again, strict=True):
            assert rel_rms(b, a) <= 1e-6 and rel_rms(c, a) <= 1e-6, (mode, name)


@pytest.mark.parametrize("bad", ["yes", "w", 1, None])
def test_rejects_an_unknown_keep_mode(bad):
    inputs, _, _ = make_inputs(1, 4, 1, 1, 16, 16)
    xs = [x.detach().clone().requires_grad_() for x in inputs[:5]]
    with pytest.raises(ValueError, match="keep_intermediates must be True, False or one of"):
        chunk_kda(*xs, keep_intermediates=bad)


def test_rejects_unsupported_dtype():
    inputs, _, _ = make_inputs(1, 4, 1, 1, 16, 16)
    with pytest.raises(TypeError, match="bfloat16"):
        chunk_kda(*[x.double() for x in inputs[:5]])


VARLEN_CASES = {
    # with_state, use_ht
    "initial_state": (True, True),
    "zero_state": (False, True),
    "no_final_state": (True, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", VARLEN_CASES.values(), ids=VARLEN_CASES.keys())
def test_varlen_gradients_match_fp64_loop_per_sequence(case):
    """All six gradients of a packed row (lengths 1, 70, 0, 64, 5; HV = 2 H) against float64 autograd through
    the loop on each sequence alone: no gradient crosses a sequence boundary, dh0 is per sequence."""
    with_state, use_ht = case
    lengths = LENGTHS[:4] if with_state else LENGTHS  # the 5-step tail once is enough (interpreter time)
    cu = cu_of(lengths)
    inputs, do, dht = make_inputs(1, sum(lengths), 1, 2, 16, 16, n_states=len(lengths))
    kw = dict(with_state=with_state, use_ht=use_ht)
    ref = grads(per_sequence(kda_recurrent, cu), inputs, do, dht, dtype=torch.float64, **kw)
    got = grads(functools.partial(chunk_kda, cu_seqlens=cu), inputs, do, dht, **kw)
    tol = 1e-5 if DEVICE == "cpu" else 2e-3
    for name, x, r in zip(NAMES, got, ref, strict=False):
        assert x.shape == r.shape and x.dtype == inputs[NAMES.index(name)].dtype, name
        assert torch.isfinite(x).all(), name
        assert rel_rms(x, r) <= tol, (name, rel_rms(x, r))
    if with_state:  # the empty sequence: its final state is h0, so dh0 = dht (or 0 without a final state)
        empty = lengths.index(0)
        assert torch.equal(got[5][empty], dht[empty] if use_ht else torch.zeros_like(dht[empty]))


@pytest.mark.slow
def test_varlen_gradients_equal_separate_runs():
    """A packed row's gradients are chunk_kda's own gradients of each sequence run alone (same chunks, same
    kernels: bit for bit under the interpreter), with one sequence longer than two chunks."""
    lengths = [130, 0, 7]
    cu = cu_of(lengths, torch.int64)
    inputs, do, dht = make_inputs(1, sum(lengths), 1, 1, 16, 16, seed=1, n_states=len(lengths))
    ref = grads(per_sequence(chunk_kda, cu), inputs, do, dht)
    got = grads(functools.partial(chunk_kda, cu_seqlens=cu), inputs, do, dht)
    for name, x, r in zip(NAMES, got, ref, strict=True):
        assert rel_rms(x, r) <= 1e-6, (name, rel_rms(x, r))


PIECES = {  # chunk.py's `time_pieces` forms, forced (the interpreter's default is one piece): B x 150 steps
    "time_3": (1, 3),  # three pieces of the time axis, one chunk each (two full chunks and a tail)
    "both": (2, [(0, 2, 0, 2), (0, 1, 2, 1), (1, 1, 2, 1)]),  # a piece of time, then one per sequence
}


@pytest.mark.slow
@pytest.mark.parametrize("keep", ["matrices", True], ids=["matrices", "kept"])
@pytest.mark.parametrize("case", PIECES.values(), ids=PIECES.keys())
def test_gradients_after_a_forward_in_pieces(case, keep):
    """The forward in pieces (on a GPU each piece's scan on a side stream), then the backward: every gradient
    against the float64 loop, with h0 and dht, two value heads per key head. The backward reads the buffers
    that the pieces' prepare kernels filled (keeping nothing, it would read only the inputs, which the forward
    saves whatever its pieces: that case is test_gradients_match_fp64_loop's)."""
    B, pieces = case
    inputs, do, dht = make_inputs(B, 150, 1, 2, 32, 16)
    ref = oracle(inputs, do, dht)
    with mock.patch.object(
        chunk_fwd, "chunk_kda_fwd", functools.partial(chunk_fwd.chunk_kda_fwd, pieces=pieces)
    ):
        got = grads(functools.partial(chunk_kda, keep_intermediates=keep), inputs, do, dht)
    tol = 1e-5 if DEVICE == "cpu" else 2e-3
    for name, x, r in zip(NAMES, got, ref, strict=True):
        assert rel_rms(x, r) <= tol, (name, rel_rms(x, r))


KNOBS = {  # the chunk-local kernels split over key blocks: several blocks per chunk, a last one past K
    "lk16_lv16": dict(lk_block=16, lv_block=16),
    "lk16_lv32_8warps": dict(lk_block=16, lk_warps=8, lv_block=32, lv_warps=4),
    "lk64_lv16": dict(lk_block=64, lv_block=16),  # local_k with one key block for K <= 64
}


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("knobs", KNOBS.values(), ids=KNOBS.keys())
def test_gradients_with_small_key_blocks(knobs, varlen):
    """Gradients with `_local_k_kernel` / `_local_v_kernel` forced to small key blocks: K = 48 (padded to 64,
    so the last 16-channel block is all padding) or, packed, K = 32; dbeta and dA are sums of block shares."""
    original = chunk_bwd.chunk_kda_bwd
    if varlen:
        lengths = [70, 0, 5]
        cu = cu_of(lengths)
        inputs, do, dht = make_inputs(1, sum(lengths), 1, 1, 32, 16, n_states=len(lengths))
        fn, ref_fn = functools.partial(chunk_kda, cu_seqlens=cu), per_sequence(kda_recurrent, cu)
    else:
        inputs, do, dht = make_inputs(1, 70, 1, 1, 48, 40)
        fn, ref_fn = chunk_kda, kda_recurrent
    ref = grads(ref_fn, inputs, do, dht, dtype=torch.float64)
    with mock.patch.object(chunk_bwd, "chunk_kda_bwd", functools.partial(original, **knobs)):
        got = grads(fn, inputs, do, dht)
    tol = 1e-5 if DEVICE == "cpu" else 2e-3
    for name, x, r in zip(NAMES, got, ref, strict=True):
        assert rel_rms(x, r) <= tol, (name, rel_rms(x, r))


@pytest.mark.parametrize("HV", [1, 2], ids=["HV_eq_H", "HV_gt_H"])
def test_bf16_gradients_come_back_in_the_input_dtype(HV):
    """bf16 q, k, v: dq, dk, dv in bf16 (with HV == H `_local_k_kernel` writes them in bf16 itself, with HV > H
    the launcher sums the value heads in float32 and casts), g's and beta's gradients float32."""
    inputs, do, dht = make_inputs(1, 70, 1, HV, 32, 16, seed=5)
    inputs[:3] = [x.to(torch.bfloat16).float() for x in inputs[:3]]  # the oracle sees the rounded q, k, v
    ref = oracle(inputs, do, dht)
    got = grads(chunk_kda, inputs, do, dht, dtype=torch.bfloat16)
    assert [x.dtype for x in got] == [torch.bfloat16] * 3 + [torch.float32] * 3
    for name, x, r in zip(NAMES, got, ref, strict=True):
        assert rel_rms(x, r) <= 1e-2, (name, rel_rms(x, r))


STRONG_GATES = {  # dtype ids: the interpreter runs float32 only; a GPU also bf16 (Gated DeltaNet's recall runs)
    "cpu": [torch.float32],
    "cuda": [torch.bfloat16, torch.float32],
}


@pytest.mark.parametrize("dtype", STRONG_GATES[DEVICE], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("gate", [-60.0, -300.0])
def test_strong_gates_shared_across_channels(gate, dtype):
    """Gated DeltaNet's case: one decay per head, copied to every key channel, with the unbounded gate
    (-exp(A_log) softplus(.)) far below KDA's -5 bound: down to `gate` per step, so that a 16-step block decays
    by up to e^-4800. Every gradient stays finite and close to float64 (dg least: it sums terms of very
    different sizes). On a GPU also in bf16, as the recall sweep trains."""
    inputs, do, dht = make_inputs(1, 70, 1, 1, 16, 16, gate=gate, seed=1)
    inputs[3] = inputs[3][..., :1].expand_as(inputs[3]).contiguous()
    inputs[:3] = [x.to(dtype).float() for x in inputs[:3]]  # the oracle sees the rounded q, k, v
    ref = oracle(inputs, do, dht)
    got = grads(chunk_kda, inputs, do, dht, dtype=dtype)
    tol = {torch.float32: 1e-3 if DEVICE == "cpu" else 2e-3, torch.bfloat16: 1e-2}[dtype]
    for name, x, r in zip(NAMES, got, ref, strict=True):
        assert torch.isfinite(x).all(), name
        err = rel_rms(x, r)
        print(f"gate {gate} {dtype} d{name}: {err:.2e}")
        assert err <= tol, (name, err)


def test_a_gate_below_the_floor_gets_no_gradient():
    """A gate below GATE_FLOOR (-105 in float32) is raised to it: the output does not depend on it, so its
    dg is exactly 0 by design (without the zeroing it is what is left of terms that cancel). One step with
    every key channel at -300, one channel of another step at -1e4, in different chunks; the other
    gradients stay close to float64 (1e-3, as with strong gates)."""
    inputs, do, dht = make_inputs(1, 70, 1, 1, 16, 16, seed=3)
    inputs[3][0, 20, 0, :] = -300.0
    inputs[3][0, 66, 0, 3] = -1e4
    ref = oracle(inputs, do, dht)
    got = grads(chunk_kda, inputs, do, dht)
    dg = got[3]
    below = dg[0, 20, 0].abs().max().item(), dg[0, 66, 0, 3].abs().item()
    assert below == (0.0, 0.0), f"dg of gates below the floor: {below}"
    for name, x, r in zip(NAMES, got, ref, strict=True):
        err = rel_rms(x, r)
        assert torch.isfinite(x).all() and err <= 1e-3, (name, err)


@pytest.mark.parametrize("gate", [-5.0, -12.0, -20.0])
def test_dg_error_is_relative_to_dg(gate):
    """Constant gates: the true dg is about e^gate times the other gradients, so an error that is absolute
    (rounding of terms that cancel, about 1e-7 of the other gradients) is unbounded relative to it. Measured
    against the float64 loop before the large cancelling terms were left out (chunk_bwd.py, "Rounding of
    dg"): 6.8e-5, 5.1e-2 and 1.2e2 at -5, -12 and -20; now about 1e-6, 6e-7 and 4e-7."""
    inputs, do, dht = make_inputs(1, 100, 1, 2, 16, 16, seed=2)
    inputs[3] = torch.full_like(inputs[3], gate)
    ref = oracle(inputs, do, dht)
    got = grads(chunk_kda, inputs, do, dht)
    tol = 1e-5 if DEVICE == "cpu" else 1e-4
    for name, x, r in zip(NAMES, got, ref, strict=True):
        err = rel_rms(x, r)
        print(f"gate {gate} d{name}: {err:.2e}")
        assert err <= tol, (name, err)


GPU_CASES = {  # few cases: each new (dtype, K, V) compiles six kernels, about 40 s on the GPU machine
    "awkward_T_K_ne_V_grouped": ((2, 1000, 2, 4, 128, 64), True),
    "K_V_128_tail_zero_state": ((1, 777, 2, 2, 128, 128), False),
    # The recall models' shape class: one chunk per sequence (NT = 1, which Triton specialises as a constant)
    # and K = V = 64. A GPU recall run crashed on an illegal memory access in a wave that held T = 64 runs.
    "one_chunk_K_V_64": ((8, 64, 2, 2, 64, 64), True),
}


@pytest.mark.skipif(DEVICE != "cuda", reason="compiled kernels need a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_gpu_gradients(case, dtype):
    shape, with_state = case
    inputs, do, dht = make_inputs(*shape, gate=-5.0, seed=3)
    inputs[:3] = [x.to(dtype).float() for x in inputs[:3]]  # the oracle sees the rounded q, k, v
    ref = oracle(inputs, do, dht, with_state=with_state)
    got = grads(chunk_kda, inputs, do, dht, dtype=dtype, with_state=with_state)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    for name, x, r in zip(NAMES, got, ref, strict=False):
        err = rel_rms(x, r)
        print(f"{dtype} {shape} d{name}: {err:.2e}")
        assert err <= tol, (name, err)


class _NanEmpty(types.ModuleType):
    """`torch`, except that `empty` fills what it returns with NaN (integer tensors with -7)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*size, **kw):
        x = torch.empty(*size, **kw)
        return x.fill_(float("nan") if x.dtype.is_floating_point else -7)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dense", "varlen", "one_chunk"])
def test_uninitialised_buffers_are_never_read(case):
    """Every buffer that the forward and the backward take from torch.empty is written before anything reads
    it: with those buffers filled with NaN the gradients keep the same bits. Key blocks of 16 (several programs
    per chunk; K = 48 padded to 64), a tail chunk, and varlen chunks. Fresh memory is often zero, so without
    this a kernel that reads an unwritten entry can pass under the interpreter and fail on a GPU. On a GPU it
    also compares two runs bit for bit (no kernel uses atomics), which a race inside a program would break.
    "one_chunk": every sequence is one full chunk (NT = 1), K = V = 64, as in the recall models."""
    if case == "varlen":
        lengths = [70, 0, 5]
        cu = cu_of(lengths)
        inputs, do, dht = make_inputs(1, sum(lengths), 1, 1, 32, 16, n_states=len(lengths))
        fn = functools.partial(chunk_kda, cu_seqlens=cu)
    elif case == "one_chunk":
        inputs, do, dht = make_inputs(1, 64, 1, 2, 64, 64)
        fn = chunk_kda
    else:
        inputs, do, dht = make_inputs(1, 70, 1, 1, 48, 40)
        fn = chunk_kda
    small = functools.partial(chunk_bwd.chunk_kda_bwd, lk_block=16, lv_block=16)
    with mock.patch.object(chunk_bwd, "chunk_kda_bwd", small):
        ref = grads(fn, inputs, do, dht)
        nan_torch = _NanEmpty("torch")
        with (
            mock.patch.object(chunk_bwd, "torch", nan_torch),
            mock.patch.object(chunk_mod, "torch", nan_torch),
        ):
            got = grads(fn, inputs, do, dht)
    for name, x, r in zip(NAMES, got, ref, strict=True):
        assert torch.equal(x, r), (name, (x - r).abs().max().item())
