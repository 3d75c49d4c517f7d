"""The README's table of headline results, built from the committed benchmark files.

Each GPU's row comes from `bench/results/speed_<gpu>.json` (bench/kernels/speed.py: ours and fla's timed
interleaved in one run, default arguments) where that file exists, else from the H200's earlier forward and
forward + backward runs (bench/kernels/bench_kda.py and bench_kda_bwd.py, which also timed both in one run).
`python tools/readme_results.py` prints the table; tests/test_book.py checks that the README holds exactly it.
"""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CASES = {"fwd": "forward", "fwd+bwd": "forward + backward"}


def _speed_rows(path: Path) -> list[tuple]:
    data = json.loads(path.read_text())
    gpu = data["device"].replace("NVIDIA ", "").split()[0]
    return [
        (CASES[r["case"]], (r["B"], r["T"], r["H"]), gpu, r["kda_edu ms"], r["fla ms"])
        for r in data["rows"]
        if r["case"] in CASES
    ]


def _legacy_h200_rows() -> list[tuple]:
    fwd = json.loads((RESULTS / "h200_forward_split.json").read_text())
    bwd = json.loads((RESULTS / "h200_fwd_bwd.json").read_text())
    rows = [
        (
            "forward",
            (r["B"], r["T"], r["H"]),
            "H200",
            *(r["methods"][m]["ms"] for m in ("kda_edu chunk_kda", "fla chunk_kda")),
        )
        for r in fwd["headline"]
    ]
    rows += [
        (
            "forward + backward",
            (r["B"], r["T"], r["H"]),
            "H200",
            r["kda_edu chunk_kda fwd+bwd ms"],
            r["fla chunk_kda fwd+bwd ms"],
        )
        for r in bwd["rows"]
    ]
    return rows


def rows() -> list[tuple]:
    """(case, (B, T, H), GPU, kda_edu ms, fla ms) for every headline row, H100 first."""
    out = []
    for gpu in ("h100", "h200"):
        path = RESULTS / f"speed_{gpu}.json"
        if path.exists():
            out += _speed_rows(path)
        elif gpu == "h200":
            out += _legacy_h200_rows()
    return out


def table() -> str:
    lines = [
        "| case | (B, T, H) | GPU | kda_edu (ms) | fla (ms) | kda_edu / fla |",
        "|---|---|---|---|---|---|",
    ]
    for case, shape, gpu, ours, fla in rows():
        lines.append(f"| {case} | {shape} | {gpu} | {ours:.3f} | {fla:.3f} | {ours / fla:.2f} |")
    lines.append("")
    lines.append(
        "bf16, K = V = 128, medians of `triton.testing.do_bench`, ours and fla's (fla-core 0.6.0, its Triton path)"
        " timed in the same run."
    )
    if not (RESULTS / "speed_h200.json").exists():
        lines.append(
            "The H200 rows come from the forward and forward + backward benchmarks, which ran `chunk_kda` with"
            " `check_inputs=False`; `bench/kernels/speed.py` times the default arguments."
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
