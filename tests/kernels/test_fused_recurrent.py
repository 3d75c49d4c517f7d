"""kda_edu.kernels.fused_recurrent_kda against the float64 loop (kda_edu.ops.kda.kda_recurrent) and fla.

On a CPU these run through Triton's interpreter, so the shapes are tiny and the inputs float32;
on a CUDA machine the same tests run the compiled kernel.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from reference_inputs import BAD_CU_IDS, BAD_CU_SEQLENS, kda_oracle, rel_err

from kda_edu.kernels import fused_recurrent_kda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5  # float32 kernel against the float64 loop, relative to the reference's norm


def make_inputs(B, T, H, HV, K, V, dtype=torch.float32, n_states=None, seed=0):
    """Random KDA inputs: l2-normalised keys, log-sigmoid decay (<= 0), beta in (0, 1), a random state."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = randn(B, T, H, K)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, HV, V)
    g = F.logsigmoid(randn(B, T, HV, K) + 2.0)
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = randn(B if n_states is None else n_states, HV, K, V)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    return tuple(x.to(DEVICE) for x in (q, k, v, g, beta, h0))


SHAPES = {
    # (B, T, H, HV, K, V)
    "decode_step": (2, 1, 2, 2, 16, 16),
    "several_steps": (2, 6, 2, 2, 16, 16),
    "K_ne_V": (2, 4, 2, 2, 16, 32),
    "non_power_of_2": (1, 5, 1, 1, 12, 20),
    "grouped_values": (2, 3, 2, 6, 8, 8),
    "odd_everything": (1, 4, 1, 3, 33, 7),
}


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_fp64_loop(shape, with_state):
    q, k, v, g, beta, h0 = make_inputs(*shape)
    h0 = h0 if with_state else None
    o, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = kda_oracle(q, k, v, g, beta, h0)
    assert o.dtype == torch.float32 and o.shape == v.shape
    assert ht.dtype == torch.float32 and ht.shape == ht_ref.shape
    assert rel_err(o, o_ref) <= TOL
    assert rel_err(ht, ht_ref) <= TOL


def test_largest_head_size():
    q, k, v, g, beta, h0 = make_inputs(1, 2, 1, 1, 256, 256)
    o, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = kda_oracle(q, k, v, g, beta, h0)
    assert rel_err(o, o_ref) <= TOL and rel_err(ht, ht_ref) <= TOL


def test_scale_and_no_final_state():
    q, k, v, g, beta, h0 = make_inputs(1, 3, 1, 2, 16, 8)
    o, ht = fused_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=h0)
    assert ht is None
    assert rel_err(o, kda_oracle(q, k, v, g, beta, h0, scale=0.3)[0]) <= TOL
    o_default, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0)
    o_explicit, _ = fused_recurrent_kda(q, k, v, g, beta, scale=16**-0.5, initial_state=h0)
    torch.testing.assert_close(o_default, o_explicit, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    """Half-precision inputs give half-precision outputs; the state stays float32 and exact."""
    q, k, v, g, beta, h0 = make_inputs(1, 3, 1, 2, 16, 16, dtype=dtype)
    o, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = kda_oracle(q, k, v, g, beta, h0)
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert rel_err(o, o_ref) <= 1e-2  # one rounding of o to 8 (bf16) or 11 (fp16) bits
    assert rel_err(ht, ht_ref) <= TOL


def test_inplace_decoding_loop():
    """T single-token calls updating one state buffer in place equal one call over all T tokens."""
    q, k, v, g, beta, h0 = make_inputs(2, 4, 1, 2, 12, 20)
    o_ref, ht_ref = kda_oracle(q, k, v, g, beta, h0)
    state = h0.clone()
    storage = state.untyped_storage().data_ptr()
    for t in range(4):
        o_t, ht = fused_recurrent_kda(
            *(x[:, t : t + 1] for x in (q, k, v, g, beta)), initial_state=state, inplace_final_state=True
        )
        assert ht is state and state.untyped_storage().data_ptr() == storage
        assert rel_err(o_t, o_ref[:, t : t + 1]) <= TOL
    assert rel_err(state, ht_ref) <= TOL


def test_inplace_errors():
    q, k, v, g, beta, h0 = make_inputs(1, 1, 1, 1, 8, 8)
    with pytest.raises(ValueError, match="inplace_final_state=True needs an initial_state"):
        fused_recurrent_kda(q, k, v, g, beta, inplace_final_state=True)
    strided = h0.transpose(-1, -2).contiguous().transpose(-1, -2)
    with pytest.raises(ValueError, match="contiguous"):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=strided, inplace_final_state=True)
    with pytest.raises(TypeError, match="initial_state .* must be torch.float32"):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=h0.half(), inplace_final_state=True)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
