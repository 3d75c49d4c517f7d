"""Context-parallel KDA on gloo processes against one device.

Three sets of processes run every distributed case (starting processes costs seconds): 2, 3 and 4 ranks,
through `torch.multiprocessing` spawn. The `"one_pass"` cases run its chunked pass with chunks of 4 tokens, so
that shards span several chunks and end inside one. The target is float64 autograd through the KDA loop
(`kda_recurrent`, per sequence with cu_seqlens) on the whole sequence, i.e. the exact answer: with the float64
reference kernel on each shard the relative error bound is 1e-10 (rounding is about 1e-15; a wrong carry or a
missing gradient path is of order 1). One small case runs `chunk_kda` through Triton's interpreter in float32
and is held to the same bound the kernel's own tests use, relative error <= 1e-5, against both the float64
loop and single-device `chunk_kda`. Compared: outputs, final states and the gradients of q, k, v, g, beta and
the initial state.
"""

import pytest
import torch
import torch.nn.functional as F

from kda_edu.chapters.ch15_context_parallel import gather_case, run_gloo, shard_cases
from kda_edu.ops.kda import kda_recurrent
from kda_edu.parallel import context_parallel as cp
from kda_edu.parallel.context_parallel import (
    chunk_pass_with_carry,
    context_parallel_kda,
    fold_grads,
    fold_grads_batched,
    fold_maps,
    fold_maps_batched,
    kernel_pass_with_carry,
    one_pass_shard,
    reference_kernel,
    shard_layout,
    shard_map,
)

NAMES = ("q", "k", "v", "g", "beta", "initial_state")
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def make_case(B, T, H, HV, K, V, dtype, seed, cu_seqlens=None, with_state=True):
    """Whole inputs plus dO and dfinal; states and their gradients have one row per sequence."""
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    case = dict(
        q=F.normalize(torch.randn(B, T, H, K, **f64), dim=-1),
        k=F.normalize(torch.randn(B, T, H, K, **f64), dim=-1),
        v=torch.randn(B, T, HV, V, **f64),
        g=-torch.rand(B, T, HV, K, **f64),
        beta=torch.rand(B, T, HV, **f64),
        do=torch.randn(B, T, HV, V, **f64),
        dfinal=torch.randn(N, HV, K, V, **f64),
    )
    if with_state:
        case["initial_state"] = torch.randn(N, HV, K, V, **f64)
    if cu_seqlens is not None:
        case["cu_seqlens"] = torch.tensor(cu_seqlens)
    return {n: x.to(dtype) if x.is_floating_point() else x for n, x in case.items()}


def single_device(case, fn):
    """Outputs, final states and gradients of `fn` (a single-device KDA) on the whole inputs."""
    xs = {n: case[n].clone().requires_grad_() for n in NAMES if n in case}
    o, final = fn(
        *(xs[n] for n in NAMES[:5]),
        initial_state=xs.get("initial_state"),
        output_final_state=True,
        cu_seqlens=case.get("cu_seqlens"),
    )
    ((o * case["do"]).sum() + (final * case["dfinal"]).sum()).backward()
    return {"o": o.detach(), "final": final.detach(), "grads": {n: x.grad for n, x in xs.items()}}


def loop64(q, k, v, g, beta, initial_state=None, output_final_state=True, cu_seqlens=None):
    """The float64 loop, one call per sequence with cu_seqlens."""
    xs = [x.double() for x in (q, k, v, g, beta)]
    h0 = None if initial_state is None else initial_state.double()
    if cu_seqlens is None:
        return kda_recurrent(*xs, initial_state=h0, output_final_state=True)
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        state = None if h0 is None else h0[n : n + 1]
        if a == b:
            outs.append(xs[2][:, a:b])
            HV, K, V = v.shape[2], k.shape[3], v.shape[3]
            finals.append(torch.zeros(1, HV, K, V, dtype=torch.float64) if state is None else state)
            continue
        o, ht = kda_recurrent(*(x[:, a:b] for x in xs), initial_state=state, output_final_state=True)
        outs.append(o)
        finals.append(ht)
    return torch.cat(outs, dim=1), torch.cat(finals)


def rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def assert_matches(got, want, tol, label):
    assert rel(got["o"], want["o"]) <= tol, f"{label}: o"
    assert rel(got["final"], want["final"]) <= tol, f"{label}: final state"
    for n, ref in want["grads"].items():
        assert rel(got["grads"][n], ref) <= tol, f"{label}: gradient of {n}"


# (name, whole-input sizes (B, T, H, HV, K, V), cu_seqlens, tokens per rank, scheme, kernel, dtype, initial state)
F64 = torch.float64
CASES_2 = [
    ("B=2, even shards, scan", (2, 24, 1, 2, 4, 3), None, [12, 12], "scan", "reference", F64, True),
    ("B=2, uneven, sequential", (2, 24, 1, 2, 4, 3), None, [5, 19], "sequential", "reference", F64, True),
    ("no initial state, scan", (2, 24, 1, 2, 4, 3), None, [19, 5], "scan", "reference", F64, False),
    (
        "varlen, boundary at a sequence end",
        (1, 20, 1, 1, 4, 4),
        [0, 8, 20],
        [8, 12],
        "scan",
        "reference",
        F64,
        True,
    ),
    ("one_pass, B=2, uneven", (2, 24, 1, 2, 4, 3), None, [5, 19], "one_pass", "reference", F64, True),
    (
        "one_pass, varlen, boundary at a sequence end",
        (1, 20, 1, 1, 4, 4),
        [0, 8, 20],
        [8, 12],
        "one_pass",
        "reference",
        F64,
        True,
    ),
]
# the Triton kernel on each shard: float32 through the interpreter, with its backward. gloo moves CPU tensors,
# and on a machine with a GPU the kernels are compiled for CUDA tensors: there this case needs NCCL (issue 25).
if not torch.cuda.is_available():
    CASES_2.append(
        ("chunk_kda, scan", (1, 32, 1, 1, 16, 16), None, [16, 16], "scan", "chunk_kda", torch.float32, True)
    )
    CASES_2.append(  # the one pass through the kernel: identity columns, gradients from its backward
        (
            "chunk_kda, one_pass",
            (1, 32, 1, 1, 16, 16),
            None,
            [16, 16],
            "one_pass",
            "chunk_kda",
            torch.float32,
            True,
        )
    )
# a sequence over all four ranks, one of length 0, one of length 1, a boundary inside a sequence
VARLEN_4 = [0, 3, 3, 17, 29, 30]
CASES_4 = [
    (
        "varlen over 4 ranks, scan",
        (1, 30, 1, 2, 4, 3),
        VARLEN_4,
        [5, 7, 3, 15],
        "scan",
        "reference",
        F64,
        True,
    ),
    (
        "varlen over 4, sequential",
        (1, 30, 1, 2, 4, 3),
        VARLEN_4,
        [5, 7, 3, 15],
        "sequential",
        "reference",
        F64,
        True,
    ),
    ("GVA, shards of 1..9 tokens", (1, 20, 1, 2, 6, 5), None, [4, 9, 6, 1], "scan", "reference", F64, True),
    (
        "one_pass, varlen over 4",
        (1, 30, 1, 2, 4, 3),
        VARLEN_4,
        [5, 7, 3, 15],
        "one_pass",
        "reference",
        F64,
        True,
    ),
    (
        "one_pass, GVA, shards of 1..9",
        (1, 20, 1, 2, 6, 5),
        None,
        [4, 9, 6, 1],
        "one_pass",
        "reference",
        F64,
        True,
    ),
]
# three ranks: the one_pass scheme with a middle rank that both receives and sends, HV = 4 > H = 2, a
# packed batch whose middle sequence covers all three shards, and no initial state
CASES_3 = [
    ("one_pass, GVA, uneven", (2, 24, 2, 4, 4, 3), None, [7, 2, 15], "one_pass", "reference", F64, True),
    (
        "one_pass, varlen over 3",
        (1, 26, 1, 2, 5, 3),
        [0, 5, 5, 22, 26],
        [9, 8, 9],
        "one_pass",
        "reference",
        F64,
        True,
    ),
    (
        "one_pass, no initial state",
        (1, 21, 1, 1, 4, 4),
        None,
        [10, 6, 5],
        "one_pass",
        "reference",
        F64,
        False,
    ),
]


