"""Figures of the evaluations (needle heatmaps, per-layer attention damage, perplexity, summary), as PNG files."""

from __future__ import annotations

import math
from pathlib import Path

from ..plots import require_matplotlib, save_figure

__all__ = ["plot_attention_layers", "plot_needle_heatmaps", "plot_ppl", "plot_summary"]


def plot_needle_heatmaps(grids: dict[str, list[list[float]]], lengths: list[int], depths: list[float],
                         title: str, path: Path) -> Path:
    """One accuracy heatmap (depth rows x length columns, 0..1) per scheme, in a grid of panels."""
    plt = require_matplotlib()
    n = len(grids)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    fig.subplots_adjust(hspace=0.5, wspace=0.3)
    for ax, (scheme, grid) in zip(axes.flat, grids.items()):
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_title(scheme, fontsize=9)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        for (i, j), value in _cells(grid):
            ax.text(j, i, "-" if math.isnan(value) else f"{value:.2f}", ha="center", va="center", fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.supxlabel("context length (tokens)", fontsize=9)
    fig.supylabel("needle depth", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.colorbar(im, ax=axes, shrink=0.6, label="accuracy")
    return save_figure(fig, path)


def _cells(grid: list[list[float]]):
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            yield (i, j), value


def plot_attention_layers(rows, induction: list[float] | None, title: str, path: Path) -> Path:
    """Per-layer KL (log scale) and top-8/top-32 overlap, one line per scheme; induction score shaded."""
    plt = require_matplotlib()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    layers = range(len(rows[0].kl))
    for r in rows[1:]:  # rows[0] is the reference (zero damage)
        axes[0].plot(layers, [max(x, 1e-9) for x in r.kl], marker=".", label=r.scheme)
        axes[1].plot(layers, r.topk["8"], marker=".", label=r.scheme)
        axes[2].plot(layers, r.topk["32"], marker=".", label=r.scheme)
    axes[0].set_yscale("log")
    for ax, label in zip(axes, ("KL(full || scheme), nats", "top-8 overlap", "top-32 overlap")):
        ax.set_xlabel("layer")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if induction is not None:
            twin = ax.twinx()
            twin.bar(layers, induction, color="grey", alpha=0.15, width=0.9)
            twin.set_ylim(0, 1)
            twin.set_yticks([])
    axes[2].legend(fontsize=7, loc="lower left")
    fig.suptitle(title + ("  (grey bars: induction score of the layer's best head)" if induction else ""),
                 fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_ppl(rows: list[dict], title: str, path: Path) -> Path:
    """Bars: perplexity change (%) against full precision and next-token top-1 agreement, per scheme."""
    plt = require_matplotlib()
    rows = [r for r in rows if r["scheme"] != "dynamic"]
    names = [r["scheme"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    axes[0].barh(names, [r["delta_pct"] for r in rows], color="tab:blue")
    axes[0].set_xlabel("Δ perplexity vs full precision, %")
    axes[1].barh(names, [100 * (1 - r["top1_agree"]) for r in rows], color="tab:orange")
    axes[1].set_xlabel("next-token argmax differs from full precision, % of positions")
    for ax in axes:
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    axes[1].set_yticks([])
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_summary(points: dict[str, tuple[float, float]], title: str, path: Path) -> Path:
    """Scatter: Δppl % (x) against needle accuracy (y), one labelled point per scheme."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    stacked: dict[float, int] = {}  # labels of points at the same accuracy are stacked, not overprinted
    for name, (delta, acc) in sorted(points.items(), key=lambda kv: kv[1]):
        k = stacked[round(acc, 4)] = stacked.get(round(acc, 4), -1) + 1
        ax.scatter(delta, 100 * acc, s=30)
        ax.annotate(name, (delta, 100 * acc), fontsize=7, xytext=(6, 3 - 9 * k), textcoords="offset points",
                    arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "grey"} if k else None)
    ax.set_xlabel("Δ perplexity vs full precision, %")
    ax.set_ylabel("needle accuracy, %")
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
