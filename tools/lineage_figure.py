"""Draw the intro's lineage figure, book/figures/lineage.png: linear attention to KDA, one change per arrow.

Run: PYTHONPATH=$PWD python tools/lineage_figure.py (rewrites the PNG; commit it with this script).
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# name, equation, (x, y) centre
MODELS = {
    "linear": ("linear attention (ch. 2)", r"$S = S + k v^\top$", (0.0, 1.0)),
    "mamba2": ("Mamba-2, RetNet", r"$S = \alpha\, S + k v^\top$", (1.35, 2.0)),
    "gla": ("GLA", r"$S = \mathrm{Diag}(\alpha)\, S + k v^\top$", (2.7, 2.0)),
    "deltanet": ("DeltaNet (ch. 3)", r"$S = (I - \beta k k^\top) S + \beta k v^\top$", (1.35, 0.0)),
    "gdn": ("Gated DeltaNet (ch. 4)", r"$S = \alpha (I - \beta k k^\top) S + \beta k v^\top$", (2.7, 0.0)),
    "kda": (
        "KDA (ch. 5)",
        r"$S = (I - \beta k k^\top) \mathrm{Diag}(\alpha) S + \beta k v^\top$",
        (4.05, 1.0),
    ),
}
# from, to, the one change the arrow makes
ARROWS = [
    ("linear", "mamba2", "+ decay, one rate per head"),
    ("linear", "deltanet", "+ delta rule (erase before write)"),
    ("mamba2", "gla", "one rate per key channel"),
    ("deltanet", "gdn", "+ decay, one rate per head"),
    ("mamba2", "gdn", "+ delta rule"),
    ("gdn", "kda", "one rate per key channel"),
    ("gla", "kda", "+ delta rule"),
]


def main(out: Path = Path("book/figures/lineage.png")) -> None:
    fig, ax = plt.subplots(figsize=(12, 4.8), dpi=130)
    boxes = {}
    for key, (name, eq, (x, y)) in MODELS.items():
        boxes[key] = ax.text(
            x,
            y,
            f"{name}\n{eq}",
            ha="center",
            va="center",
            fontsize=10.5,
            bbox=dict(boxstyle="round,pad=0.5", fc="#eef3fb", ec="#3b6fb6"),
        )
    ax.set_xlim(-0.6, 4.75)
    ax.set_ylim(-0.55, 2.5)
    fig.canvas.draw()  # sizes the boxes, so the arrows can stop at their edges
    for a, b, change in ARROWS:
        (xa, ya), (xb, yb) = MODELS[a][2], MODELS[b][2]
        ax.annotate(
            "",
            xy=(xb, yb),
            xytext=(xa, ya),
            arrowprops=dict(
                arrowstyle="->",
                lw=1.4,
                color="#444",
                patchA=boxes[a].get_bbox_patch(),
                patchB=boxes[b].get_bbox_patch(),
                shrinkA=2,
                shrinkB=2,
            ),
        )
        # a horizontal arrow's label goes outside its row (above the top row, below the bottom one)
        lift = (0.32 if ya > 1 else -0.32) if ya == yb else 0.12
        ax.text(
            (xa + xb) / 2,
            (ya + yb) / 2 + lift,
            change,
            ha="center",
            va="center",
            fontsize=9,
            color="#8a2b0e",
            bbox=dict(fc="white", ec="none", pad=1),
        )
    ax.axis("off")
    ax.set_title("From linear attention to KDA: each arrow makes one change", fontsize=12)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print("wrote", out)


if __name__ == "__main__":
    main()
