"""Chapter 9's helpers: the time ratios in words (`versus`), the count of the backward's buffers
(`backward_memory`, held to what `chunk_bwd.chunk_kda_bwd` keeps alive at each of its launches, on a CPU under
the interpreter), the forward + backward figure, and the per-sequence gradients of a packed row
(`per_sequence_grads`), and the kernel names and FLOP counts of the recomputation (`FORWARD_KERNELS`,
`BACKWARD_KERNELS`, `recompute_vs_store`)."""

import inspect
import sys
from unittest import mock

import pytest
import torch

from kda_edu.chapters.ch08_chunk_kernel import design_flops
from kda_edu.chapters.ch09_backward_decoding import (
    BACKWARD_KERNELS,
    FORWARD_KERNELS,
    MEMORY_GROUPS,
    NAMES,
    RECOMPUTED,
    backward_memory,
    outputs_and_grads,
    per_sequence_grads,
    recompute_vs_store,
    versus,
    versus_range,
)
from kda_edu.ops.chunkwise import random_inputs
from kda_edu.ops.kda import kda_recurrent


def test_kernel_names_are_the_librarys():
    """The forward's kernels are chunk_fwd.KERNELS in launch order; the backward starts with the three prepare
    kernels again (the ones `recompute_vs_store` counts) and goes on with chunk_bwd's own four."""
    from kda_edu.kernels import chunk_bwd, chunk_fwd

    assert [getattr(chunk_fwd, n) for n in FORWARD_KERNELS] == list(chunk_fwd.KERNELS.values())
    assert list(chunk_fwd.KERNELS)[:3] == list(RECOMPUTED) and BACKWARD_KERNELS[:3] == FORWARD_KERNELS[:3]
    assert all(callable(getattr(chunk_bwd, n)) for n in BACKWARD_KERNELS[3:])


def test_recompute_is_the_prepare_kernels():
    """Recomputing costs the forward minus its scan: more than half of it at K = V = 128, the gram kernel's
    masked 64-row products the largest part."""
    flops = design_flops(128, 128)
    cost = recompute_vs_store(128, 128)
    scan = sum(f for n, f in flops.items() if n.startswith("scan"))
    recompute = sum(cost["recompute_flops"].values())
    assert recompute == cost["forward_flops"] - scan
    assert 0.5 < recompute / cost["forward_flops"] < 2 / 3
    assert max(cost["recompute_flops"], key=cost["recompute_flops"].get) == "gram"
    assert (
        cost["recompute_flops"]["gram"]
        == sum(f for n, f in flops.items() if n.startswith("gram:"))
        == 131_072
    )
    # the inverse kernel's blocks left of the diagonal: sum_{c < a} (a - c) products L_ab X_bc, and one X_aa each
    nb = 4
    assert sum(a - c for a in range(nb) for c in range(a)) + nb * (nb - 1) // 2 == 16


def test_versus_words():
    assert versus(2.42) == "2.4x slower"
    assert versus(0.5) == "2.0x faster"
    assert versus_range([2.42, 2.53, 2.41]) == "2.4x to 2.5x slower"
    assert versus_range([2.41, 2.44]) == "2.4x slower"
    assert versus_range([0.5, 0.7]) == "1.4x to 2.0x faster"
    assert versus_range([0.8, 1.3]) == "1.2x faster to 1.3x slower"


