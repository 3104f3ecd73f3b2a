"""What a request of `hf-asymkv eval lm-eval` cost, from the ``cost`` its responses.jsonl rows carry (docs/long_context.md).

Each row's cost covers everything answered for it in that invocation: the shared full-precision prefill and every
(scheme, form) asked; rows without a cost (answered before costs were recorded) and rows that answered only some
schemes (a run extended with new schemes) are left out of the figures, not guessed.

    python scripts/long_context_costs.py results/long_context/*/responses.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def summary(path: Path) -> dict:
    """Per task: requests, how many carry a full cost, median prompt tokens and median/max CPU and wall seconds."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()[1:] if line.strip()]
    variants = max((len(r["answers"]) for r in rows), default=0)
    out: dict[str, dict] = {}
    for task in sorted({r.get("task", "?") for r in rows}):
        mine = [r for r in rows if r.get("task", "?") == task]
        costed = [r["cost"] for r in mine if "cost" in r and len(r["answers"]) == variants]
        entry = {"requests": len(mine), "costed": len(costed), "answers_per_request": variants}
        if costed:
            for key in ("prompt_tokens", "cpu_seconds", "seconds"):
                values = [c[key] for c in costed if c.get(key) is not None]
                entry[f"median_{key}"] = statistics.median(values) if values else None
            entry["max_cpu_seconds"] = max(c["cpu_seconds"] for c in costed)
        out[task] = entry
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path, help="responses.jsonl files")
    for path in p.parse_args().files:
        for task, entry in summary(path).items():
            print(f"{path.parent.name} {task}: {json.dumps(entry)}")


if __name__ == "__main__":
    main()
