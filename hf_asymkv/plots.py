"""Plotting helpers the tools share (bench and evals): matplotlib on demand, atomic PNG writes.

matplotlib (the ``eval`` extra) is imported only when a figure is drawn.
"""

from __future__ import annotations

from pathlib import Path

from .core.fileio import atomic_write

__all__ = ["MissingExtraError", "require_matplotlib", "save_figure"]


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
