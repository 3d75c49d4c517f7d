"""Chapter 12's reading of a recall sweep (`kda_edu.training.sweep` trains it and `summarize`s it): the
tiers that the seeds can order, the pairwise comparisons, the tables and curves the chapter shows."""

import statistics

from kda_edu.layers.mixers import LABELS


def tiers(summary: list[dict], task: str, seq_len: int) -> list[list[str]]:
    """The mixers of one task and length in tiers, best mean first: a mixer opens a new tier when its best seed
    is below the worst seed of every mixer in the current tier (their seed ranges do not overlap); otherwise
    it joins the tier, whose members the seeds cannot order. With one seed a cell's range is a point."""
    rows = sorted(
        (r for r in summary if r["task"] == task and r["seq_len"] == seq_len), key=lambda r: -r["mean"]
    )
    groups: list[list[dict]] = []
    for r in rows:
        if groups and r["max"] >= min(m["min"] for m in groups[-1]):
            groups[-1].append(r)
        else:
            groups.append([r])
    return [[r["mixer"] for r in g] for g in groups]


SHORT = {
    "linear_attention": "linear",
    "decay_only": "decay",
    "deltanet": "DeltaNet",
    "gated_deltanet": "GDN",
    "kda": "KDA",
    "attention": "softmax",
}
"""Short names for printed lines: linear attention, decay only, DeltaNet, Gated DeltaNet, KDA, softmax attention."""


def tier_text(groups: list[list[str]], labels: dict[str, str] = LABELS) -> str:
    """Tiers as text: `>` between tiers, `~` inside one (e.g. "attention > KDA ~ DeltaNet > ...")."""
    return " > ".join(" ~ ".join(labels[m] for m in g) for g in groups)


def seed_relation(summary: list[dict], task: str, seq_len: int, a: str, b: str) -> str:
    """How mixer `a` stands against mixer `b` in one cell, each at its best rate: ">" when every seed of `a`
    scored above every seed of `b`, "<" for the reverse, "~" when their seed ranges overlap."""
    row = {r["mixer"]: r for r in summary if r["task"] == task and r["seq_len"] == seq_len}
    ra, rb = row[a], row[b]
    return ">" if ra["min"] > rb["max"] else "<" if ra["max"] < rb["min"] else "~"


def accuracy_curve(
    runs: list[dict], task: str, seq_len: int, mixer: str, lr: float
) -> dict[str, list[float]]:
    """Held-out accuracy against step for one cell and rate, over its seeds: `step`, `mean`, `min`, `max`."""
    curves = [
        [h["eval_acc"] for h in r["history"]]
        for r in runs
        if (r["task"], r["seq_len"], r["mixer"], r["lr"]) == (task, seq_len, mixer, lr)
    ]
    if not curves:
        raise ValueError(f"no runs for {task} T={seq_len} {mixer} lr={lr}")
    steps = [h["step"] for h in next(r for r in runs if r["task"] == task)["history"]]
    by_step = list(zip(*curves, strict=True))
    return {
        "step": steps,
        "mean": [statistics.fmean(a) for a in by_step],
        "min": [min(a) for a in by_step],
        "max": [max(a) for a in by_step],
    }


def markdown_table(summary: list[dict]) -> str:
    """The summary as a Markdown table: one row per task and length, one column per mixer, cells
    `mean [min, max]` of the final accuracy at the best rate."""
    mixers = [k for k in LABELS if any(r["mixer"] == k for r in summary)]
    cells = {(r["task"], r["seq_len"], r["mixer"]): r for r in summary}
    lines = [
        "| task | T | " + " | ".join(LABELS[m] for m in mixers) + " |",
        "|---|---|" + "---|" * len(mixers),
    ]
    for task, seq_len in dict.fromkeys((r["task"], r["seq_len"]) for r in summary):
        row = [f"{task}", f"{seq_len}"]
        for m in mixers:
            r = cells.get((task, seq_len, m))
            row.append("" if r is None else f"{r['mean']:.2f} [{r['min']:.2f}, {r['max']:.2f}]")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
