"""Figures of ``scripts/gpu_check.py`` beside their physical ceilings, the issue's goals, and the written report.

A decode step must read the weights once and every stored K/V byte once, so ``(weight bytes + KV bytes) /
bandwidth`` is the fastest it can be; the attention alone must read its K/V bytes. Every time is printed beside
that ceiling, with the fraction of the card's bandwidth it achieves.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..core.fileio import atomic_write_text

__all__ = ["attention_table", "decode_table", "fit_rows", "goal_rows", "markdown_report", "with_ceilings",
           "write_report"]


def with_ceilings(rows: list[dict], weight_bytes: int, bandwidth: float) -> list[dict]:
    """Decode rows (``DecodeRow.as_dict()``) with bytes per step, ceiling, achieved bandwidth and the ratio of
    tokens/s to ``dynamic`` at the same batch and context (and that ratio's ceiling). ``bandwidth`` in bytes/s."""
    base = {(r["batch"], r["context"]): r for r in rows if r["scheme"] == "dynamic" and r["status"] == "ok"}
    out = []
    for r in rows:
        r = dict(r)
        if r["status"] == "ok":
            step_bytes = weight_bytes + r["kv_bytes"]
            r.update(tokens_per_s=r["batch"] * 1e3 / r["decode_ms"], bytes_per_step=step_bytes,
                     ceiling_ms=step_bytes / bandwidth * 1e3, achieved_tbps=step_bytes / r["decode_ms"] / 1e9)
            r["bandwidth_fraction"] = r["ceiling_ms"] / r["decode_ms"]
            ref = base.get((r["batch"], r["context"]))
            if ref is not None:
                r["x_dynamic"] = ref["decode_ms"] / r["decode_ms"]
                r["ceiling_x_dynamic"] = (weight_bytes + ref["kv_bytes"]) / step_bytes
        out.append(r)
    return out


def attention_table(rows: list[dict], bandwidth: float) -> list[dict]:
    """Attention rows with the time used (CUDA-graph replay when measured, else the eager loop), its ceiling,
    bandwidth fraction and the speed-up over ``sdpa-bf16`` (and that speed-up's ceiling, the bytes ratio)."""
    sdpas = {(r["batch"], r["context"]): r for r in rows if r["impl"] == "sdpa-bf16" and "status" not in r}
    out = []
    for r in rows:
        r = dict(r)
        if "status" in r:  # failed: nothing to derive
            out.append(r)
            continue
        r["us"] = r["graph_us"] if r.get("graph_us") is not None else r["eager_us"]
        r["ceiling_us"] = r["bytes"] / bandwidth * 1e6
        r["bandwidth_fraction"] = r["ceiling_us"] / r["us"]
        sdpa = sdpas.get((r["batch"], r["context"]))  # the SDPA row of the same batch and context
        if sdpa is not None:
            sdpa_us = sdpa["graph_us"] if sdpa.get("graph_us") is not None else sdpa["eager_us"]
            r["x_sdpa"], r["ceiling_x_sdpa"] = sdpa_us / r["us"], sdpa["bytes"] / r["bytes"]
        out.append(r)
    return out


def fit_rows(rows: list[dict], layers: int, full_layers: int, budget_bytes: float) -> list[dict]:
    """Longest batch-1 context each scheme's KV cache fits into ``budget_bytes`` for a ``full_layers``-layer model,
    from the bytes per token and layer measured at the largest batch-1 context (capacity and exact tokens
    included)."""
    out = []
    for r in rows:
        if r["status"] != "ok" or r["batch"] != 1:
            continue
        if any(o["scheme"] == r["scheme"] and o["measured_at"] >= r["context"] for o in out):
            continue
        out = [o for o in out if o["scheme"] != r["scheme"]]
        per_token = r["kv_bytes"] / (r["context"] * layers)
        out.append({"scheme": r["scheme"], "measured_at": r["context"], "bytes_per_token_layer": per_token,
                    "max_context": int(budget_bytes / (per_token * full_layers))})
    return out


def _find(rows: list[dict], **match) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items()) and r.get("status", "ok") == "ok"),
                None)