def run_cases(world, cases, worker=shard_cases, *extra):
    wholes = [
        make_case(*sizes, dtype, seed, cu, with_state)
        for seed, (_, sizes, cu, _, _, _, dtype, with_state) in enumerate(cases)
    ]
    jobs = [
        dict(whole, lengths=lengths, scheme=scheme, kernel=kernel, chunk_size=4)
        for whole, (_, _, _, lengths, scheme, kernel, _, _) in zip(wholes, cases, strict=True)
    ]
    per_rank = run_gloo(worker, world, jobs, *extra)
    if worker is not shard_cases:  # cases_and_counts: (shard_cases, counts) per rank
        per_rank, counts = zip(*per_rank, strict=True)
        return wholes, [gather_case([r[i] for r in per_rank]) for i in range(len(cases))], counts
    return wholes, [gather_case([r[i] for r in per_rank]) for i in range(len(cases))]


def check_case(whole, result, case):
    name, dtype, with_state = case[0], case[6], case[7]
    assert ("initial_state" in result["grads"]) == with_state
    assert_matches(result, single_device(whole, loop64), TOL[dtype], f"{name}, against the float64 loop")
    if case[5] == "chunk_kda":
        from kda_edu.kernels import chunk_kda

        assert_matches(result, single_device(whole, chunk_kda), TOL[dtype], f"{name}, against chunk_kda")


@pytest.fixture(scope="module")
def two_ranks():
    return run_cases(2, CASES_2)


COUNT_CASE = dict(make_case(1, 24, 1, 1, 4, 4, F64, seed=9, with_state=False), lengths=[8, 8, 8])


@pytest.fixture(scope="module")
def three_ranks():
    return run_cases(3, CASES_3, cases_and_counts, COUNT_CASE)


@pytest.fixture(scope="module")
def four_ranks():
    return run_cases(4, CASES_4)


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(CASES_2)), ids=[c[0] for c in CASES_2])
def test_two_ranks_match_one_device(two_ranks, i):
    wholes, results = two_ranks
    check_case(wholes[i], results[i], CASES_2[i])


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(CASES_3)), ids=[c[0] for c in CASES_3])
def test_three_ranks_match_one_device(three_ranks, i):
    wholes, results, _ = three_ranks
    check_case(wholes[i], results[i], CASES_3[i])


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(CASES_4)), ids=[c[0] for c in CASES_4])
def test_four_ranks_match_one_device(four_ranks, i):
    wholes, results = four_ranks
    check_case(wholes[i], results[i], CASES_4[i])


