"""kda_edu.kernels.chunk_kda against the float64 loop (kda_edu.ops.kda.kda_recurrent).

On a CPU these run through Triton's interpreter (about 3 ms per 64 x 64 product per program), so the shapes
are tiny and the inputs float32; on a CUDA machine the same tests run the compiled kernels. The tolerance
checks at benchmark sizes and at T = 64K are in tests/kernels/test_chunk_kda_gpu.py.
"""

import pytest
import torch
import torch.nn.functional as F
from reference_inputs import kda_oracle, rel_err

from kda_edu.kernels import chunk_kda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 inputs against the float64 loop. The interpreter computes in float32; a GPU's float32 products in
# the chunk are exact float32 too, but summation order differs, so allow a little more there.
TOL = 1e-5 if DEVICE == "cpu" else 1e-4


def make_inputs(B, T, H, HV, K, V, gate=-5.0, seed=0):
    """l2-normalised q, k; v ~ N(0, 1); gates uniform in [gate, 0); beta in (0, 1); a random state."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = gate * torch.rand(B, T, HV, K, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(B, HV, K, V, generator=gen)
    return tuple(x.to(DEVICE) for x in (q, k, v, g, beta, h0))


SHAPES = {
    # (B, T, H, HV, K, V)
    "one_step": (1, 1, 1, 1, 16, 16),
    "one_chunk": (1, 64, 1, 1, 32, 32),
    "partial_chunk": (1, 37, 1, 1, 32, 32),
    "chunks_plus_tail": (2, 100, 1, 1, 32, 16),
    "K_ne_V_non_pow2": (1, 70, 1, 1, 48, 40),
    "grouped_values": (1, 80, 1, 2, 32, 32),
    "K_V_64": (1, 65, 2, 2, 64, 64),
}


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_fp64_loop(shape, with_state):
    q, k, v, g, beta, h0 = make_inputs(*shape)
    h0 = h0 if with_state else None
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = kda_oracle(q, k, v, g, beta, h0)
    assert o.dtype == torch.float32 and o.shape == v.shape
    assert ht.dtype == torch.float32 and ht.shape == ht_ref.shape
    assert rel_err(o, o_ref) <= TOL
    assert rel_err(ht, ht_ref) <= TOL


def test_no_final_state_and_custom_scale():
    q, k, v, g, beta, _ = make_inputs(1, 40, 1, 1, 16, 16)
    o, ht = chunk_kda(q, k, v, g, beta, scale=0.5)
    assert ht is None
    assert rel_err(o, kda_oracle(q, k, v, g, beta, scale=0.5)[0]) <= TOL


@pytest.mark.parametrize("gate", [-5.0, -60.0], ids=["lower_bound", "far_below"])
def test_strong_gates_stay_finite(gate):
    """Gates down to -5 take the anchored split of the diagonal blocks, far below it the pairwise branch."""
    q, k, v, g, beta, h0 = make_inputs(1, 130, 1, 1, 16, 16, gate=gate)
    g[:, :70] = gate  # whole sub-chunks at the most negative gate
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = kda_oracle(q, k, v, g, beta, h0)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_err(o, o_ref) <= TOL and rel_err(ht, ht_ref) <= TOL


def test_gate_strength_varies_across_key_columns():
    """The gram kernel chooses the diagonal blocks' form per step of 32 key columns: here the first step's
    gates are mild (one anchored 64-row product) and the second's strong enough (down to -12 per step) that
    it computes the four diagonal blocks one by one, some anchored, some pairwise; a reset sits in between."""
    q, k, v, g, beta, h0 = make_inputs(1, 150, 1, 1, 64, 32, gate=-0.5, seed=8)
    g[..., 32:] *= 24.0
    g[:, 90] = -1000.0
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = kda_oracle(q, k, v, g, beta, h0)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_err(o, o_ref) <= TOL and rel_err(ht, ht_ref) <= TOL


def test_half_precision_inputs():
    """bf16 in, bf16 out; the state stays float32. Loose tolerance: the inputs themselves are rounded."""
    q, k, v, g, beta, h0 = make_inputs(1, 70, 1, 1, 32, 32)
    q, k, v = (x.bfloat16() for x in (q, k, v))
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = kda_oracle(q, k, v, g, beta, h0)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    assert rel_err(o, o_ref) <= 5e-3 and rel_err(ht, ht_ref) <= 5e-3


def test_agrees_with_chunked_reference_across_chunks():
    """Many chunks and the state passed between them, against the PyTorch chunked form."""
    from kda_edu.ops.kda import kda_chunked

    q, k, v, g, beta, h0 = make_inputs(1, 200, 1, 1, 16, 16, gate=-1.0)
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    args = (x.double() for x in (q, k, v, g, beta))
    o_ref, ht_ref = kda_chunked(*args, initial_state=h0.double(), output_final_state=True)
    assert rel_err(o, o_ref) <= TOL and rel_err(ht, ht_ref) <= TOL


def _valid():
    return list(make_inputs(1, 8, 1, 1, 16, 16))


@pytest.mark.parametrize(
    "change, error, words",
    [
        (lambda a: a.__setitem__(0, a[0][..., :8]), ValueError, ["k", "[B, T, H, K]"]),
        (lambda a: a.__setitem__(2, a[2][:, :4]), ValueError, ["v", "[B, T, HV, V]"]),
        (lambda a: a.__setitem__(3, a[3][..., 0]), ValueError, ["g", "[B, T, HV, K]"]),
        (lambda a: a.__setitem__(4, a[4][..., None]), ValueError, ["beta", "[B, T, HV]"]),
        (lambda a: a.__setitem__(1, a[1].double()), TypeError, ["k", "dtype"]),
        (lambda a: a.__setitem__(5, a[5][:, :, :8]), ValueError, ["initial_state", "[B, HV, K, V]"]),
        (lambda a: a.__setitem__(5, a[5].double()), TypeError, ["initial_state", "float32"]),
        (lambda a: a.__setitem__(1, a[1].tolist()), TypeError, ["k", "torch.Tensor"]),
    ],
    ids=["k_shape", "v_shape", "g_shape", "beta_shape", "k_dtype", "state_shape", "state_dtype", "k_type"],
)
def test_bad_inputs_raise(change, error, words):
    args = _valid()
    change(args)
    q, k, v, g, beta, h0 = args
    with pytest.raises(error) as info:
        chunk_kda(q, k, v, g, beta, initial_state=h0)
    for word in words:
        assert word in str(info.value)


def test_unsupported_sizes_and_dtypes_raise():
    q, k, v, g, beta, _ = make_inputs(1, 4, 1, 1, 16, 16)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        chunk_kda(q.double(), k.double(), v.double(), g, beta)
    q, k, v, g, beta, _ = make_inputs(1, 2, 1, 1, 16, 264)
    with pytest.raises(ValueError, match="V <= 256"):
        chunk_kda(q, k, v, g, beta)


def test_no_kernel_specialises_the_chunk_count():
    """Every kernel that takes NT (chunks per sequence) is compiled with NT in `do_not_specialize`. Triton
    compiles an integer argument equal to 1 as a constant; on the H200 (Triton 3.6) the scan kernel's
    one-chunk variant read shared memory out of bounds (an illegal memory access at T <= 64, found by
    compute-sanitizer; docs/kernel-design.md). The interpreter never specialises, so the fault itself shows only on a
    GPU (the one-chunk cases of test_chunk_bwd.py); here the kernels' own compile options are read: the
    interpreter's wrapper keeps them in `kwargs`, a compiled JITFunction in `do_not_specialize` (names or
    argument positions)."""
    from kda_edu.kernels import chunk_bwd, chunk_fwd

    checked = []
    for module in (chunk_fwd, chunk_bwd):
        for name, kernel in vars(module).items():
            names = getattr(kernel, "arg_names", None)
            if not name.endswith("_kernel") or not names or "NT" not in names:
                continue  # helpers (inlined into the kernels, never launched), launchers, kernels without NT
            options = getattr(kernel, "kwargs", {}).get("do_not_specialize") or getattr(
                kernel, "do_not_specialize", None
            )
            assert options, f"{name} has no do_not_specialize"
            assert "NT" in options or names.index("NT") in options, (name, options)
            checked.append(name)
    assert len(checked) >= 4, checked  # the forward's prepare and scan, the backward's state passes


def test_the_inverse_of_the_diagonal_blocks_is_accurate_on_nearly_parallel_keys():
    """The prepare kernel's inverse of the diagonal blocks (forward substitution) on the case that separated the
    product form from substitution: keys within a few degrees of one direction, beta = 1, weak gates, so I + L is
    badly conditioned. It stays at float32 rounding against the float64 loop (the product form reached 3e-4 on
    such keys; docs/kernel-design.md)."""
    q, _, v, g, beta, h0 = make_inputs(1, 100, 1, 1, 32, 16, gate=-0.1)
    gen = torch.Generator().manual_seed(1)
    k = F.normalize(torch.randn(32, generator=gen) + 0.05 * torch.randn(1, 100, 1, 32, generator=gen), dim=-1)
    k, beta = k.to(DEVICE), torch.ones_like(beta)
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = kda_oracle(q, k, v, g, beta, h0)
    assert rel_err(o, o_ref) < TOL and rel_err(ht, ht_ref) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
def test_time_pieces_match_fp64_loop(with_state):
    """The forward cut into 2, 3 and 4 pieces of the time axis (`time_pieces`; on a GPU each piece's scan runs
    on a side stream beside the next piece's prepare kernels, the state passed on through the final-state
    buffer) gives what one piece gives: against the float64 loop with the usual tolerance, and against one
    piece within 1e-6 relative (every chunk is computed by the same kernel code; the state crosses pieces in
    float32). One sequence of 200 steps (three full chunks and a tail: pieces of 3 + 1, 2 + 1 + 1 and one
    chunk each), two value heads per key head; pieces of time across several sequences are
    test_pieces_of_sequences_match_fp64_loop's."""
    from kda_edu.kernels.chunk_fwd import chunk_kda_fwd

    q, k, v, g, beta, h0 = make_inputs(1, 200, 1, 2, 32, 16)
    h0 = h0 if with_state else None
    scale = 32**-0.5
    o1, ht1 = chunk_kda_fwd(q, k, v, g, beta, scale, h0, True, pieces=1)
    o_ref, ht_ref = kda_oracle(q, k, v, g, beta, h0)
    for pieces in (2, 3, 4):
        o, ht = chunk_kda_fwd(q, k, v, g, beta, scale, h0, True, pieces=pieces)
        assert rel_err(o, o_ref) <= TOL and rel_err(ht, ht_ref) <= TOL, pieces
        assert rel_err(o, o1) <= 1e-6 and rel_err(ht, ht1) <= 1e-6, pieces
    o_none, ht_none = chunk_kda_fwd(q, k, v, g, beta, scale, h0, False, pieces=3)
    assert ht_none is None and rel_err(o_none, o_ref) <= TOL


