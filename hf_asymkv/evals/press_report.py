"""The table of ``hf-asymkv eval press``: one row per configuration, from the runs of :mod:`.press_eval`."""

from __future__ import annotations

import math
from collections import defaultdict

from .report import plural

__all__ = ["press_markdown", "press_summary"]


def _flips(mine: list, reference: list) -> tuple[int, int]:
    """``(lost, gained)``: prompts ``reference`` answers right and ``mine`` wrong, and the other way round."""
    lost = sum(r.correct and not m.correct for m, r in zip(mine, reference))
    gained = sum(m.correct and not r.correct for m, r in zip(mine, reference))
    return lost, gained


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def press_summary(runs: list) -> list[dict]:
    """Per configuration: real bytes held, and ``x_smaller`` (bf16 ``DynamicCache`` of the whole context / bytes
    held on a bf16 model, summed over prompts) overall and per length, the share of those bytes held exact (our
    sinks and window: why a press x preset falls short of the press's and the preset's ratios multiplied), kept
    fraction, needle accuracy, lost/gained against full precision and against the press alone, tail KL against
    both."""
    by_run: dict[str, list] = defaultdict(list)
    for r in runs:
        by_run[r.run].append(r)
    full = by_run["full"]
    rows = []
    # full precision, the presets, then each press followed by its compositions
    order = sorted(by_run, key=lambda name: (bool(by_run[name][0].press), by_run[name][0].press,
                                             bool(by_run[name][0].preset)))
    for name in order:
        mine = by_run[name]
        first = mine[0]
        alone = by_run.get(first.press) if first.press and first.preset else None
        per_length = defaultdict(lambda: [0, 0])
        for r in mine:
            per_length[r.length][0] += r.bf16_full_bytes
            per_length[r.length][1] += r.bf16_nbytes
        rows.append({
            "run": name, "press": first.press, "preset": first.preset, "prompts": len(mine),
            "nbytes": sum(r.nbytes for r in mine), "bf16_nbytes": sum(r.bf16_nbytes for r in mine),
            "x_smaller": sum(r.bf16_full_bytes for r in mine) / sum(r.bf16_nbytes for r in mine),
            "x_smaller_by_length": {str(n): f / b for n, (f, b) in sorted(per_length.items())},
            "exact_share": sum(r.exact_bf16_nbytes for r in mine) / sum(r.bf16_nbytes for r in mine),
            "kept_fraction": _mean([r.kept_tokens / r.context_tokens for r in mine]),
            "accuracy": _mean([float(r.correct) for r in mine]),
            "lost_gained_vs_full": _flips(mine, full),
            "lost_gained_vs_press": _flips(mine, alone) if alone else None,
            "tail_kl": _mean([r.tail_kl for r in mine]),
            "tail_kl_vs_press": _mean([r.tail_kl_vs_press for r in mine]),
        })
    return rows


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3g}"


def press_markdown(rows: list[dict], prompts: int, ratio: float) -> str:
    """The markdown table of :func:`press_summary` rows."""
    lengths = list(rows[0]["x_smaller_by_length"]) if rows else []
    header = ("| run | kept | MB held (model dtype) | exact share | x smaller than bf16 | "
              + "".join(f"x at {n} | " for n in lengths)
              + "needle acc | lost / gained vs full | lost / gained vs press alone | tail KL vs full | "
              "tail KL vs press alone |")
    lines = [header, "|---|" + "---:|" * (9 + len(lengths))]
    for r in rows:
        vs_press = "{} / {}".format(*r["lost_gained_vs_press"]) if r["lost_gained_vs_press"] else "-"
        by_length = "".join(f"{x:.2f} | " for x in r["x_smaller_by_length"].values())
        mb = r["nbytes"] / r["prompts"] / 2**20
        lines.append(f"| {r['run']} | {100 * r['kept_fraction']:.0f}% | {mb:.1f} | {100 * r['exact_share']:.0f}% | "
                     f"{r['x_smaller']:.2f} | {by_length}"
                     f"{100 * r['accuracy']:.0f}% | {r['lost_gained_vs_full'][0]} / {r['lost_gained_vs_full'][1]} | "
                     f"{vs_press} | {_fmt(r['tail_kl'])} | {_fmt(r['tail_kl_vs_press'])} |")
    return (f"Presses x presets: bytes held after the context and damage ({plural(prompts, 'needle prompt')}, "
            f"compression ratio {ratio:g}). MB held: real tensors, mean per prompt. x smaller: a bf16 DynamicCache "
            "of the whole context over the same tensors on a bf16 model (exact parts at 2 bytes per element). "
            "Exact share: the part of those bytes held exact (a DynamicCache: all; a preset: its sinks and window)."
            "\n\n" + "\n".join(lines))
