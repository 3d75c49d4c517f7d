"""Chapter 9's helpers: the benchmark readers (`versus`, `kernel_split`, `backward_memory`) and the per-sequence
gradients of a packed row (`per_sequence_grads`)."""

import pytest
import torch

from kda_edu.backward_decoding import (
    BACKWARD_KERNELS,
    FORWARD_KERNELS,
    NAMES,
    backward_memory,
    kernel_split,
    outputs_and_grads,
    per_sequence_grads,
    versus,
    versus_range,
)
from kda_edu.book import bench_result
from kda_edu.chunkwise import random_inputs
from kda_edu.kda import kda_recurrent


def test_versus_words():
    assert versus(2.42) == "2.4x slower"
    assert versus(0.5) == "2.0x faster"
    assert versus_range([2.42, 2.53, 2.41]) == "2.4x to 2.5x slower"
    assert versus_range([2.41, 2.44]) == "2.4x slower"
    assert versus_range([0.5, 0.7]) == "1.4x to 2.0x faster"
    assert versus_range([0.8, 1.3]) == "1.2x faster to 1.3x slower"


def test_kernel_split_sorts_every_kernel_once():
    us = {name: 1000.0 for name in FORWARD_KERNELS + BACKWARD_KERNELS} | {"void at::native::copy": 500.0}
    split = kernel_split(us)
    assert set(split["forward"]) == set(FORWARD_KERNELS) and set(split["backward"]) == set(BACKWARD_KERNELS)
    assert split["other"] == {"void at::native::copy": 0.5}
    assert sum(ms for part in split.values() for ms in part.values()) == pytest.approx(sum(us.values()) / 1e3)


def test_backward_memory_phases():
    bf16 = backward_memory(1, 4096, 8, 8, 128, 128, in_bytes=2)
    assert bf16["peak"] == max(bf16["phases"].values()) == sum(bf16["at_peak"].values())
    assert "qg, kd" not in bf16["at_peak"]  # freed before the local kernels
    fp32 = backward_memory(1, 4096, 8, 8, 128, 128, in_bytes=4)
    assert not any("cast" in name for name in fp32["at_peak"])  # float32 gradients need no cast
    grouped = backward_memory(1, 4096, 4, 8, 128, 128, in_bytes=2)  # two value heads per key head
    assert "dq, dk summed over value heads" in grouped["at_peak"]


def test_backward_memory_reproduces_the_measured_peak():
    result = bench_result("h200_fwd_bwd.json")
    if result is None:
        pytest.skip("bench/results/h200_fwd_bwd.json is not here")
    row = next(r for r in result["rows"] if "kda_edu chunk_kda peak GiB" in r)
    mem = backward_memory(row["B"], row["T"], row["H"], row["H"], 128, 128, in_bytes=2)
    assert mem["peak"] / 2**30 == pytest.approx(row["kda_edu chunk_kda peak GiB"], rel=0.02)


def test_per_sequence_grads_handles_an_empty_sequence():
    lengths = [3, 0, 5]
    cu = torch.tensor([0, 3, 3, 8])
    x = random_inputs(1, sum(lengths), 1, 4, 3, seed=0)
    gen = torch.Generator().manual_seed(1)
    x["h0"], dht = (torch.randn(len(lengths), 1, 4, 3, generator=gen) for _ in range(2))
    do = torch.randn(1, sum(lengths), 1, 3, generator=gen)
    o, ht, grads = per_sequence_grads(kda_recurrent, x, do, dht, cu, dtype=torch.float64)
    assert torch.equal(ht[1], x["h0"][1].double()) and torch.equal(grads["h0"][1], dht[1].double())
    last = {n: x[n][:, 3:] for n in NAMES[:5]} | {"h0": x["h0"][2:]}
    o_3, ht_3, g_3 = outputs_and_grads(kda_recurrent, last, do[:, 3:], dht[2:])
    assert torch.allclose(o[:, 3:], o_3) and torch.allclose(ht[2:], ht_3)
    assert all(torch.allclose(grads[n][:, 3:], g_3[n]) for n in NAMES[:5])
    assert torch.allclose(grads["h0"][2:], g_3["h0"])
