"""Context-parallel KDA on gloo processes against one device.

Two sets of processes run every distributed case (starting processes costs seconds): 2 ranks and 4 ranks,
through `torch.multiprocessing` spawn. The target is float64 autograd through the KDA loop (`kda_recurrent`,
per sequence with cu_seqlens) on the whole sequence, i.e. the exact answer: with the float64 reference kernel
on each shard the relative error bound is 1e-10 (rounding is about 1e-15; a wrong carry or a missing gradient
path is of order 1). One small case runs `chunk_kda` through Triton's interpreter in float32 and is held to
the same bound the kernel's own tests use, relative error <= 1e-5, against both the float64 loop and
single-device `chunk_kda`. Compared: outputs, final states and the gradients of q, k, v, g, beta and the
initial state.
"""

import pytest
import torch
import torch.nn.functional as F

from kda_edu.chapters.ch15_context_parallel import gather_case, run_gloo, shard_cases
from kda_edu.ops.kda import kda_recurrent
from kda_edu.parallel.context_parallel import context_parallel_kda, reference_kernel, shard_layout, shard_map

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
]
# the Triton kernel on each shard: float32 through the interpreter, with its backward. gloo moves CPU tensors,
# and on a machine with a GPU the kernels are compiled for CUDA tensors: there this case needs NCCL (issue 25).
if not torch.cuda.is_available():
    CASES_2.append(
        ("chunk_kda, scan", (1, 32, 1, 1, 16, 16), None, [16, 16], "scan", "chunk_kda", torch.float32, True)
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
]


def run_cases(world, cases):
    wholes = [
        make_case(*sizes, dtype, seed, cu, with_state)
        for seed, (_, sizes, cu, _, _, _, dtype, with_state) in enumerate(cases)
    ]
    jobs = [
        dict(whole, lengths=lengths, scheme=scheme, kernel=kernel)
        for whole, (_, _, _, lengths, scheme, kernel, _, _) in zip(wholes, cases, strict=True)
    ]
    per_rank = run_gloo(shard_cases, world, jobs)
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


@pytest.fixture(scope="module")
def four_ranks():
    return run_cases(4, CASES_4)


@pytest.mark.parametrize("i", range(len(CASES_2)), ids=[c[0] for c in CASES_2])
def test_two_ranks_match_one_device(two_ranks, i):
    wholes, results = two_ranks
    check_case(wholes[i], results[i], CASES_2[i])


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
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_kda(*args)
