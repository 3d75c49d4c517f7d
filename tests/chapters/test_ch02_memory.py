"""kda_edu.chapters.ch02_memory: the associative-memory retrieval experiment shared by chapters 2 and 3."""

import pytest
import torch

from kda_edu.chapters.ch02_memory import key_overlaps, linear_crosstalk, make_keys, retrieval_error


def test_orthogonal_keys_are_recalled_exactly():
    err = retrieval_error("linear", [1, 8, 16], 16, keys="orthogonal", trials=8)
    assert err.max() < 1e-10


def test_linear_rule_matches_the_crosstalk_prediction():
    ns = [16, 64]
    err = retrieval_error("linear", ns, 32, trials=64)
    expected = torch.tensor([linear_crosstalk(n, 32) for n in ns], dtype=torch.float64)
    assert torch.allclose(err, expected, rtol=0.1)


def test_a_callable_rule_is_accepted():
    exact = lambda k, v: torch.einsum("bnhk,bnhv->bhkv", k, v)
    assert torch.allclose(
        retrieval_error(exact, [4, 8], 16, trials=4), retrieval_error("linear", [4, 8], 16, trials=4)
    )


def test_keys_have_unit_length_and_overlaps_have_a_unit_diagonal():
    k = make_keys(3, 5, 8, "random", torch.Generator().manual_seed(0))
    assert k.shape == (3, 5, 1, 8) and torch.allclose(k.norm(dim=-1), torch.ones(3, 5, 1))
    assert torch.allclose(key_overlaps(6, 8).diagonal(), torch.ones(6))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="orthogonal"):
        retrieval_error("linear", [9], 8, keys="orthogonal")
    with pytest.raises(ValueError, match="n_pairs"):
        retrieval_error("linear", [], 8)
