"""Markdown tables of the evaluations and the combined table that puts retrieval beside perplexity."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..core.fileio import atomic_write_text

__all__ = [
    "attention_markdown",
    "flips",
    "needle_markdown",
    "plural",
    "ppl_markdown",
    "read_results",
    "summary_markdown",
    "write_json",
]


def plural(n: int, noun: str) -> str:
    """``"1 needle prompt"``, ``"6 needle prompts"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.0f}%"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def flips(rows: list[dict]) -> dict[str, tuple[int, int]]:
    """``{scheme: (lost, gained)}``: prompts full precision (``dynamic``) answers and the scheme does not, and
    the reverse. Accuracy alone hides a scheme that loses some prompts and wins others by luck."""
    ref = {(r["task"], r["haystack"], r["length"], r["depth"], r["sample"]): r["correct"] for r in rows
           if r["scheme"] == "dynamic"}
    out: dict[str, list[int]] = {}
    for r in rows:
        full = ref[(r["task"], r["haystack"], r["length"], r["depth"], r["sample"])]
        counts = out.setdefault(r["scheme"], [0, 0])
        counts[0] += full and not r["correct"]
        counts[1] += r["correct"] and not full
    return {s: (lost, gained) for s, (lost, gained) in out.items()}


def needle_markdown(by_length: dict[str, dict], by_task: dict[str, dict], lengths: list[int], tasks: list[str],
                    agreement: dict[str, float], flipped: dict[str, tuple[int, int]], skipped: dict[str, str]) -> str:
    """Accuracy per scheme: by length, by task, overall, prompts lost/gained against full precision, and how
    often the answer's tokens equal full precision's."""
    header = ["scheme", *[str(n) for n in lengths], *tasks, "all", "lost / gained vs full", "same tokens as full"]
    rows = [[s, *[_pct(by_length[s].get(n, float("nan"))) for n in lengths],
             *[_pct(by_task[s].get(t, float("nan"))) for t in tasks], _pct(by_length[s]["all"]),
             f"{flipped[s][0]} / {flipped[s][1]}", _pct(agreement[s])] for s in by_length]
    text = "Needle accuracy (all expected values, no distractor value)\n\n" + _table(header, rows)
    return text + _skipped(skipped)


def _skipped(skipped: dict[str, str]) -> str:
    if not skipped:
        return ""
    return "\n\nNot run on this model: " + "; ".join(f"`{s}` ({why})" for s, why in skipped.items())


def attention_markdown(rows, induction: list[float] | None, skipped: dict[str, str]) -> str:
    """Per scheme: mean and worst-layer KL, mean and worst-layer top-8/top-32 overlap."""
    header = ["scheme", "KL mean (nats)", "KL worst layer", "top-8 mean", "top-8 worst layer", "top-32 mean",
              "top-32 worst layer"]
    table = []
    for r in rows:
        worst = max(range(len(r.kl)), key=lambda i: r.kl[i])
        cells = [r.scheme, f"{r.kl_mean:.2e}", f"{r.kl[worst]:.2e} (L{worst})"]
        for k in ("8", "32"):
            values = r.topk[k]
            low = min(range(len(values)), key=lambda i: values[i])
            cells += [f"{sum(values) / len(values):.3f}", f"{values[low]:.3f} (L{low})"]
        table.append(cells)
    text = "Attention of the last queries vs full precision, per layer\n\n" + _table(header, table)
    if induction:
        top = sorted(range(len(induction)), key=lambda i: -induction[i])[:3]
        text += "\n\nStrongest induction layers: " + ", ".join(f"L{i} ({induction[i]:.2f})" for i in top)
    return text + _skipped(skipped)


def ppl_markdown(rows, skipped: dict[str, str]) -> str:
    """Perplexity, its change against full precision and the next-token top-1 agreement, per scheme."""
    header = ["scheme", "ppl", "Δppl", "Δppl %", "top-1 agrees with full", "tokens scored"]
    table = [[r.scheme, f"{r.ppl:.3f}", f"{r.delta_ppl:+.3f}", f"{r.delta_pct:+.2f}%", f"{100 * r.top1_agree:.1f}%",
              str(r.tokens)] for r in rows]
    return "Perplexity through each scheme's quantized history\n\n" + _table(header, table) + _skipped(skipped)


def summary_markdown(needle: dict | None, attention: dict | None, ppl: dict | None) -> str:
    """One row per scheme: needle accuracy (overall and at the longest length), attention KL / top-8, Δppl."""
    schemes: list[str] = []
    for part in (needle, attention, ppl):
        for s in (part or {}).get("schemes", []):
            if s not in schemes:
                schemes.append(s)
    header, longest = ["scheme"], None
    if needle:
        longest = max(needle["lengths"])
        flipped = flips(needle["rows"])
        header += ["needle acc (all)", f"needle acc @ {longest}", "needle lost / gained vs full"]
    if attention:
        header += ["attn KL mean", "attn top-8"]
    if ppl:
        header += ["ppl", "Δppl %"]
    table = []
    for s in schemes:
        cells = [s]
        if needle:
            acc = needle["accuracy_by_length"].get(s, {})
            lost, gained = flipped.get(s, ("-", "-"))
            cells += [_pct(acc.get("all", float("nan"))), _pct(acc.get(str(longest), float("nan"))),
                      f"{lost} / {gained}"]
        if attention:
            row = next((r for r in attention["rows"] if r["scheme"] == s), None)
            cells += ["-", "-"] if row is None else [f"{sum(row['kl']) / len(row['kl']):.2e}",
                                                     f"{sum(row['topk']['8']) / len(row['topk']['8']):.3f}"]
        if ppl:
            row = next((r for r in ppl["rows"] if r["scheme"] == s), None)
            cells += ["-", "-"] if row is None else [f"{row['ppl']:.3f}", f"{row['delta_pct']:+.2f}%"]
        table.append(cells)
    return _table(header, table)


def write_json(path: Path, payload: dict) -> Path:
    return atomic_write_text(path, json.dumps(payload, indent=1) + "\n")


def read_results(folder: str | Path) -> tuple[dict | None, dict | None, dict | None]:
    """``(needle, attention, ppl)`` JSON payloads of an ``--out`` folder, None for those not there.

    Raises:
        ValueError: the folder holds none of them.
    """
    folder = Path(folder).expanduser()
    found = []
    for name in ("needle.json", "attention.json", "ppl.json"):
        path = folder / name
        found.append(json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None)
    if not any(found):
        raise ValueError(f"{str(folder)!r} holds no needle.json, attention.json, ppl.json or frontier.json")
    return found[0], found[1], found[2]