def test_plot_fwd_bwd(monkeypatch):
    """The figure's title reads the ratios and the memory; every buffer at the peak is in one of its groups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kda_edu.chapters.ch09_backward_decoding import plot_fwd_bwd

    monkeypatch.setattr(plt, "show", lambda: None)
    mem = backward_memory(1, 32768, 32, 32, 128, 128)
    grouped = {m for members in MEMORY_GROUPS.values() for m in members}
    assert set(mem["at_peak"]) <= grouped
    steps = {(1, 8192, 32): (8.0, 5.0), (8, 4096, 16): (15.0, 10.0)}
    fig = plot_fwd_bwd(steps, mem, (1, 32768, 32), fla_gib=2 * mem["peak"] / 2**30)
    title = fig._suptitle.get_text()
    assert "1.5x to 1.6x slower" in title and "0.50x fla's" in title
    stacked = sum(p.get_height() for p in fig.axes[1].patches[: len(MEMORY_GROUPS)])
    assert stacked == pytest.approx(mem["peak"] / 2**30)
    plt.close("all")


def test_backward_memory_phases():
    rows = 8 * 64 * 64  # rows of the [rows, 64] intermediates: 8 heads x 64 chunks of 64
    bf16 = backward_memory(1, 4096, 8, 8, 128, 128, in_bytes=2)
    assert bf16["peak"] == max(bf16["phases"].values()) == sum(bf16["at_peak"].values())
    assert max(bf16["phases"], key=bf16["phases"].get) == "local_k (6)"
    assert "qg, kd" not in bf16["at_peak"]  # freed before the local kernels
    assert "X = (I + A)^-1 (float32)" not in bf16["at_peak"]  # freed before local_k
    assert bf16["at_peak"]["dA, local_v's shares (float32)"] == 2 * rows * 64 * 4  # K = 128: two blocks
    assert bf16["at_peak"]["dq, dk in the input dtype (written by local_k)"] == 2 * 4096 * 8 * 128 * 2
    fp32 = backward_memory(1, 4096, 8, 8, 128, 128, in_bytes=4)
    assert not any("cast" in name or "input dtype" in name for name in fp32["at_peak"])  # no cast needed
    grouped = backward_memory(1, 4096, 4, 8, 128, 128, in_bytes=2)  # two value heads per key head
    dqk = 2 * 4096 * 128  # numbers in dq and dk of one head
    assert bf16["phases"]["local_k (6)"] - grouped["phases"]["local_k (6)"] == 8 * dqk * 2  # bf16 dq, dk
    # grouped: float32 dq, dk of 8 value heads kept, their sums over 4 key heads, cast; bf16: only the bf16 ones
    assert grouped["phases"]["casts"] - bf16["phases"]["casts"] == 8 * dqk * (4 - 2) + 4 * dqk * (4 + 2)
    one_block = backward_memory(1, 4096, 8, 8, 128, 128, in_bytes=2, lv_block=128)  # one share of dA
    assert bf16["phases"]["local_k (6)"] - one_block["phases"]["local_k (6)"] == rows * 64 * 4
    assert one_block["phases"]["casts"] == bf16["phases"]["casts"]  # the shares are gone by then
    interp = backward_memory(1, 4096, 8, 8, 128, 128, in_bytes=2, work_bytes=4)
    float32_work = rows * (128 + 128 + 64 + 128) + 2 * 8 * 64 * 128 * 128  # w, u, Aqk, U; S0, dS
    assert interp["phases"]["casts"] - bf16["phases"]["casts"] == float32_work * (4 - 2)


def test_backward_memory_knobs_are_the_backwards_defaults():
    from kda_edu.kernels import chunk_bwd

    launcher = inspect.signature(chunk_bwd.chunk_kda_bwd).parameters
    model = inspect.signature(backward_memory).parameters
    for knob in ("lv_block", "lk_block"):
        assert model[knob].default == launcher[knob].default, knob
    assert model["chunk"].default == chunk_bwd.CHUNK


class _Alive:
    """Stands in for one of chunk_bwd's kernels (or `_finish`): before passing the call on, records the bytes
    of every tensor the calling `chunk_kda_bwd` holds in its local variables, its inputs excepted, each
    storage once (dAqk shares Aqk's buffer; dq_out, dk_out are dq, dk unless local_k writes 16-bit ones).
    With `after`, for `prepare_chunks`, which allocates its buffers itself: records once the call has
    returned, counting the buffers it returns too."""

    INPUTS = {"q", "k", "v", "g", "beta", "h0", "do", "dht", "cu_seqlens", "chunks", "offsets"}

    def __init__(self, fn, phase, log, after=False):
        self.fn, self.phase, self.log, self.after = fn, phase, log, after

    def _record(self, returned=()):
        frame = sys._getframe(2)
        assert frame.f_code.co_name == "chunk_kda_bwd"
        storages = {}
        tensors = [t for name, t in frame.f_locals.items() if name not in self.INPUTS]
        for t in [*tensors, *returned]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        self.log.setdefault(self.phase, sum(storages.values()))  # local_v's first launch

    def __getitem__(self, grid):
        self._record()
        return self.fn[grid]

    def __call__(self, *args, **kwargs):
        if not self.after:
            self._record()
            return self.fn(*args, **kwargs)
        result = self.fn(*args, **kwargs)
        self._record(returned=result[0].values())
        return result


@pytest.mark.slow
@pytest.mark.parametrize(
    "K, V, knobs, dtype",
    [
        (48, 40, {}, torch.float32),
        (48, 40, dict(lk_block=16, lv_block=16), torch.float32),
        (128, 64, {}, torch.float32),
        (128, 64, {}, torch.bfloat16),
    ],
    ids=["K48_defaults_one_lv_block", "K48_blocks_of_16", "K128_defaults", "K128_bf16"],
)
def test_backward_memory_follows_the_allocations(K, V, knobs, dtype):
    """Every phase of `backward_memory` equals what `chunk_kda_bwd` holds when it launches that phase's kernel
    (the casts: when it calls `_finish`, so without what `_finish` makes), minus the output o, which the
    caller holds. bf16 as the benchmark
    has it (q, k, v, beta in bf16, g in float32): local_k writes dq, dk in bf16 and only dbeta is cast. The
    interpreter keeps the intermediates in float32 whatever the inputs (`work_bytes=4`); a GPU keeps them in
    the input dtype."""
    from kda_edu.kernels import chunk_bwd, chunk_kda
    from kda_edu.kernels._backend import interpreting

    B, T, H = 1, 130, 2  # three chunks, the last one short
    x = random_inputs(B, T, H, K, V, seed=3, device="cuda" if torch.cuda.is_available() else "cpu")
    x = {n: t.to(dtype) if n != "g" else t for n, t in x.items()}
    xs = {n: t.clone().requires_grad_() for n, t in x.items()}
    log = {}
    phases = {
        "prepare_chunks": "recompute (kernels 1-2)",
        "_dstates_kernel": "state passes (3-4)",
        "_local_v_kernel": "local_v (5)",
        "_local_k_kernel": "local_k (6)",
        "_finish": "casts",
    }
    patches = [
        mock.patch.object(chunk_bwd, n, _Alive(getattr(chunk_bwd, n), p, log, after=n == "prepare_chunks"))
        for n, p in phases.items()
    ]
    original = chunk_bwd.chunk_kda_bwd
    patches.append(
        mock.patch.object(chunk_bwd, "chunk_kda_bwd", lambda *a, **kw: original(*a, **kw, **knobs))
    )
    o, _ = chunk_kda(*(xs[n] for n in ("q", "k", "v", "g", "beta")))
    for p in patches:
        p.start()
    try:
        o.backward(torch.randn_like(o))
    finally:
        for p in reversed(patches):
            p.stop()
    in_bytes = torch.finfo(dtype).bits // 8
    model = backward_memory(
        B, T, H, H, K, V, in_bytes=in_bytes, work_bytes=4 if interpreting() else in_bytes, **knobs
    )
    o_bytes = o.numel() * o.element_size()
    made_by_finish = sum(b for n, b in model["buffers"]["casts"].items() if "cast to" in n or "summed" in n)
    assert made_by_finish == (0 if dtype == torch.float32 else T * H * 2)  # bf16: dbeta's cast only
    expected = {phase: nbytes - o_bytes for phase, nbytes in model["phases"].items()}
    expected["casts"] -= made_by_finish  # recorded as `_finish` is called, before it casts
    assert log == expected


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


def test_record_launches_records_the_backward_in_order():
    from kda_edu.chapters.ch09_backward_decoding import input_grads, record_launches
    from kda_edu.kernels import chunk_kda

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = random_inputs(1, 20, 1, 128, 16, seed=5, device=device)  # 128 key channels: two key blocks
    x["h0"] = torch.randn(1, 1, 128, 16, device=device)
    do, dht = torch.randn(1, 20, 1, 16, device=device), torch.randn(1, 1, 128, 16, device=device)
    with record_launches() as records:
        input_grads(chunk_kda, x, do, dht, dtype=torch.float32)
    names = [(name, first) for name, first, *_ in records]
    own = [(n, None) for n in BACKWARD_KERNELS[2:5]] + [("_local_v_kernel", True), ("_local_v_kernel", False)]
    assert names == [(n, None) for n in FORWARD_KERNELS] + own + [(n, None) for n in BACKWARD_KERNELS[-2:]]
    assert records[2][2:] == records[4][2:]  # the w/u kernel: the same grid and arguments in both passes