def test_a_bad_value_in_a_later_piece_spoils_only_what_follows():
    """A NaN value at step 200 (chunk 3 of 5 pieces of one chunk each): the outputs before it are exact, every
    output from it on is NaN in that head and sequence, and so is the final state; the other head is exact."""
    from kda_edu.kernels.chunk_fwd import chunk_kda_fwd

    q, k, v, g, beta, h0 = make_inputs(1, 300, 1, 2, 32, 16)
    v[0, 200, 0, 3] = float("nan")
    o, ht = chunk_kda_fwd(q, k, v, g, beta, 32**-0.5, h0, True, pieces=5)
    v_ok = v.clone()
    v_ok[0, 200, 0, 3] = 0.0
    o_ref, ht_ref = kda_oracle(q, k, v_ok, g, beta, h0)
    assert rel_err(o[0, :200], o_ref[0, :200]) <= TOL
    assert torch.isnan(o[0, 200:, 0]).all() and torch.isnan(ht[0, 0]).all()
    assert rel_err(o[0, :, 1], o_ref[0, :, 1]) <= TOL and rel_err(ht[0, 1], ht_ref[0, 1]) <= TOL


def test_pieces_of_sequences_match_fp64_loop():
    """Pieces of whole sequences (what `time_pieces` picks when the scan needs more than one wave of programs),
    and pieces that cut both sequences and time, against the float64 loop: three sequences of 150 steps."""
    from kda_edu.kernels.chunk_fwd import chunk_kda_fwd

    q, k, v, g, beta, h0 = make_inputs(3, 150, 1, 1, 32, 16)
    o_ref, ht_ref = kda_oracle(q, k, v, g, beta, h0)
    for cut in ([(0, 1, 0, 3), (1, 2, 0, 3)], [(0, 2, 0, 2), (0, 2, 2, 1), (2, 1, 0, 1), (2, 1, 1, 2)]):
        o, ht = chunk_kda_fwd(q, k, v, g, beta, 32**-0.5, h0, True, pieces=cut)
        assert rel_err(o, o_ref) <= TOL and rel_err(ht, ht_ref) <= TOL, cut


