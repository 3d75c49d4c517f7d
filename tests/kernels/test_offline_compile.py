"""Every Triton kernel of kda_edu builds for the GPUs readers have, without one: compiled offline (Triton's
compiler and the ptxas it ships) for sm_75 (T4), sm_80 (A100) and sm_90 (H100, H200), with the dtypes the
launchers pick there, as `kda_edu.kernels.offline.build_library` does. A kernel that cannot build for one of
them (a bfloat16 product on a T4, an instruction only Hopper has) fails here instead of on that GPU."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from kda_edu.kernels.offline import CAPABILITIES, in_fresh_python

pytestmark = pytest.mark.gpu_build  # its own stage of `make test` (`make kernel-builds`)

PLANTED = "tests.kernels.planted_kernels"


SETS = ("kda_edu.kernels.offline:library_launches", "kda_edu.chapters.ch08_chunk_kernel:chapter_launches")


def build(capability, sets=SETS, extra=None, shard=(0, 1)) -> list[dict]:
    job = {"capability": list(capability), "sets": sets, "extra": extra, "shard": list(shard)}
    return in_fresh_python("kda_edu.kernels.offline", "build", [job])[0]


def failures(results: list[dict]) -> str:
    return "\n\n".join(f"{r['kernel']}:\n{r['error']}" for r in results if r["error"])


@pytest.fixture(autouse=True)
def fast_ptxas(monkeypatch):
    # ptxas at -O0: it still refuses what the target lacks, in a fraction of the time (Triton's knob).
    monkeypatch.setenv("DISABLE_PTXAS_OPT", "1")


def test_every_kernel_builds_for_every_supported_gpu():
    # Each target's kernels in two halves, as many processes at a time as there are cores (two on CI): the
    # stage runs alone.
    jobs = [(capability, (i, 2)) for capability in CAPABILITIES for i in range(2)]
    with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
        halves = list(pool.map(lambda job: build(job[0], shard=job[1]), jobs))
    built = {capability: [] for capability in CAPABILITIES}
    for (capability, _), results in zip(jobs, halves, strict=True):
        built[capability] += results
    for capability, results in built.items():
        names = {r["kernel"].split("(")[0] for r in results}
        assert len(names) >= 19 + 9, f"sm_{capability[0]}{capability[1]}: only {sorted(names)} were launched"
        assert not failures(results), f"sm_{capability[0]}{capability[1]}:\n{failures(results)}"


@pytest.mark.parametrize(
    "extra, fails_on, builds_on",
    [
        (f"{PLANTED}:launch_bf16_pack", (7, 5), (8, 0)),
        (f"{PLANTED}:launch_cluster_rank", (8, 0), (9, 0)),
    ],
)
def test_a_kernel_that_cannot_build_for_a_gpu_fails(extra, fails_on, builds_on):
    (bad,) = build(fails_on, sets=(), extra=extra)
    (good,) = build(builds_on, sets=(), extra=extra)
    assert bad["error"], f"{bad['kernel']} built for sm_{fails_on[0]}{fails_on[1]}"
    assert good["error"] is None, good["error"]
