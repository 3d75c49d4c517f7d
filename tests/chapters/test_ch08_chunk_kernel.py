"""Chapter 8's stage-by-stage tools against the float64 PyTorch reference and the KDA loop."""

import math
import warnings

import pytest
import torch

from kda_edu.chapters import ch08_chunk_kernel as ck
from kda_edu.ops.chunkwise import random_inputs
from kda_edu.ops.kda import kda_recurrent

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5 if DEVICE == "cpu" else 1e-4


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def inputs():
    return random_inputs(1, 100, 1, 32, 16, HV=2, lower_bound=-5.0, device=DEVICE)


def test_prepare_matches_reference(inputs):
    got = ck.prepare(**inputs)
    ref = ck.reference_intermediates(**inputs)
    for name in ("w", "u", "qg", "kd", "aqk", "gl"):
        assert got[name].shape == ref[name].shape, name
        assert rel(got[name], ref[name]) <= TOL, name


def test_prepare_and_scan_with_batches_and_column_steps():
    # B = 2 checks the [HV, B * NT * C, cols] layout; kc = 16 < K = 32 runs the kernel's column loops twice.
    x = random_inputs(2, 70, 1, 32, 16, HV=2, lower_bound=-5.0, device=DEVICE)
    got, ref = ck.prepare(**x, kc=16), ck.reference_intermediates(**x)
    for name in ("w", "u", "qg", "kd", "aqk", "gl"):
        assert rel(got[name], ref[name]) <= TOL, name
    o, ht = ck.scan(got)
    o_ref, ht_ref = kda_recurrent(**{k: v.double() for k, v in x.items()}, output_final_state=True)
    assert rel(o, o_ref) <= TOL and rel(ht, ht_ref) <= TOL


def test_scan_of_prepare_is_kda(inputs):
    h0 = torch.randn(1, 2, 32, 16, device=DEVICE)
    o, ht = ck.scan(ck.prepare(**inputs), initial_state=h0)
    o_ref, ht_ref = kda_recurrent(**{k: v.double() for k, v in inputs.items()}, initial_state=h0.double(),
                                  output_final_state=True)  # fmt: skip
    assert rel(o, o_ref) <= TOL and rel(ht, ht_ref) <= TOL


