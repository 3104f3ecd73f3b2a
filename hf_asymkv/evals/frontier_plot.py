"""The frontier figure: damage against compression, one panel per measured metric, every scheme numbered.

Up to four panels share the x axis (times smaller than a bf16 ``DynamicCache``): needle prompts lost (a count:
integer ticks), tail next-token KL and attention KL (log y), Δppl % (symmetric log: it spans orders of magnitude
and can be zero or slightly negative, linear within ±:data:`PPL_LINEAR` % of zero, a dotted line at 0). A panel
is left out when no scheme measured it. Ours are joined by their Pareto line.

With 25 schemes, names beside the points overprint each other where many formats sit at the same compression
and damage (every 8-bit format at 0 prompts lost); so each scheme gets a number, written beside its point where
it does not cover another (:func:`hf_asymkv.plots.place_labels`), and a table beside the panels lists the
numbers with the names, ordered by compression.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..plots import count_axis, place_labels, require_matplotlib, save_figure
from .report import plural

__all__ = ["PPL_LINEAR", "frontier_title", "plot_frontier"]

PPL_LINEAR = 0.01
"""Δppl % within which the Δppl axis is linear (symlog beyond)."""

STYLES = {"ours": ("tab:blue", "o"), "peer": ("tab:red", "s"), "baseline": ("tab:gray", "^")}
"""Colour and marker per kind of scheme."""

PANELS = (
    ("needle prompts lost vs full precision", "lost", "count"),
    ("tail next-token KL vs full precision (nats)", "tail_kl", "log"),
    ("attention KL vs full precision (nats)", "attention_kl", "log"),
    ("Δperplexity vs full precision (%)", "delta_ppl_pct", "symlog"),
    ("long-decode KL, last 64 generated tokens (nats)", "decode_kl", "log"),
)
"""(y label, FrontierRow field, y scale) of each panel."""


def frontier_title(meta: dict) -> str:
    """The figure title from a run's metadata (``frontier.json``'s ``meta``)."""
    prompts = len(meta["lengths"]) * len(meta["depths"]) * len(meta["tasks"]) * meta["samples"]
    text = (f"{meta['model'].split('/')[-1]}: damage per byte, ours vs peers ({plural(prompts, 'needle prompt')} at "
            f"{','.join(map(str, meta['lengths']))} tokens")
    if meta.get("ppl_length"):
        text += f"; Δppl on {plural(meta['ppl_windows'], str(meta['ppl_length']) + '-token text window')}"
    if meta.get("decode_steps"):
        text += f"; long decode: {meta['decode_steps']} tokens after {meta['decode_prompt_length']}"
    return text + ")"


def _pareto_line(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (x: more compression is better, y: lower is better)."""
    front = []
    for x, y in sorted(points, key=lambda p: (-p[0], p[1])):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return sorted(front)


def _value(row, field: str) -> float:
    if field == "lost" and math.isnan(row.needle_accuracy):
        return float("nan")  # no prompt answered (partial results)
    return float(getattr(row, field))


def _draw_panel(ax, rows, numbers: dict[str, int], label: str, field: str, scale: str) -> None:
    points = []
    for kind, (color, marker) in STYLES.items():
        pts = [(r.x_smaller, _value(r, field), r.scheme) for r in rows if r.kind == kind]
        pts = [(x, max(y, 1e-7) if scale == "log" else y, s) for x, y, s in pts if not math.isnan(y)]
        if not pts:
            continue
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], c=color, marker=marker, s=22, label=kind, zorder=3)
        points += [(x, y, str(numbers[s]), color) for x, y, s in pts]
        if kind == "ours":
            front = _pareto_line([(x, y) for x, y, _ in pts])
            ax.step([p[0] for p in front], [p[1] for p in front], where="post", c=color, alpha=0.5,
                    label="ours: Pareto line")
    if scale == "count":
        count_axis(ax, [int(y) for _, y, _, _ in points])
    elif scale == "symlog":
        ax.set_yscale("symlog", linthresh=PPL_LINEAR)
        ax.axhline(0, color="black", linestyle=":", linewidth=0.8)
    else:
        ax.set_yscale("log")
    ax.set_ylabel(label + "\n(lower is better)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    ax.margins(x=0.06, y=0.08)
    ax.figure.canvas.draw()  # limits and layout final before the labels are placed in screen space
    place_labels(ax, points)


def _number_table(ax, rows, numbers: dict[str, int]) -> None:
    """The numbers with the scheme names and their compression, coloured by kind, in one column."""
    ax.axis("off")
    ordered = sorted(rows, key=lambda r: numbers[r.scheme])
    step = min(0.04, 0.96 / max(len(ordered), 1))
    ax.text(0, 1, "  #  scheme (x smaller)", fontsize=8, fontweight="bold", va="top", family="monospace")
    for k, r in enumerate(ordered, 1):
        ax.text(0, 1 - k * step, f"{numbers[r.scheme]:>3}  {r.scheme} ({r.x_smaller:.2f})", fontsize=8, va="top",
                family="monospace", color=STYLES.get(r.kind, ("black", ""))[0])


def plot_frontier(rows, title: str, path: str | Path) -> Path:
    """Draw the frontier figure (see the module docstring) of :class:`.frontier.FrontierRow` rows into ``path``.

    The reference (``dynamic``) is left out: it is 1.0x with no damage by definition.
    """
    plt = require_matplotlib()
    rows = [r for r in rows if r.kind != "reference"]
    numbers = {r.scheme: n for n, r in enumerate(sorted(rows, key=lambda r: (r.x_smaller, r.scheme)), 1)}
    panels = [p for p in PANELS if any(not math.isnan(_value(r, p[1])) for r in rows)]
    cols = 2 if len(panels) > 1 else 1
    grid = math.ceil(len(panels) / cols)
    fig = plt.figure(figsize=(6.2 * cols + 3.0, 4.6 * grid + 0.6))
    spec = fig.add_gridspec(grid, cols + 1, width_ratios=[6.2] * cols + [3.0], hspace=0.22, wspace=0.28,
                            top=1 - 0.45 / (4.6 * grid + 0.6), bottom=0.6 / (4.6 * grid + 0.6))
    axes = [fig.add_subplot(spec[k // cols, k % cols]) for k in range(len(panels))]
    for ax in axes[1:]:
        ax.sharex(axes[0])
    for ax in axes[-cols:]:
        ax.set_xlabel("x smaller than a bf16 DynamicCache (bytes as stored, higher is better)", fontsize=9)
    fig.suptitle(title, fontsize=10)
    _number_table(fig.add_subplot(spec[:, cols]), rows, numbers)
    for ax, (label, field, scale) in zip(axes, panels):
        _draw_panel(ax, rows, numbers, label, field, scale)
    return save_figure(fig, path)
