"""One small helper so that every figure in the book looks the same and reads at the page's width.

Each figure states its finding in the title and labels both axes with units; ``figure`` refuses to make one
that does not. The book's pages are about 750 pixels wide, so a figure is at most ``PAGE_WIDTH`` inches wide
(panels beyond ``MAX_COLUMNS`` go to a new row), long titles and axis labels are wrapped instead of cut off,
and ``finish`` lifts every text to at least ``MIN_FONT`` points and moves a legend that covers data below
the figure (one shared legend, so the panels keep their width).
"""

import math
import textwrap

import matplotlib.pyplot as plt
from matplotlib.text import Text

# One colour per method in every chapter: a reader who learns that red is kda_edu's kernel finds it red again.
COLORS = {
    "kda_edu": "C3",  # our Triton kernels
    "fla": "C0",  # fla's, the baseline
    "fla gated delta": "C2",  # fla's Gated DeltaNet kernel
    "reference": "C7",  # a plain PyTorch form (kda_chunked, a loop)
    "softmax": "k",  # softmax attention (FlashAttention through sdpa)
}
PAGE_WIDTH = 9.0  # inches: the widest figure; a page shows it at about 0.75 of its size
MAX_COLUMNS = 2  # panels per row
MIN_FONT = 9.5  # points, before the page scales the figure down
STYLE = {
    "figure.dpi": 110,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "font.size": 11,
    "axes.titlesize": 11,
    "axes.labelsize": 11,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "legend.fontsize": 10,
    "figure.titlesize": 12,
    "legend.frameon": False,
}


def _wrap(text: str, inches: float, points: float) -> str:
    """Wrap `text` into lines that fit `inches` at a font of `points` (about 0.55 em per character)."""
    chars = max(12, int(inches * 72 / (0.55 * points)))
    return "\n".join(textwrap.wrap(text, chars, break_on_hyphens=False)) if len(text) > chars else text


def _sharp_on_the_page() -> None:
    """In a notebook, send figures as PNGs at twice their pixels with their display size beside them
    ("retina"), so that the built pages (myst-nb keeps the size) show sharp text. Outside IPython: nothing."""
    try:
        from IPython import get_ipython
        from matplotlib_inline.backend_inline import set_matplotlib_formats
    except ImportError:
        return
    if get_ipython() is not None:
        set_matplotlib_formats("retina")


def figure(title: str, panels: list[tuple[str, str]], *, width: float = 5.0, height: float = 3.6):
    """Create a figure with one panel per ``(xlabel, ylabel)`` pair and the finding as its title.

    Args:
        width, height: of one panel in inches; a row of panels is at most ``PAGE_WIDTH`` wide (its panels
            narrower if need be), and there are at most ``MAX_COLUMNS`` panels per row.

    Returns ``(fig, axes)`` where ``axes`` is a list with one Axes per panel, in the order of ``panels``.
    """
    if not title.strip():
        raise ValueError("title must state the figure's finding, got an empty string")
    if not panels:
        raise ValueError("panels must name at least one (xlabel, ylabel) pair")
    for xlabel, ylabel in panels:
        if not xlabel.strip() or not ylabel.strip():
            raise ValueError(f"every panel needs both axis labels (with units), got {(xlabel, ylabel)}")
    _sharp_on_the_page()
    cols = min(len(panels), MAX_COLUMNS)
    rows = math.ceil(len(panels) / cols)
    panel_width = min(width, PAGE_WIDTH / cols)
    with plt.rc_context(STYLE):
        fig, grid = plt.subplots(
            rows, cols, figsize=(panel_width * cols, height * rows), squeeze=False, layout="constrained"
        )
        cells = list(grid.flat)
        for unused in cells[len(panels) :]:
            unused.remove()
        axes = cells[: len(panels)]
        for ax, (xlabel, ylabel) in zip(axes, panels, strict=True):
            ax.set_xlabel(_wrap(xlabel, 0.9 * panel_width, STYLE["axes.labelsize"]))
            ax.set_ylabel(_wrap(ylabel, 0.85 * height, STYLE["axes.labelsize"]))
            ax.grid(True, alpha=0.3)
            ax.spines[["top", "right"]].set_visible(False)
        fig.suptitle(_wrap(title, panel_width * cols, STYLE["figure.titlesize"]))
    return fig, axes


def _covers_data(ax, legend, renderer) -> bool:
    """Whether the legend's box lies over any plotted point, bar or marker of its axes."""
    box = legend.get_window_extent(renderer)
    for line in ax.lines:
        points = line.get_transform().transform(line.get_xydata())
        if any(box.contains(x, y) for x, y in points):
            return True
    for collection in ax.collections:
        offsets = collection.get_offset_transform().transform(collection.get_offsets())
        if any(box.contains(x, y) for x, y in offsets):
            return True
    return any(box.overlaps(patch.get_window_extent(renderer)) for patch in ax.patches)


def finish(fig) -> None:
    """Make the figure readable at the page's width, then show it (inline in a notebook).

    Every text smaller than ``MIN_FONT`` is enlarged to it. Legends that cover data leave their panels and
    become one legend below the figure (a label shared by two panels appears once), so no panel is squeezed
    sideways; constrained layout then makes room for it.
    """
    for text in fig.findobj(Text):
        if text.get_text() and text.get_fontsize() < MIN_FONT:
            text.set_fontsize(MIN_FONT)
    renderer = fig.canvas.get_renderer()
    fig.draw_without_rendering()
    moved = {}  # label -> handle, in order, from every legend that covers data
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None and _covers_data(ax, legend, renderer):
            for handle, text in zip(legend.legend_handles, legend.get_texts(), strict=True):
                moved.setdefault(text.get_text(), handle)
            legend.remove()
    if moved:
        fig.legend(list(moved.values()), list(moved), loc="outside lower center", ncols=min(3, len(moved)))
    plt.show()