@pytest.mark.parametrize("n", [1, 2, 3, 8, 16])
def test_diagonal_block_inverse(n):
    gen = torch.Generator().manual_seed(n)
    L = torch.randn(3, n, n, generator=gen, dtype=torch.float64).tril(-1)
    eye = torch.eye(n, dtype=torch.float64)
    assert torch.allclose(ck.diagonal_block_inverse(L), torch.linalg.inv(eye + L), atol=1e-9, rtol=1e-9)
    assert torch.allclose(ck.neumann_block_inverse(L), torch.linalg.inv(eye + L), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("C, block", [(64, 16), (32, 8), (64, 64), (16, 16)])
def test_block_forward_substitution(C, block):
    gen = torch.Generator().manual_seed(0)
    L = torch.randn(2, C, C, generator=gen, dtype=torch.float64).tril(-1) * 0.3
    B = torch.randn(2, C, 5, generator=gen, dtype=torch.float64)
    eye = torch.eye(C, dtype=torch.float64)
    got = ck.block_forward_substitution(L, B, block)
    assert torch.allclose(got, torch.linalg.solve(eye + L, B), atol=1e-9, rtol=1e-9)
    with pytest.raises(ValueError, match="whole number of blocks"):
        ck.block_forward_substitution(L[..., 1:, 1:], B[..., 1:, :], block)


def test_block_forward_substitution_gives_w_and_u(inputs):
    ref = ck.reference_intermediates(**inputs)
    wu = ck.block_forward_substitution(ref["A"], ref["rhs"])
    assert torch.allclose(wu, torch.cat([ref["w"], ref["u"]], dim=-1), atol=1e-10)


@pytest.mark.parametrize("C, block", [(64, 16), (32, 8), (16, 16)])
def test_block_inverse_is_the_inverse(C, block):
    gen = torch.Generator().manual_seed(1)
    L = torch.randn(2, C, C, generator=gen, dtype=torch.float64).tril(-1) * 0.3
    eye = torch.eye(C, dtype=torch.float64)
    X = ck.block_inverse(L, block)
    assert torch.allclose(X, torch.linalg.inv(eye + L), atol=1e-9, rtol=1e-9)
    assert torch.allclose(X, ck.block_forward_substitution(L, eye.expand_as(L), block), atol=1e-12)
    with pytest.raises(ValueError, match="whole number of blocks"):
        ck.block_inverse(L[..., 1:, 1:], block)


def test_kernel_stores_the_inverse(inputs):
    got = ck.prepare(**inputs, store_x=True)
    ref = ck.reference_intermediates(**inputs)
    assert got["x"].shape == ref["X"].shape
    assert rel(got["x"], ref["X"]) <= TOL
    assert "x" not in ck.prepare(**inputs)


def test_counts_at_the_benchmark_shape():
    traffic = ck.design_traffic(128, 128)
    once = traffic["gram reads q, k, g, beta"] + 2 * 128 + traffic["scan writes o"]  # + v, read by w/u
    assert once == ck.floor_bytes(128, 128) == 1538
    assert traffic["gram writes qg, Aqk, L"] == 2 * (128 + 64) + 4 * 64  # L whole: the 64 x 64 accumulator
    assert traffic["inverse reads L, writes X"] == 4 * (40 + 64)  # 2.5 blocks of 16 columns of L per row
    assert ck.memory_bytes(traffic) == sum(traffic.values()) == 5556
    assert ck.algorithm_flops(128) == 126_976
    flops = ck.design_flops(128, 128)
    # per chunk and step of key columns: three pairs of masked 64 x 64 products, one anchored pair
    gram = [f for name, f in flops.items() if name.startswith("gram:")]
    assert gram == [3 * 2 * 2 * 64 * 64 * 128 / 64, 2 * 2 * 64 * 64 * 128 / 64]
    assert ck.gram_block_flops(128) == 10 * 2 * 2 * 16 * 16 * 128 / 64  # the useful blocks: 6.4x fewer
    # four diagonal blocks, 15 row steps of a masked 16 x 16 multiply-add each, per 64 tokens
    assert flops["inverse: diagonal block inverses"] == 4 * 15 * 2 * 16**2 / 64
    assert ck.inverse_products() == 16
    assert flops["inverse: blocks of X left of the diagonal"] == 16 * 2 * 16**3 / 64
    assert flops["wu: X times [K * 2^gc, V]"] == 2 * 64 * 256
    assert sum(flops.values()) == 281_056
    # with the 16 x 16 gram kernel in its place, the design's count before the 64-row tiles
    assert sum(flops.values()) - sum(gram) + ck.gram_block_flops(128) == 170_464


def test_gram_kernels_agree_with_each_other_and_the_reference(inputs):
    """The 16 x 16 gram kernel and chunk.py's 64-row one write the same qg, Aqk and L, to float32 rounding
    (K u of the largest entry: sums of K float32 terms, grouped differently), both within TOL of float64."""
    ref = ck.reference_intermediates(**inputs)
    x = {n: inputs[n] for n in ("q", "k", "g", "beta")}
    g16, g64 = ck.gram(**x, kernel=ck.gram16_kernel), ck.gram(**x)
    K = inputs["q"].shape[-1]
    for name, want in (("qg", ref["qg"]), ("aqk", ref["aqk"]), ("L", ref["A"])):
        assert rel(g16[name], want) <= TOL and rel(g64[name], want) <= TOL, name
        assert (g64[name] - g16[name]).abs().max() <= K * 2**-24 * g16[name].abs().max(), name
    # the prepare kernels with the 16 x 16 gram kernel swapped in give the same intermediates
    p16 = ck.prepare(**inputs, gram_kernel=ck.gram16_kernel)
    for name in ("w", "u", "aqk"):
        assert rel(p16[name], ref[name]) <= TOL, name


def test_pytorch_gram64_is_the_reference_and_counts_its_flops(inputs):
    """The 64-row products in PyTorch (float64) give A and Aqk; the FLOP counter finds design_flops' gram entries."""
    from torch.utils.flop_counter import FlopCounterMode

    from kda_edu.ops._chunks import chunk_inputs

    x64 = {n: t.double() for n, t in inputs.items()}
    c = chunk_inputs(**x64, scale=None, chunk_size=64)
    A, Aqk = ck.gram64(c.q, c.k, c.g)
    ref = ck.reference_intermediates(**x64)
    assert rel(c.beta[..., None] * A, ref["A"]) < 1e-12 and rel(Aqk, ref["aqk"]) < 1e-12
    with FlopCounterMode(display=False) as counter:
        ck.gram64(c.q, c.k, c.g)
    tokens = c.q.shape[0] * c.q.shape[1] * c.q.shape[2] * 64  # B * HV * NT chunks of 64 rows
    K = inputs["q"].shape[-1]
    assert counter.get_total_flops() / tokens == sum(
        f for n, f in ck.design_flops(K, 16).items() if n.startswith("gram:")
    )


def test_discarded_entries_of_the_diagonal_product_overflow():
    """At gates of -8 (still the anchored path: 8 gates = 92.3 < 96 powers of two) the whole anchored product
    has non-finite entries off the diagonal blocks, none on their lower triangles; the kernel stays finite and
    matches the float64 reference."""
    from kda_edu.kernels.chunk_common import DIAG_LIMIT
    from kda_edu.ops._chunks import chunk_inputs

    x = random_inputs(1, 64, 1, 32, 16, lower_bound=-5.0, device=DEVICE)
    x["g"] = torch.full_like(x["g"], -8.0)
    assert ck.diagonal_spans(x["g"]).max() <= DIAG_LIMIT.value
    x64 = {n: t.double() for n, t in x.items()}
    c = chunk_inputs(**x64, scale=None, chunk_size=64)
    Mk, _ = ck.diagonal_product(c.q.float(), c.k.float(), c.g.float())
    blk = torch.arange(64, device=Mk.device) // 16
    on_diag = blk[:, None] == blk[None, :]
    lower = torch.ones(64, 64, dtype=torch.bool, device=Mk.device).tril()
    assert not torch.isfinite(Mk[..., ~on_diag]).all() and torch.isfinite(Mk[..., on_diag & lower]).all()
    with warnings.catch_warnings():  # the interpreter's NumPy warns of the same overflows inside the kernel
        warnings.simplefilter("ignore", RuntimeWarning)
        out = ck.gram(x["q"], x["k"], x["g"], x["beta"])
    ref = ck.reference_intermediates(**x64)
    assert all(torch.isfinite(t).all() for t in out.values())
    assert rel(out["aqk"], ref["aqk"]) <= TOL and rel(out["L"], ref["A"]) <= TOL


def test_per_block_path_in_both_gram_kernels():
    """Strong gates in half the key channels and a reset: some steps leave the anchored diagonal product, and
    the forward with either gram kernel still matches the float64 loop."""
    from kda_edu.kernels.chunk_common import DIAG_LIMIT

    x = random_inputs(1, 128, 1, 64, 16, lower_bound=-5.0)
    gen = torch.Generator().manual_seed(0)
    x["g"][..., 32:] = -12 * torch.rand(x["g"][..., 32:].shape, generator=gen)
    x["g"][:, 90] = -1000.0
    x = {n: t.to(DEVICE) for n, t in x.items()}
    per_block = ck.diagonal_spans(x["g"]) > DIAG_LIMIT.value
    assert per_block.any() and not per_block.all()
    o_ref, ht_ref = kda_recurrent(**{n: t.double() for n, t in x.items()}, output_final_state=True)
    for name in ("blocks16", "chunk_kda"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            o, ht = ck.LADDER[name][0](*(x[n] for n in ("q", "k", "v", "g", "beta")), 64**-0.5, None, True)
        assert rel(o, o_ref) <= TOL and rel(ht, ht_ref) <= TOL, name


def test_crossover():
    assert math.isclose(ck.crossover([1.0, 4.0], [2.0, 8.0], [1.0, 16.0]), 2.0)  # 2 T meets T^2 at T = 2
    assert ck.crossover([1.0, 4.0], [2.0, 8.0], [1.0, 4.0]) is None


def test_counted_flops_are_the_design_counts():
    """PyTorch's FLOP counter on the PyTorch forms finds `design_flops`' products exactly (C = 32: quick)."""
    counted, design = ck.counted_design_flops(64, 32, C=32), ck.design_flops(64, 32, C=32)
    assert all(counted[n] == f for n, f in design.items() if n in counted)
    assert counted["scan"] == design["scan: w S, qg S, kd^T U"] + design["scan: Aqk U"]
    assert counted["useful gram blocks"] == ck.gram_block_flops(64, C=32)


@pytest.mark.slow
def test_hopper_instructions_of_one_product():
    """Offline sm_90 compile: a 64-row tile at 4 warps is a warpgroup product, 16 rows per-warp ones; the
    16 x 16 gram kernel has only per-warp products, the 64-row one warpgroup products (and per-warp ones in
    its per-block path)."""
    jobs = [dict(kernel="tile_product", M=m, N=32, K=64, warps=4) for m in (16, 64)]
    jobs.append(dict(kernel="tile_product_tma", M=64, N=32, K=64, warps=4))
    jobs += [dict(kernel=name) for name in ("gram", "gram16", "inverse", "wu")]
    small, large, tma, gram, gram16, inverse, wu = ck.hopper_instructions(jobs)
    assert small["wgmma"] == 0 and small["mma.sync"] > 0
    assert large["wgmma"] > 0 and large["mma.sync"] == 0
    assert large["TMA copies"] == 0 and tma["TMA copies"] > 0
    assert gram16["wgmma"] == inverse["wgmma"] == 0 < min(gram16["mma.sync"], inverse["mma.sync"])
    assert gram["wgmma"] > 0 and 0 < gram["mma.sync"] < gram16["mma.sync"]
    assert wu["wgmma"] > 0 and wu["mma.sync"] == 0


def test_compile_specs_name_every_argument_of_their_kernel():
    """The offline builds name each kernel argument; a renamed argument must fail here, not in the chapter."""
    specs = ck._compile_specs()
    for name, spec in specs.items():
        kernels = [ck.KERNELS[name]] + ([ck.gram16_kernel] if name == "gram" else [])
        for kernel in kernels:
            args = list(getattr(kernel, "arg_names", None) or kernel.fn.arg_names)
            assert sorted(args) == sorted({**spec["signature"], **spec["constexprs"]}), name
