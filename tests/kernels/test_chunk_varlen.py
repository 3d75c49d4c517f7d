"""chunk_kda with cu_seqlens (variable-length batches): each packed sequence runs as if alone.

The forward here; the gradients are in test_chunk_bwd.py, which imports `per_sequence` and the lengths.
On a CPU everything runs through Triton's interpreter in float32, tiny shapes; on a CUDA machine compiled.
"""

import pytest
import torch
import torch.nn.functional as F
from reference_inputs import BAD_CU_IDS, BAD_CU_SEQLENS, kda_oracle, rel_err

from kda_edu.kernels import chunk_kda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5 if DEVICE == "cpu" else 1e-4  # float32 against the float64 loop, as in test_chunk.py

# One step, two chunks with a tail (70 = 64 + 6), an empty sequence in the middle, exactly one chunk, a short
# one: every way a sequence can meet the 64-step chunk grid, and a chunk that must not run into the next one.
LENGTHS = [1, 70, 0, 64, 5]


def cu_of(lengths, dtype=torch.int32):
    """FlashAttention-style cumulative lengths [0, l0, l0 + l1, ...] on DEVICE."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype, device=DEVICE)


def make_inputs(T, H, HV, K, V, n_states, gate=-5.0, seed=0):
    """One packed row (B = 1) of T steps: l2-normalised q, k; gates in [gate, 0); one state per sequence."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = gate * torch.rand(1, T, HV, K, generator=gen)
    beta = torch.rand(1, T, HV, generator=gen)
    h0 = torch.randn(n_states, HV, K, V, generator=gen)
    return tuple(x.to(DEVICE) for x in (q, k, v, g, beta, h0))


def per_sequence(fn, cu):
    """`fn` (chunk_kda's signature) run on each sequence of a packed row alone: the outputs concatenated
    along T, the final states stacked [N, HV, K, V]. An empty sequence's final state is its initial state."""
    bounds = cu.tolist()

    def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
        outs, states = [], []
        for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            h0 = None if initial_state is None else initial_state[n : n + 1]
            if bos == eos:
                states.append(v.new_zeros(1, v.shape[2], q.shape[3], v.shape[3]) if h0 is None else h0)
                continue
            part = (x[:, bos:eos] for x in (q, k, v, g, beta))
            o, ht = fn(*part, scale=scale, initial_state=h0, output_final_state=True)
            outs.append(o)
            states.append(ht)
        return torch.cat(outs, dim=1), torch.cat(states) if output_final_state else None

    return run


def oracle(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """The float64 loop with chunk_kda's signature."""
    return kda_oracle(q, k, v, g, beta, initial_state, scale=scale)


@pytest.mark.slow
@pytest.mark.parametrize(
    "index_dtype, with_state",
    [(torch.int32, False), (torch.int64, True)],
    ids=["int32_zero_state", "int64_initial_state"],
)
def test_varlen_equals_each_sequence_alone(index_dtype, with_state):
    """Outputs and final states of a packed row equal the float64 loop and chunk_kda on each sequence
    alone; grouped values (HV = 2 H) and V != K, not a power of two."""
    N, T = len(LENGTHS), sum(LENGTHS)
    q, k, v, g, beta, h0 = make_inputs(T, 1, 2, 16, 24, n_states=N)
    h0 = h0 if with_state else None
    cu = cu_of(LENGTHS, index_dtype)
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == v.shape and o.dtype == torch.float32
    assert ht.shape == (N, 2, 16, 24) and ht.dtype == torch.float32
    o_ref, ht_ref = per_sequence(oracle, cu)(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_err(o, o_ref) <= TOL and rel_err(ht, ht_ref) <= TOL
    o_alone, ht_alone = per_sequence(chunk_kda, cu)(
        q, k, v, g, beta, initial_state=h0, output_final_state=True
    )
    assert rel_err(o, o_alone) <= 1e-6 and rel_err(ht, ht_alone) <= 1e-6
    empty = LENGTHS.index(0)  # the empty sequence hands its initial state through unchanged
    assert torch.equal(ht[empty], torch.zeros_like(ht[empty]) if h0 is None else h0[empty])


def test_one_sequence_is_the_fixed_length_path():
    """cu_seqlens = [0, T] takes the chunk table, yet gives what the batch of one gives: the same arithmetic in
    the same order, the variants differing only in how they address the chunks, so within 1e-6 (a few float32
    roundings, room for a compiler to schedule the two variants differently; a wrong chunk table is off by
    order 1)."""
    q, k, v, g, beta, h0 = make_inputs(100, 1, 1, 16, 16, n_states=1)
    a = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    b = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_of([100]))
    assert rel_err(b[0], a[0]) <= 1e-6 and rel_err(b[1], a[1]) <= 1e-6


def test_varlen_without_final_state():
    lengths = [3, 0, 9]
    q, k, v, g, beta, _ = make_inputs(12, 1, 1, 16, 16, n_states=3)
    cu = cu_of(lengths)
    o, ht = chunk_kda(q, k, v, g, beta, scale=0.5, cu_seqlens=cu)
    assert ht is None
    o_ref, _ = per_sequence(oracle, cu)(q, k, v, g, beta, scale=0.5)
    assert rel_err(o, o_ref) <= TOL


@pytest.mark.parametrize("cu, error, message", BAD_CU_SEQLENS, ids=BAD_CU_IDS)
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_bad_cu_seqlens_raise(cu, error, message, grad):
    """Checked before any kernel runs, with and without autograd (the backward would trust the table)."""
    q, k, v, g, beta, _ = make_inputs(4, 1, 1, 16, 16, n_states=1)
    q.requires_grad_(grad)
    with pytest.raises(error, match=message):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor(cu, device=DEVICE))


def test_varlen_batch_state_and_type_errors():
    q, k, v, g, beta, h0 = make_inputs(4, 1, 1, 16, 16, n_states=2)
    two = cu_of([1, 3])
    batch2 = (torch.cat([x, x]) for x in (q, k, v, g, beta))
    with pytest.raises(ValueError, match="batch size must be 1"):
        chunk_kda(*batch2, cu_seqlens=two)
    with pytest.raises(ValueError, match="one state per sequence"):  # 2 states for 3 sequences
        chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu_of([1, 1, 2]))
    with pytest.raises(ValueError, match="one state per sequence"):  # [N, HV, K, V] with V wrong
        chunk_kda(q, k, v, g, beta, initial_state=h0[..., :8], cu_seqlens=two)
    with pytest.raises(TypeError, match="float32"):
        chunk_kda(q, k, v, g, beta, initial_state=h0.double(), cu_seqlens=two)
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=[0, 4])