def goal_rows(decode: list[dict], attention: list[dict], long_context: int, long_batch: tuple[int, int]) -> list[dict]:
    """The issue's goals, each with the measured value (None when not measured) and whether it is met."""
    goals = []

    def add(text: str, value: float | None, target: float) -> None:
        goals.append({"goal": text, "value": value, "target": target, "met": None if value is None else value >= target})

    for preset, speedup in (("balanced", 1.8), ("compact", 2.5)):
        row = _find(attention, impl=f"triton-{preset}")
        add(f"attention alone, {preset}: fraction of bandwidth", row and row["bandwidth_fraction"], 0.6)
        add(f"attention alone, {preset}: x SDPA over bf16 K/V", row and row.get("x_sdpa"), speedup)
    for batch, context in (long_batch, (1, long_context)):
        for preset, speedup in (("balanced", 1.3), ("compact", 1.6)):
            row = _find(decode, scheme=f"{preset}-triton", batch=batch, context=context)
            add(f"decode batch {batch} at {context}, {preset}: x DynamicCache tokens/s", row and row.get("x_dynamic"),
                speedup)
    short = min((r["context"] for r in decode if r["batch"] == 1), default=None)
    row = _find(decode, scheme="balanced-triton", batch=1, context=short)
    add(f"decode batch 1 at {short}, balanced: x DynamicCache tokens/s", row and row.get("x_dynamic"), 0.95)
    for r in decode:
        quanto = _find(decode, scheme="hf-quanto-int4", batch=r["batch"], context=r["context"])
        if r["scheme"].endswith("-triton") and r["status"] == "ok" and quanto is not None:
            add(f"decode batch {r['batch']} at {r['context']}, {r['scheme']}: x QuantizedCache quanto int4",
                quanto["decode_ms"] / r["decode_ms"], 3.0)
    return goals


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def decode_table(rows: list[dict]) -> str:
    lines = ["| scheme | batch | context | decode ms/step | ceiling ms | x ceiling | tokens/s | x DynamicCache "
             "(ceiling) | TB/s | KV GiB | peak GiB | prefill ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
             "---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['scheme']} | {r['batch']} | {r['context']} | {r['status']} |||||||||")
            continue
        lines.append(f"| {r['scheme']} | {r['batch']} | {r['context']} | {r['decode_ms']:.2f} | {r['ceiling_ms']:.2f} | "
                     f"{r['bandwidth_fraction']:.2f} | {r['tokens_per_s']:.1f} | {_fmt(r.get('x_dynamic'))} "
                     f"({_fmt(r.get('ceiling_x_dynamic'))}) | {r['achieved_tbps']:.2f} | {r['kv_bytes'] / 2**30:.3f} | "
                     f"{r['peak_gib']:.1f} | {r['prefill_ms']:.0f} |")
    return "\n".join(lines)


def markdown_report(meta: dict, update_cost: list[dict], checks: list[dict], attention: list[dict],
                    decode: list[dict], fit: list[dict], goals: list[dict]) -> str:
    """The whole report as markdown: setup, update cost, kernel check, attention alone, decode, fit, goals."""
    dry = " (dry run: CPU, Triton interpreter, tiny shapes: no time means anything)" if meta["dry_run"] else ""
    if meta.get("complete") is False:
        dry += " (partial: the rows measured before the run stopped)"
    out = [f"# GPU check{dry}", "", "```", json.dumps(meta, indent=1), "```", "",
           "## Cache update, one layer and one token (device-independent counts)", "",
           "| preset | step | torch ops (launches) | host syncs |", "|---|---|---:|---:|"]
    out += [f"| {u['preset']} | {u['step']} | {u['launches']} | {u['syncs']} |" for u in update_cost]
    out += ["", "## Kernel vs torch fused attention (same codes)", "", "| preset | dtype | q | SQNR dB |",
            "|---|---|---:|---:|"]
    out += [f"| {c['preset']} | {c['dtype']} | {c['q_len']} | {c.get('status') or _fmt(c['sqnr_db'], '.1f')} |"
            for c in checks]
    out += ["", "## Attention alone (one layer, one query token)", "",
            "| impl | batch | context | us (graph) | us (eager) | ceiling us | x ceiling | x SDPA (ceiling) | MiB read |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {r['impl']} | {r['batch']} | {r['context']} | {r['status']} ||||||" if "status" in r else
            f"| {r['impl']} | {r['batch']} | {r['context']} | {_fmt(r.get('graph_us'), '.1f')} | {r['eager_us']:.1f} | "
            f"{r['ceiling_us']:.1f} | {r['bandwidth_fraction']:.2f} | {_fmt(r.get('x_sdpa'))} "
            f"({_fmt(r.get('ceiling_x_sdpa'))}) | {r['bytes'] / 2**20:.1f} |" for r in attention]
    out += ["", "## Whole-model decode", "", decode_table(decode), "", "## Longest context in the memory budget", "",
            "| scheme | KV bytes/token/layer | max context |", "|---|---:|---:|"]
    out += [f"| {f['scheme']} | {f['bytes_per_token_layer']:.0f} | {f['max_context']} |" for f in fit]
    out += ["", "## Goals (issue 19)", "", "| goal | value | target | met |", "|---|---:|---:|---|"]
    out += [f"| {g['goal']} | {_fmt(g['value'])} | {g['target']} | {'-' if g['met'] is None else g['met']} |"
            for g in goals]
    return "\n".join(out) + "\n"


def write_report(out_dir: Path, report: dict, markdown: str) -> tuple[Path, Path]:
    """``gpu_check.json`` and ``gpu_check.md`` in ``out_dir`` (written atomically)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = atomic_write_text(out_dir / "gpu_check.json", json.dumps(report, indent=1) + "\n")
    return json_path, atomic_write_text(out_dir / "gpu_check.md", markdown)
