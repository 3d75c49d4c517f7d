"""The shared state pass, `kda_edu.ops._chunks.state_passing`: the states it reports entering each chunk are
the loop's states at the chunk boundaries (its outputs and final state are tested through every chunked form)."""

import torch

from kda_edu.ops._chunks import chunk_inputs, state_passing
from kda_edu.ops.chunkwise import intra_chunk_matrices, random_inputs, ut_transform
from kda_edu.ops.kda import kda_recurrent


def test_states_entering_the_chunks_are_the_loops_states_at_the_boundaries():
    """float64, T = 50 with chunks of 16 (the last one padded), HV = 2 H, an initial state: 1e-12 absolute,
    rounding of a few hundred float64 operations on numbers of order 1."""
    x = random_inputs(1, 50, 1, 8, 4, HV=2, dtype=torch.float64, seed=4)
    h0 = torch.randn(1, 2, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    C, K = 16, 8
    q, k, v, _, gc, beta = chunk_inputs(**x, scale=None, chunk_size=C, resets=True)
    A, Aqk = intra_chunk_matrices(q, k, gc, beta, C)
    w, u = ut_transform(A, beta[..., None] * torch.cat([k * gc.exp(), v], dim=-1)).split([K, 4], -1)
    _, final, entering = state_passing(q, k, gc, Aqk, w, u, h0, entering=True)
    assert entering.shape == (1, 2, 4, 8, 4)
    for n, t in enumerate(range(0, 50, C)):
        want = h0 if t == 0 else kda_recurrent(**{a: b[:, :t] for a, b in x.items()}, initial_state=h0,
                                               output_final_state=True)[1]  # fmt: skip
        torch.testing.assert_close(entering[:, :, n], want, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        final, kda_recurrent(**x, initial_state=h0, output_final_state=True)[1], rtol=0, atol=1e-12
    )
