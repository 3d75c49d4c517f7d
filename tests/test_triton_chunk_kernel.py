"""Chapter 8's stage-by-stage tools against the float64 PyTorch reference and the KDA loop."""

import math

import pytest
import torch

from kda_edu.book import bench_result
from kda_edu.chunkwise import random_inputs
from kda_edu.kda import kda_recurrent
from kda_edu.triton import chunk_kernel as ck

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


def test_scan_of_prepare_is_kda(inputs):
    h0 = torch.randn(1, 2, 32, 16, device=DEVICE)
    o, ht = ck.scan(ck.prepare(**inputs), initial_state=h0)
    o_ref, ht_ref = kda_recurrent(**{k: v.double() for k, v in inputs.items()}, initial_state=h0.double(),
                                  output_final_state=True)  # fmt: skip
    assert rel(o, o_ref) <= TOL and rel(ht, ht_ref) <= TOL


@pytest.mark.parametrize("C, block", [(64, 16), (32, 8), (64, 64), (16, 16)])
def test_product_form_inverse(C, block):
    gen = torch.Generator().manual_seed(0)
    L = torch.randn(C, C, generator=gen, dtype=torch.float64).tril(-1) * 0.3
    eye = torch.eye(C, dtype=torch.float64)
    assert torch.allclose(ck.product_form_inverse(L, block), torch.linalg.inv(eye + L), atol=1e-9, rtol=1e-9)


def test_counts_at_the_benchmark_shape():
    traffic = ck.design_traffic(128, 128)
    assert traffic["prepare reads the inputs"] + traffic["scan writes o"] == ck.floor_bytes(128, 128) == 1538
    assert ck.algorithm_flops(128) == 126_976
    assert ck.design_flops(128, 128)["prepare: inverse X (C x C products)"] == 10 * 2 * 64**2


def test_benchmark_file_and_crossover():
    bench = bench_result("h200_forward.json")
    T, ours = ck.times(bench["sweep"], "kda_edu chunk_kda")
    _, sdpa = ck.times(bench["sweep"], "torch sdpa flash causal")
    x = ck.crossover(T, ours, sdpa)
    assert x is not None and 8192 < x < 16384
    assert math.isclose(ck.crossover([1.0, 4.0], [2.0, 8.0], [1.0, 16.0]), 2.0)  # 2 T meets T^2 at T = 2
    assert ck.crossover([1.0, 4.0], [2.0, 8.0], [1.0, 4.0]) is None
