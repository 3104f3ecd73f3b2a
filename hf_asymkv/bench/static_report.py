"""The compiled static path as ``generate`` runs it, against its baselines (``scripts/gpu_check.py --parts static``,
issue 38): per batch and context, each scheme's time per decode step, launches per step and its ratio to its
baseline, with the issue's targets.

Baselines: a compiled scheme against transformers' compiled ``StaticCache`` (``hf-static-compiled``), an eager one
against ``DynamicCache`` with flash SDPA (``dynamic-flash``). A ratio is time over the baseline's time: below 1 is
faster.
"""

from __future__ import annotations

__all__ = ["STATIC_SCHEMES", "TARGETS", "static_markdown", "static_rows"]

STATIC_SCHEMES = ["dynamic-flash", "balanced-triton", "compact-triton", "hf-static-compiled",
                  "balanced-static-fused-compiled", "compact-static-fused-compiled"]
"""What the part times by default: the eager paths, then the compiled ones (CUDA graphs)."""
TARGETS = {("balanced-static-fused-compiled", 32768): 0.8, ("balanced-static-fused-compiled", 131072): 0.6,
           ("compact-static-fused-compiled", 32768): 0.7, ("compact-static-fused-compiled", 131072): 0.5,
           ("balanced-triton", None): 1.0}
"""Issue 38's targets: the ratio at most this, at that context (None: every context)."""


def _baseline(row: dict, compiled: set[str]) -> str | None:
    if row["scheme"] in ("hf-static-compiled", "dynamic-flash"):
        return None
    return "hf-static-compiled" if row["scheme"] in compiled else "dynamic-flash"


def static_rows(rows: list[dict], compiled: set[str]) -> list[dict]:
    """Decode rows (``DecodeRow.as_dict()``) with ``baseline``, ``ratio`` (time over the baseline's at the same batch
    and context, None when either did not run), ``target`` and ``met``. ``compiled``: the compiled schemes' names."""
    ok = {(r["scheme"], r["batch"], r["context"]): r for r in rows if r["status"] == "ok"}
    out = []
    for r in rows:
        r = dict(r, baseline=_baseline(r, compiled), ratio=None)
        base = ok.get((r["baseline"], r["batch"], r["context"]))
        if r["status"] == "ok" and base is not None:
            r["ratio"] = r["decode_ms"] / base["decode_ms"]
        r["target"] = TARGETS.get((r["scheme"], r["context"]), TARGETS.get((r["scheme"], None)))
        r["met"] = None if r["ratio"] is None or r["target"] is None else r["ratio"] <= r["target"]
        out.append(r)
    return out


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def static_markdown(rows: list[dict]) -> str:
    """The part's table (rows from :func:`static_rows`)."""
    lines = ["## Compiled static path as generate runs it (issue 38)", "",
             "Ratio: ms per step over the baseline's (compiled: transformers' compiled StaticCache; eager: "
             "DynamicCache + flash SDPA). Launches: host launch calls per step (a CUDA graph's replay is one); "
             "kernels: device kernels per step; ours: the Triton decode kernel's.", "",
             "| scheme | batch | context | ms/step | launches | kernels | ours | baseline | ratio | target | met | "
             "KV GiB | peak GiB |", "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['scheme']} | {r['batch']} | {r['context']} | {r['status']} |||||||||")
            continue
        lines.append(f"| {r['scheme']} | {r['batch']} | {r['context']} | {r['decode_ms']:.2f} | "
                     f"{_fmt(r['launches_per_step'], '.0f')} | {_fmt(r['kernels_per_step'], '.0f')} | "
                     f"{_fmt(r['attention_kernels_per_step'], '.0f')} | {r['baseline'] or '-'} | {_fmt(r['ratio'])} | "
                     f"{_fmt(r['target'])} | {'-' if r['met'] is None else r['met']} | {r['kv_bytes'] / 2**30:.3f} | "
                     f"{r['peak_gib']:.1f} |")
    return "\n".join(lines) + "\n"
