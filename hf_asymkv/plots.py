"""Plotting helpers the tools share (bench and evals): matplotlib on demand, atomic PNG writes, labels placed
without overlap, integer ticks for counts.

matplotlib (the ``eval`` extra) is imported only when a figure is drawn.
"""

from __future__ import annotations

from pathlib import Path

from .core.fileio import atomic_write

__all__ = ["MissingExtraError", "count_axis", "place_labels", "require_matplotlib", "save_figure"]

# Offsets (points) tried for a label, nearest first: right, left, above, below, then further out in both.
_OFFSETS = [(dx * r, dy * r) for r in (1, 2, 3, 4, 6) for dx, dy in ((4, -3), (-4, -3), (0, 5), (0, -11), (4, 6),
                                                                      (-4, 6), (4, -12), (-4, -12))]


class MissingExtraError(ImportError):
    """A package of the ``eval`` extra (matplotlib, for figures) is not installed."""


def require_matplotlib():
    """``matplotlib.pyplot`` with the non-interactive Agg backend.

    Raises:
        MissingExtraError: matplotlib is not installed (the message names the install command).
    """
    try:
        import matplotlib
    except ImportError:
        raise MissingExtraError('figures need matplotlib: pip install "hf_asymkv[eval]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    plt = require_matplotlib()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    return path


def _overlaps(box, boxes) -> bool:
    return any(box.overlaps(other) for other in boxes)


def place_labels(ax, points: list[tuple[float, float, str, str]], fontsize: float = 7) -> None:
    """Write a label beside each point without covering another label or point, where the axes have room.

    Each label tries offsets from its point, nearest first (right, left, above, below, then further out); the
    first that overlaps nothing already placed and stays inside the axes wins, with a thin leader line when it
    sits away from its point. A label with no free place takes the nearest one. Call it once the axes' limits
    and the figure's layout are final (the placement is in screen space).

    Args:
        points: ``(x, y, text, color)`` in data coordinates.
    """
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    taken = [_marker_box(ax, x, y) for x, y, _, _ in points]
    for x, y, text, color in sorted(points, key=lambda p: (p[1], p[0])):
        label = ax.annotate(text, (x, y), xytext=_OFFSETS[0], textcoords="offset points", fontsize=fontsize,
                            color=color, va="bottom", zorder=4)
        for k, offset in enumerate(_OFFSETS):
            label.set_position(offset)
            label.set_ha("right" if offset[0] < 0 else "center" if offset[0] == 0 else "left")
            box = label.get_window_extent(renderer)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not _overlaps(box, taken):
                break
        else:
            k = 0
            label.set_position(_OFFSETS[0])
            label.set_ha("left")
            box = label.get_window_extent(renderer)
        if k >= 8:  # placed away from its point: draw the leader line
            ax.annotate("", (x, y), xytext=label.get_position(), textcoords="offset points",
                        arrowprops={"arrowstyle": "-", "lw": 0.4, "color": color, "alpha": 0.6})
        taken.append(box)


def _marker_box(ax, x: float, y: float, size: float = 3.5):
    """The screen box a point's marker covers (``size`` pixels around its centre)."""
    from matplotlib.transforms import Bbox

    cx, cy = ax.transData.transform((x, y))
    return Bbox.from_extents(cx - size, cy - size, cx + size, cy + size)


def count_axis(ax, counts: list[int]) -> None:
    """A y axis for counts: integer ticks only, and a range that shows 0 when every count is 0 (not -0.04..0.04)."""
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(-0.5, max([*counts, 1]) + 0.5)