@pytest.mark.parametrize("NT", [1, 7, 31, 128, 512, 2048])
def test_time_pieces_cover_every_chunk_once(NT):
    """`time_pieces` (on 132 multiprocessors, K = V = 128, bf16) covers every chunk of every sequence once, in
    order within each sequence: 2, 4 and 8 pieces of the time axis at 8K, 32K and 128K tokens of one sequence
    with 32 or 16 heads; one piece with cu_seqlens, with too little work, or when asked for one."""
    from kda_edu.kernels.chunk_launch import PIECE_MIN_CHUNK_HEADS, PIECES_MAX, time_pieces

    def covered(cut, N):
        return sorted(
            (n, c) for n0, nn, cs, cn in cut for n in range(n0, n0 + nn) for c in range(cs, cs + cn)
        )

    for N, H in ((1, 32), (1, 16), (8, 16), (3, 2)):
        for pieces in (None, 1, 3, 100):
            cut = time_pieces(N, NT, H, 128, 128, 2, False, pieces=pieces)
            assert covered(cut, N) == [(n, c) for n in range(N) for c in range(NT)], (N, H, pieces)
            assert all(nn > 0 and cn > 0 for _, nn, _, cn in cut) and len(cut) <= max(PIECES_MAX, 100)
    assert time_pieces(1, NT, 32, 128, 128, 2, varlen=True) == [(0, 1, 0, NT)]
    if NT < PIECE_MIN_CHUNK_HEADS:  # one head: NT chunk-heads, too little work
        assert time_pieces(1, NT, 1, 128, 128, 2, False) == [(0, 1, 0, NT)]
    expected = {128: 2, 512: 4, 2048: 8}.get(NT)
    if expected:
        for H in (32, 16):
            assert len(time_pieces(1, NT, H, 128, 128, 2, False, sms=132)) == expected


