"""The figure helper: layout at the page's width, readable fonts, legends off the data."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from kda_edu import plotting  # noqa: E402


def test_figure_refuses_a_figure_without_a_finding_or_units():
    with pytest.raises(ValueError, match="title"):
        plotting.figure("  ", [("x (s)", "y (m)")])
    with pytest.raises(ValueError, match="axis labels"):
        plotting.figure("a finding", [("x (s)", "")])


def test_panels_wrap_into_rows_at_the_page_width():
    fig, axes = plotting.figure("three panels", [("x (s)", "y (m)")] * 3, width=6.0)
    assert len(axes) == 3 and len(fig.axes) == 3  # the fourth cell of the 2 x 2 grid is removed
    w, h = fig.get_size_inches()
    assert w <= plotting.PAGE_WIDTH + 1e-9 and h == pytest.approx(2 * 3.6)
    assert axes[2].get_position().y0 < axes[0].get_position().y0  # the third panel is on the second row
    plt.close(fig)


def test_long_labels_and_titles_are_wrapped():
    fig, (ax,) = plotting.figure("a " * 80, [("x (s)", "cache per sequence (GiB), Kimi-Linear-like, bf16")])
    assert "\n" in fig._suptitle.get_text() and "\n" in ax.get_ylabel()
    plt.close(fig)


def test_finish_enlarges_small_text_and_moves_a_legend_below_the_figure():
    fig, (ax,) = plotting.figure("a finding", [("x (s)", "y (m)")])
    xs = [i / 50 for i in range(51)]
    ax.plot(xs, [1.0] * 51, label="flat line across the top")
    ax.plot(xs, [0.0] * 51, label="flat line across the bottom")
    ax.plot([0.5], [0.5], "o", label="a point in the middle")
    ax.set_ylim(-0.1, 1.1)
    legend = ax.legend(loc="upper right", fontsize=6)
    ax.annotate("tiny", (0.5, 0.5), fontsize=5)
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    assert plotting._covers_data(ax, legend, renderer)
    plotting.finish(fig)
    fig.draw_without_rendering()
    assert ax.get_legend() is None and len(fig.legends) == 1  # one shared legend, below the figure
    (shared,) = fig.legends
    assert [t.get_text() for t in shared.get_texts()] == [
        "flat line across the top",
        "flat line across the bottom",
        "a point in the middle",
    ]
    assert shared.get_window_extent(renderer).y1 <= ax.get_window_extent(renderer).y0  # below the panel
    assert ax.get_window_extent(renderer).width > 0.8 * fig.get_window_extent(renderer).width  # not squeezed
    assert (
        min(t.get_fontsize() for t in fig.findobj(matplotlib.text.Text) if t.get_text()) >= plotting.MIN_FONT
    )
    plt.close(fig)


def test_finish_leaves_a_legend_that_covers_nothing():
    fig, (ax,) = plotting.figure("a finding", [("x (s)", "y (m)")])
    ax.plot([0, 1], [0, 0.2], label="low line")
    ax.set_ylim(0, 1)
    legend = ax.legend(loc="upper left")
    plotting.finish(fig)
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    assert legend.get_window_extent(renderer).x1 <= ax.get_window_extent(renderer).x1  # still inside
    plt.close(fig)


def test_finish_merges_the_legends_of_two_panels_into_one():
    fig, axes = plotting.figure("a finding", [("x (s)", "y (m)"), ("x (s)", "z (m)")])
    for ax, other in zip(axes, ["only on the left", "only on the right"], strict=True):
        ax.plot([0, 1], [1, 1], label="kda_edu")
        ax.plot([0, 1], [0, 0], label=other)
        ax.plot([0.5], [0.5], "o", label="fla")
        ax.legend(loc="center")
    plotting.finish(fig)
    (shared,) = fig.legends
    assert [t.get_text() for t in shared.get_texts()] == [
        "kda_edu",
        "only on the left",
        "fla",
        "only on the right",
    ]
    assert all(ax.get_legend() is None for ax in axes)
    plt.close(fig)
