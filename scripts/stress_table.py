"""Which layers the outlier stress model breaks, per scheme: attention KL of the same model without and with outliers.

Reads two ``attention.json`` files written by ``hf-asymkv eval attention`` with the same schemes and prompts, one on
the plain model and one with ``--stress-outliers``, and writes a markdown table: mean KL on each, their ratio, the
KL of the first and last layers (where the ``qwen`` pattern puts its largest outliers) on each, and the worst layer
under stress.

Usage:
    python scripts/stress_table.py                 # results/stress/smollm2_{base,qwen} -> results/stress/attention_layers.md
    python scripts/stress_table.py --base A/attention.json --stress B/attention.json --out table.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# ----------------------------------------------------------------------------- defaults
BASE = "results/stress/smollm2_base/attention.json"  # the plain model's per-layer attention KL
STRESS = "results/stress/smollm2_qwen/attention.json"  # the same run with --stress-outliers
OUT = "results/stress/attention_layers.md"  # the table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=BASE, help="attention.json of the plain model (default: %(default)s)")
    p.add_argument("--stress", default=STRESS, help="attention.json of the stress model (default: %(default)s)")
    p.add_argument("--out", default=OUT, help="markdown file to write (default: %(default)s)")
    return p.parse_args(argv)


def _rows(path: str) -> tuple[dict, dict[str, list[float]]]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return data["meta"], {r["scheme"]: r["kl"] for r in data["rows"]}


def stress_table(base: dict[str, list[float]], stress: dict[str, list[float]]) -> str:
    """One row per scheme of both runs (the reference left out), by KL under stress."""
    last = len(next(iter(stress.values()))) - 1
    lines = [f"| scheme | KL mean, plain | KL mean, stress | stress / plain | L0 plain -> stress | L{last} plain -> "
             "stress | worst layer under stress |", "|---|---:|---:|---:|---:|---:|---:|"]
    schemes = [s for s in stress if s in base and s != "dynamic"]
    for s in sorted(schemes, key=lambda s: sum(stress[s])):
        mean_b, mean_s = sum(base[s]) / len(base[s]), sum(stress[s]) / len(stress[s])
        worst = max(range(len(stress[s])), key=lambda i: stress[s][i])
        lines.append(f"| {s} | {mean_b:.2e} | {mean_s:.2e} | {mean_s / mean_b:.2f} | {base[s][0]:.1e} -> "
                     f"{stress[s][0]:.1e} | {base[s][last]:.1e} -> {stress[s][last]:.1e} | L{worst} "
                     f"({stress[s][worst]:.1e}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    (base_meta, base), (stress_meta, stress) = _rows(args.base), _rows(args.stress)
    spec = (stress_meta.get("stress_outliers") or {}).get("spec")
    if not spec:
        print(f"error: {args.stress} was not measured with --stress-outliers", file=sys.stderr)
        return 2
    text = (f"Attention KL per scheme, plain model vs the outlier STRESS CASE `--stress-outliers {spec}`\n\n"
            f"- plain: `{base_meta['command']}`\n- stress: `{stress_meta['command']}`\n- table: "
            f"`python scripts/stress_table.py --base {args.base} --stress {args.stress} --out {args.out}`\n\n"
            + stress_table(base, stress) + "\n")
    Path(args.out).write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
