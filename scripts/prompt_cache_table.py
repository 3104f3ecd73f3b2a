"""results/prompt_cache/README.md from the JSON files scripts/prompt_cache_runs.sh writes there (one per run).

Usage: python scripts/prompt_cache_table.py [FOLDER]   (default results/prompt_cache)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hf_asymkv.bench.prompt_cache import mlx_bytes_per_element
from hf_asymkv.core.fileio import atomic_write_text

MIB = 2**20
ORDER = ["smollm2-balanced-quiet", "smollm2-tight-quiet", "smollm2-balanced", "smollm2-tight", "smollm2-balanced-fp32",
         "gemma-balanced", "gemma-tight", "gemma-balanced-sliding", "gemma-tight-sliding"]
"""The runs of scripts/prompt_cache_runs.sh, in the order of the tables (others after them, by name)."""


def _model(report: dict) -> str:
    return "Gemma-3-270M" if "gemma" in report["meta"]["model"].lower() else "SmolLM2-135M"


def _row(name: str, r: dict) -> list[str]:
    answers = r["answers"]
    load = sum(a["load_s"] for a in answers) / len(answers)
    first = sum(a["first_token_s"] for a in answers) / len(answers)
    rss = r["load_rss"]
    same = all(a.get("same_as_in_memory") for a in answers)
    return [name, _model(r), r["preset"], r["dtype"], f"{r['tokens']:,}", f"{r['file_bytes'] / MIB:.2f}",
            f"{r['footprint_total'] / MIB:.2f}", f"{r['file_bytes'] / r['footprint_total']:.4f}",
            f"{r['bf16_dynamic_cache_file_bytes'] / MIB:.2f}", f"{r['bf16_dynamic_cache_file_bytes'] / r['file_bytes']:.2f}",
            f"{r['prefill_s']:.1f}", f"{load:.3f}", f"{first:.2f}", f"{r['prefill_s'] / (load + first):.0f}",
            "yes" if same else "NO", f"{rss['load_s']:.3f}", f"{rss['peak_rss_growth_bytes'] / r['file_bytes']:.2f}"]


def _per_token(name: str, r: dict) -> list[str]:
    elements = r["full_attention_elements_per_token"]
    ours = r["full_attention_bytes_per_token"]
    cells = [2 * elements, mlx_bytes_per_element(8) * elements, mlx_bytes_per_element(4) * elements]
    return [name, f"{elements}", f"{ours:,.0f}"] + [f"{c:,.0f} ({c / ours:.2f}x)" for c in cells]


def main(folder: str = "results/prompt_cache") -> int:
    folder = Path(folder)
    found = {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}
    reports = {name: found[name] for name in sorted(found, key=lambda n: (ORDER + [n]).index(n))}
    head = ["run", "model", "preset", "dtype", "tokens", "file MiB", "footprint MiB", "file / footprint",
            "bf16 DynamicCache file MiB", "x smaller", "prefill s", "load s", "first token s",
            "prefill / (load + first)", "same tokens", "fresh load s", "peak RSS / file"]
    lines = ["Command: `OMP_NUM_THREADS=1 nohup scripts/prompt_cache_runs.sh > prompt_cache_runs.log 2>&1 &`, then "
             "`python scripts/prompt_cache_table.py` (this page); each run's `hf-asymkv prompt-cache` command line is in "
             "its JSON file (`meta.command`).", "",
             "One thread. Runs named `-quiet` had the 2-core machine to themselves (2026-12-07 22:04 UTC), as did the "
             "`-sliding` runs (`--quantize-sliding`: the sliding-window layers quantized too; 2 threads, `THREADS=2`, "
             "2026-12-08 00:10 UTC); the others "
             "shared it with other work (load average 6-9), which slowed the bf16 prefills 27-40x: times there are "
             "noisy, the ratio of two times in the same run less so. Load and first-token times are the mean over the run's two questions "
             "(each loads the file afresh, from the page cache: the file was just written). `same tokens`: both answers "
             "from the loaded file equal those from a copy of the cache still in memory. `fresh load`: the file loaded "
             "once more in a new process (`--load-rss`); `peak RSS / file`: that process's peak resident growth during "
             "the load over the file's size.", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_row(name, r)) + " |" for name, r in reports.items()]
    lines += ["", "Full-attention layers of the bf16 runs, bytes per token (all layers summed; sliding-window layers "
              "are kept exact by mlx-lm, whose `RotatingKVCache` has no quantized form, and by us unless "
              "`--quantize-sliding`; these columns count the full-attention layers alone): ours measured; "
              "bf16 and mlx-lm's `QuantizedKVCache` (group 64, a bf16 scale and bias per group) computed, with how "
              "many times ours they are.", "",
              "| run | elements / token | ours B | bf16 B | mlx-lm 8-bit B | mlx-lm 4-bit B |", "|---|---:|---:|---:|---:|---:|"]
    lines += ["| " + " | ".join(_per_token(name, r)) + " |" for name, r in reports.items() if r["dtype"] == "bfloat16"]
    lines += ["", "Answers (greedy, 24 tokens at most):", ""]
    for name, r in reports.items():
        for a in r["answers"]:
            lines.append(f"- {name}: *{a['question']}* {a['answer'].strip()!r}")
    atomic_write_text(folder / "README.md", "\n".join(lines) + "\n")
    print(folder / "README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
