"""bench.kernels.profile_ncu: its summary of ncu's raw CSV, and its set-up on the CPU."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench.kernels import profile_ncu

ROOT = Path(__file__).resolve().parents[2]


# The shape of `ncu --csv --page raw` (a header, a units row, one row per launch), with ncu's own messages and a
# line of the program's output around it, two launches and a handful of metrics.
RAW = """==PROF== Connected to process 123
"ID","Kernel Name","gpu__time_duration.sum","launch__registers_per_thread","dram__bytes.sum","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","l1tex__t_bytes.sum"
"","","us","register/thread","Mbyte","ratio","ratio","ratio","Mbyte"
"0","_chunk_prepare_kernel","1,193.50","255","402.65","3.10","7.25","0.80","812.00"
a line printed by the program
"1","chunk_kda_fwd_kernel_intra","240.10","128","n/a","0.50","1.20","2.00","90.00"
==PROF== Disconnected from process 123
"""


def test_the_summary_reads_each_launch_with_units_and_its_largest_stalls():
    launches = profile_ncu.summarize(RAW)
    assert [r["kernel"] for r in launches] == ["_chunk_prepare_kernel", "chunk_kda_fwd_kernel_intra"]
    first, second = launches
    assert first["duration"] == 1193.5 and first["units"]["duration"] == "us"  # a thousands separator read
    assert (
        first["registers"] == 255
        and first["dram_bytes"] == 402.65
        and first["units"]["dram_bytes"] == "Mbyte"
    )
    assert list(first["stalls"]) == ["long_scoreboard", "barrier", "wait"]  # largest first
    assert second["dram_bytes"] == "n/a"  # kept as written when it is no number
    assert first["other"] == {"l1tex__t_bytes.sum": "812.00"}


def test_the_summary_refuses_text_without_an_ncu_table():
    with pytest.raises(ValueError, match="ncu raw CSV"):
        profile_ncu.summarize("==PROF== Connected\nnothing profiled\n")


@pytest.mark.slow
def test_the_profiled_methods_run_on_the_cpu():
    out = subprocess.run(
        [sys.executable, "-m", "bench.kernels.profile_ncu", "--smoke", "--backward"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "smoke: ['kda_edu'] ran" in out.stdout
