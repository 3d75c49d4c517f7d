"""Chapter 8's v0 forward (kda_edu.chapters.ch08_chunk_v0) against the float64 loop, and its input errors.

On a CPU the kernels run through Triton's interpreter, in float32 (element-wise float32 for A, Aqk and the
substitution, exact float32 "ieee" products), so the shapes are small and the inputs float32. Tolerance on
the relative error of o and of the final state: 1e-5, the float32 bound of every kernel test
(tests/reference_inputs.py). float32's unit roundoff is 6e-8; the 64-term sums, the 64-row substitution and
the state pass over a few chunks amplify it: the errors measured on these inputs are at most 2.4e-6 (the
gates of -60, whose cumulative sums reach -3840; under 1e-6 on the others), so the bound leaves a margin of
four and fails on any wrong term (a missing decay or beta moves o by O(1)).
On a CUDA machine the compiled kernels sum in another order than the loop: 1e-4 there, as in test_chunk.py.
"""

import pytest
import torch
import torch.nn.functional as F
from reference_inputs import kda_oracle, rel_err

from kda_edu.chapters.ch08_chunk_kernel import LADDER
from kda_edu.chapters.ch08_chunk_v0 import chunk_kda_v0

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5 if DEVICE == "cpu" else 1e-4


def make_inputs(B, T, H, HV, K, V, gate=-5.0, seed=0):
    """Unit-length q and k, v ~ N(0, 1), gates uniform in [gate, 0), beta in (0, 1), a state."""
    gen = torch.Generator().manual_seed(seed)
    x = dict(
        q=F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        k=F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        v=torch.randn(B, T, HV, V, generator=gen),
        g=gate * torch.rand(B, T, HV, K, generator=gen),
        beta=torch.rand(B, T, HV, generator=gen),
    )
    h0 = torch.randn(B, HV, K, V, generator=gen)
    return {n: t.to(DEVICE) for n, t in x.items()}, h0.to(DEVICE)


SHAPES = {
    # (B, T, H, HV, K, V)
    "T=1": (1, 1, 1, 1, 16, 16),
    "T_not_multiple_of_64_K_ne_V": (1, 100, 1, 1, 32, 16),
    "HV_gt_H_two_batches": (2, 70, 1, 2, 16, 32),
    "K_V_not_powers_of_2": (1, 65, 2, 4, 24, 40),
}


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_v0_matches_fp64_loop(shape, with_state):
    x, h0 = make_inputs(*shape)
    h0 = h0 if with_state else None
    o, ht = chunk_kda_v0(**x, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = kda_oracle(**x, h0=h0)
    assert o.dtype == torch.float32 and o.shape == x["v"].shape
    assert ht.dtype == torch.float32 and ht.shape == ht_ref.shape
    assert rel_err(o, o_ref) <= TOL and rel_err(ht, ht_ref) <= TOL


def test_strong_gates_and_resets_stay_exact():
    """The pairwise decays exp(gc_i - gc_j) <= 1 take any gate: -60 per step, and -inf (a reset)."""
    x, h0 = make_inputs(1, 80, 1, 1, 16, 16, gate=-60.0)
    x["g"][:, 40] = float("-inf")  # forget everything before step 40
    o, ht = chunk_kda_v0(**x, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = kda_oracle(**x, h0=h0)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_err(o, o_ref) <= TOL and rel_err(ht, ht_ref) <= TOL


def test_scale_and_no_final_state():
    x, _ = make_inputs(1, 40, 1, 1, 16, 16)
    o, ht = chunk_kda_v0(**x, scale=0.5)
    assert ht is None
    assert rel_err(o, kda_oracle(**x, scale=0.5)[0]) <= TOL


def test_ladder_launchers_agree_with_the_loop():
    """Every entry of the ladder the benchmark times computes KDA: same inputs, same answer."""
    x, h0 = make_inputs(1, 70, 1, 2, 16, 16)
    o_ref, ht_ref = kda_oracle(**x, h0=h0)
    for name, (launcher, _) in LADDER.items():
        o, ht = launcher(*(x[n] for n in ("q", "k", "v", "g", "beta")), 16**-0.5, h0, True)
        assert rel_err(o, o_ref) <= TOL and rel_err(ht, ht_ref) <= TOL, name


def test_bad_inputs_raise_clear_errors():
    x, h0 = make_inputs(1, 8, 1, 1, 16, 16)
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        chunk_kda_v0(**x, cu_seqlens=torch.tensor([0, 3, 8], device=DEVICE))
    with pytest.raises(ValueError, match=r"v must have shape \[B, T, HV, V\]"):
        chunk_kda_v0(**(x | {"v": x["v"][:, :4]}))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        chunk_kda_v0(**{n: t.double() for n, t in x.items()})
    with pytest.raises(ValueError, match="g of shape"):
        chunk_kda_v0(**(x | {"g": -x["g"] + 0.1}))
    with pytest.raises(TypeError, match="initial_state"):
        chunk_kda_v0(**x, initial_state=h0.double())
    with pytest.raises(ValueError, match="forward only"):
        chunk_kda_v0(**(x | {"q": x["q"].clone().requires_grad_()}))
    big = make_inputs(1, 2, 1, 1, 272, 16)[0]
    with pytest.raises(ValueError, match="K, V <= 256"):
        chunk_kda_v0(**big)
