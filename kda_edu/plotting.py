"""One small helper so that every figure in the book looks the same.

Each figure states its finding in the title and labels both axes with units; ``figure``
refuses to make one that does not.
"""

import matplotlib.pyplot as plt

STYLE = {
    "figure.dpi": 110,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "font.size": 10,
    "legend.frameon": False,
}


def figure(title: str, panels: list[tuple[str, str]], *, width: float = 5.0, height: float = 3.6):
    """Create a figure with one panel per ``(xlabel, ylabel)`` pair and the finding as its title.

    Returns ``(fig, axes)`` where ``axes`` is a list with one Axes per panel.
    """
    if not title.strip():
        raise ValueError("title must state the figure's finding, got an empty string")
    for xlabel, ylabel in panels:
        if not xlabel.strip() or not ylabel.strip():
            raise ValueError(f"every panel needs both axis labels (with units), got {(xlabel, ylabel)}")
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), height), squeeze=False)
        axes = list(axes[0])
        for ax, (xlabel, ylabel) in zip(axes, panels, strict=True):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.spines[["top", "right"]].set_visible(False)
        fig.suptitle(title)
    return fig, axes


def finish(fig) -> None:
    """Lay the figure out and show it (inline in a notebook)."""
    fig.tight_layout()
    plt.show()