def test_shard_map_is_the_affine_map_of_the_shard():
    """`S_out = M S_in + B` for any S_in, with (M, B) from one kernel call on [v | 0] and [h0 | I]."""
    case = make_case(2, 13, 1, 2, 5, 3, torch.float64, seed=7, with_state=False)
    inputs = tuple(case[n] for n in NAMES[:5])
    layout = shard_layout([4, 13, 3], rank=1, B=2, cu_seqlens=None)  # a middle rank
    zero = torch.zeros(2, 2, 5, 3, dtype=torch.float64)
    M, B = shard_map(reference_kernel, inputs, zero, layout, 5**-0.5)
    for seed in range(3):
        S_in = torch.randn(2, 2, 5, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        _, S_out = kda_recurrent(*inputs, initial_state=S_in, output_final_state=True)
        assert rel(M @ S_in + B, S_out) <= TOL[torch.float64]


def test_layout_of_packed_sequences():
    """Which pieces of which sequences a rank holds, and which of them cross its boundaries."""
    cu = [0, 3, 3, 17, 29, 30]
    lengths = [5, 7, 3, 15]
    middle = shard_layout(lengths, 2, 1, cu)  # tokens 12..15, inside sequence 2 = [3, 17)
    assert (middle.seq_ids, middle.in_rows, middle.out_rows, middle.local_cu) == ((2,), (0,), (0,), (0, 3))
    first = shard_layout(lengths, 0, 1, cu)  # tokens 0..5: sequence 0, the empty sequence 1, start of 2
    assert first.seq_ids == (0, 1, 2) and first.local_cu == (0, 3, 3, 5)
    assert (first.in_rows, first.out_rows, first.ends) == ((), (2,), (True, True, False))
    last = shard_layout(lengths, 3, 1, cu)  # tokens 15..30: end of 2, sequences 3 and 4
    assert (last.seq_ids, last.in_rows, last.out_rows, last.local_cu) == ((2, 3, 4), (0,), (), (0, 2, 14, 15))


def test_bad_arguments_are_named():
    case = make_case(1, 4, 1, 1, 4, 4, torch.float64, seed=0)
    args = tuple(case[n] for n in NAMES[:5])
    with pytest.raises(ValueError, match="scheme"):
        context_parallel_kda(*args, scheme="ring")
    with pytest.raises(ValueError, match="kernel"):
        context_parallel_kda(*args, scheme="one_pass", kernel="chunk_kda")
    with pytest.raises(ValueError, match="chunk_size"):
        context_parallel_kda(*args, scheme="one_pass", chunk_size=0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_kda(*args)


def test_chunk_pass_with_carry_reads_and_carries_any_entering_state():
    """`o(h0 + S) = o + R S` and `ht(h0 + S) = ht + M S` against the loop run from h0 + S: several chunks of
    3, the last one partial, HV = 4 > H = 2."""
    case = make_case(2, 11, 2, 4, 5, 3, torch.float64, seed=3)
    inputs = tuple(case[n] for n in NAMES[:5])
    h0 = case["initial_state"]
    o, ht, M, R = chunk_pass_with_carry(*inputs, 5**-0.5, h0, chunk_size=3)
    for seed in range(2):
        S = torch.randn(h0.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        want_o, want_ht = kda_recurrent(*inputs, initial_state=h0 + S, output_final_state=True)
        assert rel(o + torch.einsum("bthk,bhkv->bthv", R, S), want_o) <= TOL[torch.float64]
        assert rel(ht + M @ S, want_ht) <= TOL[torch.float64]


@pytest.mark.parametrize("V", [3, 254], ids=["one call", "two calls"])  # V + K = 7 and 258 (> 256)
def test_a_kernel_gives_the_carry_maps_of_the_chunk_factors(V):
    """`kernel_pass_with_carry` (a kernel on K extra identity columns, as a Triton kernel would run it) gives
    the (o, ht, M, R) of `chunk_pass_with_carry` (the chunks' own factors), in one call or, past 256
    columns, two: the float64 reference kernel stands in for chunk_kda."""
    case = make_case(2, 11, 2, 4, 4, V, torch.float64, seed=5)
    inputs = tuple(case[n] for n in NAMES[:5])
    want = chunk_pass_with_carry(*inputs, 0.5, case["initial_state"], chunk_size=3)
    got = kernel_pass_with_carry(reference_kernel, *inputs, 0.5, case["initial_state"])
    for name, a, b in zip("o ht M R".split(), got, want, strict=True):
        assert a.shape == b.shape and rel(a, b) <= TOL[torch.float64], name


def test_one_pass_shard_gives_the_same_map_as_shard_map():
    """The (M, B) a rank exchanges, read off its one pass, equal those of `shard_map`'s extra kernel call:
    a middle rank of a packed batch whose first piece receives the carry and whose last piece, another
    sequence, sends one (M = 0), and a middle rank inside one sequence (M from the carry's transition)."""
    zero = torch.zeros(1, 2, 4, 3, dtype=torch.float64)
    for cu, lengths, chunk in (([0, 3, 10, 14, 30], [5, 11, 14], 4), (VARLEN_4, [5, 7, 3, 15], 2)):
        case = make_case(1, cu[-1], 1, 2, 4, 3, torch.float64, seed=5, cu_seqlens=cu)
        layout = shard_layout(lengths, 1 if chunk == 4 else 2, 1, cu)
        inputs = tuple(case[n][:, layout.start : layout.stop] for n in NAMES[:5])
        h0 = torch.stack(
            [
                case["initial_state"][n] if start else zero[0]
                for n, start in zip(layout.seq_ids, layout.starts, strict=True)
            ]
        )
        want_M, want_B = shard_map(reference_kernel, inputs, h0, layout, 0.5)
        got_M, got_B = cp.one_pass_map(one_pass_shard(inputs, h0, layout, 0.5, chunk_size=chunk), layout)
        assert rel(got_B, want_B) <= TOL[torch.float64]
        if chunk == 4:  # tokens 5..16: the end of sequence 1, sequence 2, the start of sequence 3
            assert layout.seq_ids == (1, 2, 3) and got_M.abs().max() == 0 == want_M.abs().max()
        else:  # tokens 12..15, inside sequence 2
            assert layout.seq_ids == (2,) and rel(got_M, want_M) <= TOL[torch.float64]


@pytest.mark.parametrize("R", range(1, 10))
def test_batched_folds_equal_the_rank_by_rank_folds(R):
    """Every rank's state and outgoing gradient from the log-depth reduction equal the loops' (odd and
    even R, so the tree's odd one out is exercised), and the scan's prefixes are the loop's states."""
    gen = torch.Generator().manual_seed(R)
    M = 0.6 * torch.randn(R, 3, 4, 4, generator=gen, dtype=torch.float64)
    B, G = (torch.randn(R, 3, 4, 2, generator=gen, dtype=torch.float64) for _ in "BG")
    maps = list(zip(M, B, strict=True))
    for r in range(R + 1):
        state = fold_maps_batched(M, B, r)
        assert rel(state, fold_maps(maps, r)) <= 1e-12 if r else state.abs().max() == 0
    for r in range(R):
        grad = fold_grads_batched(M, G, r)
        assert rel(grad, fold_grads(list(M), list(G), r)) <= 1e-12 if r < R - 1 else grad.abs().max() == 0
    products, states = cp.affine_scan(M, B)
    product = torch.eye(4, dtype=torch.float64)
    for r in range(R):
        product = M[r] @ product
        assert rel(states[r], fold_maps(maps, r + 1)) <= 1e-12 and rel(products[r], product) <= 1e-12


def cases_and_counts(rank: int, world: int, cases: list[dict], case: dict) -> tuple[list[dict], dict]:
    """`shard_cases`, then one rank of `test_one_pass_runs_each_shard_once` (for `run_gloo`): count
    `kda_intra_chunk` calls in a forward of each scheme and in the backward of one_pass."""
    results = shard_cases(rank, world, cases)
    calls = []
    original = cp.kda_intra_chunk

    def counted(*args):
        calls.append(1)
        return original(*args)

    import kda_edu.ops.kda as kda_ops

    cp.kda_intra_chunk = kda_ops.kda_intra_chunk = counted  # the scan's kernel reaches it through kda_chunked
    a = sum(case["lengths"][:rank])
    b = a + case["lengths"][rank]
    shard = [case[n][:, a:b].clone().requires_grad_() for n in NAMES[:5]]
    counts = {}
    for scheme in ("scan", "one_pass"):
        calls.clear()
        o, _ = context_parallel_kda(*shard, scheme=scheme, kernel=reference_kernel, chunk_size=4)
        counts[scheme] = len(calls)
    calls.clear()
    o.sum().backward()
    counts["one_pass backward"] = len(calls)
    cp.kda_intra_chunk = kda_ops.kda_intra_chunk = original
    return results, counts


def test_one_pass_runs_each_shard_once(three_ranks):
    """The intra-chunk pass runs once per rank in one_pass's forward (and once more in its backward, the
    recomputation); the scan runs it twice on the ranks that send a map, which shows the count can see a
    second pass."""
    counts = three_ranks[2]
    assert [c["one_pass"] for c in counts] == [1, 1, 1]
    assert [c["scan"] for c in counts] == [2, 2, 1]
    assert [c["one_pass backward"] for c in counts] == [1, 1, 1]