def test_one_piece_when_the_scan_takes_more_than_one_wave():
    """(4, 8192, 32) on 132 multiprocessors (an H100 SXM's or an H200's): blocks of 64 value columns make 256
    scan programs, two waves; the scan fills the GPU by itself, and the forward runs in one piece. On a GPU
    of 528 blocks of 32 make one wave of 512, and the time axis is cut in two. (1, 8192, 32): 128 programs,
    two pieces. Where no waves limit the scan (sms None: a CPU) only the amount of work decides."""
    from kda_edu.kernels.chunk_launch import device_multiprocessors, time_pieces

    assert time_pieces(4, 128, 32, 128, 128, 2, False, sms=132) == [(0, 4, 0, 128)]
    assert len(time_pieces(4, 128, 32, 128, 128, 2, False, sms=528)) == 2
    assert time_pieces(1, 128, 32, 128, 128, 2, False, sms=132) == [
        (0, 1, 0, 96),
        (0, 1, 96, 32),
    ]  # the last half a share
    assert time_pieces(1, 128, 32, 128, 128, 2, False) == time_pieces(1, 128, 32, 128, 128, 2, False, sms=132)
    assert device_multiprocessors("cpu") is None


def test_beta_message_shows_the_value_that_breaks_the_range():
    """`:.4g` printed the float32 just above 1 as 1 ("got values in [0.25, 1]"); no kernel runs."""
    from kda_edu.kernels.chunk import check_gate_values

    g = -torch.ones(1, 4, 2, 8)
    beta = torch.full((1, 4, 2), 0.25)
    beta[0, 2, 1] = 1.0000001
    with pytest.raises(ValueError, match=r"got values in \[0\.25, 1\.0000001\]"):
        check_gate_values(g, beta)