def test_varlen_equals_separate_runs(index_dtype, with_state):
    """Packed sequences (one of them empty) each behave as if run alone, with their own states."""
    lengths = [3, 0, 1, 4]
    T = sum(lengths)
    q, k, v, g, beta, h0 = make_inputs(1, T, 1, 2, 12, 10, n_states=len(lengths))
    h0 = h0 if with_state else None
    cu = torch.tensor([0, 3, 3, 4, 8], dtype=index_dtype, device=DEVICE)
    o, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == v.shape and ht.shape == (4, 2, 12, 10)
    for n in range(len(lengths)):
        bos, eos = cu[n].item(), cu[n + 1].item()
        h0_n = None if h0 is None else h0[n : n + 1]
        if bos == eos:  # an empty sequence hands its initial state through unchanged
            expected = torch.zeros_like(ht[n]) if h0 is None else h0[n]
            torch.testing.assert_close(ht[n], expected, rtol=0, atol=0)
            continue
        o_ref, ht_ref = kda_oracle(*(x[:, bos:eos] for x in (q, k, v, g, beta)), h0_n)
        assert rel_err(o[:, bos:eos], o_ref) <= TOL
        assert rel_err(ht[n : n + 1], ht_ref) <= TOL


def test_varlen_inplace():
    q, k, v, g, beta, h0 = make_inputs(1, 5, 1, 1, 8, 8, n_states=2)
    cu = torch.tensor([0, 2, 5], device=DEVICE)
    expected = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    state = h0.clone()
    o, ht = fused_recurrent_kda(
        q, k, v, g, beta, initial_state=state, cu_seqlens=cu, inplace_final_state=True
    )
    assert ht is state
    # The in-place variant differs only in where it stores the state: within 1e-6 (see test_chunk_varlen's
    # one-sequence test for the bound), not bit for bit, which two compiled variants do not owe each other.
    assert rel_err(o, expected[0]) <= 1e-6 and rel_err(state, expected[1]) <= 1e-6


@pytest.mark.parametrize(
    "cu, error, message", [([0, 2, 4], None, None), *BAD_CU_SEQLENS], ids=["valid", *BAD_CU_IDS]
)
def test_varlen_validation(cu, error, message):
    q, k, v, g, beta, _ = make_inputs(1, 4, 1, 1, 8, 8)
    cu = torch.tensor(cu, device=DEVICE)
    if error is None:
        fused_recurrent_kda(q, k, v, g, beta, cu_seqlens=cu)
        return
    with pytest.raises(error, match=message):
        fused_recurrent_kda(q, k, v, g, beta, cu_seqlens=cu)


def test_varlen_batch_and_state_errors():
    q, k, v, g, beta, h0 = make_inputs(2, 4, 1, 1, 8, 8)
    with pytest.raises(ValueError, match="batch size must be 1"):
        fused_recurrent_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4], device=DEVICE))
    q, k, v, g, beta = (x[:1] for x in (q, k, v, g, beta))
    three = torch.tensor([0, 1, 2, 4], device=DEVICE)
    with pytest.raises(ValueError, match="one state per sequence"):  # 2 states for 3 sequences
        fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=three)
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        fused_recurrent_kda(q, k, v, g, beta, cu_seqlens=[0, 4])


def test_bad_inputs():
    q, k, v, g, beta, h0 = make_inputs(2, 3, 2, 4, 8, 8)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        fused_recurrent_kda(*(x.double() for x in (q, k, v)), g, beta)
    with pytest.raises(ValueError, match="k must have shape"):
        fused_recurrent_kda(q, k[:, :, :1], v, g, beta)
    with pytest.raises(ValueError, match="multiple of H"):
        fused_recurrent_kda(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match="initial_state must have shape"):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=h0[:1])


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla-core is not installed")
def test_matches_fla():
    """An independent implementation: fla's fused_recurrent_kda, grouped values and a varlen batch."""
    from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda

    q, k, v, g, beta, h0 = make_inputs(1, 5, 1, 2, 16, 12, n_states=2)
    cu = torch.tensor([0, 2, 5], device=DEVICE)
    ours = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    theirs = fla_fused_recurrent_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu
    )
    for x, y in zip(ours, theirs, strict=True):
        assert rel_err(x, y.double()) <= TOL


@pytest.mark.parametrize(
    "rows, words",
    [
        ([1, 4], r"got \[1, 4\]: \[4\] outside"),
        ([-1, 2], r"got \[-1, 2\]: \[-1\] outside"),
        ([2, 2], r"got \[2, 2\]: \[2\] repeated"),
    ],
)
def test_state_indices_outside_the_pool_or_repeated_are_refused(rows, words, monkeypatch):
    """The pool is rows 0-3 of a larger buffer: index 4 used to be written into the row after the pool
    (and -1 into the row before), and a repeated index raced on one row, with no error. On the CPU, or with
    KDA_EDU_DEBUG=1, the indices are checked before the kernel runs; nothing is written."""
    monkeypatch.setenv("KDA_EDU_DEBUG", "1")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1, 1, 4, generator=gen).to(DEVICE) for _ in range(3))
    g, beta = -torch.rand(2, 1, 1, 4, generator=gen).to(DEVICE), torch.rand(2, 1, 1, generator=gen).to(DEVICE)
    buffer = torch.randn(6, 1, 4, 4, generator=gen).to(DEVICE)
    pool, before = buffer[1:5], buffer.clone()
    index = torch.tensor(rows, device=DEVICE)
    with pytest.raises(
        ValueError, match=r"state_indices must be distinct rows of the pool, in \[0, P = 4\), " + words
    ):
        fused_recurrent_kda(
            q, k, v, g, beta, initial_state=pool, inplace_final_state=True, state_indices=index
        )
    assert torch.equal(buffer, before)
