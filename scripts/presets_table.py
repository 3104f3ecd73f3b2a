"""Measure the presets, the ablations behind them and transformers' caches on the same prompts.

Writes ``<out>/<model>.json`` (every row and every needle answer) and ``<out>/<model>.md`` (the tables the
README quotes). See :mod:`hf_asymkv.evals.presets_table` for what each column means.

Usage:
    python scripts/presets_table.py                                   # SmolLM2-135M-Instruct, 4k, with ablations
    python scripts/presets_table.py --model /path/to/gemma-3-270m-q4_k_m.gguf --name gemma3-270m
    python scripts/presets_table.py --no-ablations --depths 0.5 --tasks single   # a quick look
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

# ----------------------------------------------------------------------------- defaults
MODEL = "smollm2-135m-instruct"  # hf_asymkv.models.DEFAULT_MODEL, an HF folder/id, or a .gguf path
LENGTH = 4096  # prefill (bytes) and needle prompt length (tokens)
DEPTHS = "0.1,0.5,0.9"  # needle depths
TASKS = "single,multikey"  # needle tasks (hf_asymkv.evals.needle.TASKS)
SAMPLES = 1  # prompts per (depth, task)
OUT = "results/presets"  # output folder
THREADS = 2  # torch CPU threads


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL, help="default model, HF folder/id or .gguf path (default: %(default)s)")
    p.add_argument("--name", default="smollm2", help="result file stem (default: %(default)s)")
    p.add_argument("--length", type=int, default=LENGTH, help="tokens (default: %(default)s)")
    p.add_argument("--depths", default=DEPTHS, help="comma-separated needle depths in [0, 1] (default: %(default)s)")
    p.add_argument("--tasks", default=TASKS, help="comma-separated needle tasks (default: %(default)s)")
    p.add_argument("--samples", type=int, default=SAMPLES, help="prompts per depth and task (default: %(default)s)")
    p.add_argument("--no-ablations", action="store_true", help="presets and baselines only")
    p.add_argument("--schemes", default=None, help="comma-separated subset of the schemes (default: all)")
    p.add_argument("--out", default=OUT, help="output folder (default: %(default)s)")
    p.add_argument("--threads", type=int, default=THREADS, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from hf_asymkv.evals import presets_table as pt
    from hf_asymkv.evals.common import run_meta
    from hf_asymkv.models import load_model

    torch.set_num_threads(args.threads)
    schemes = pt.BASELINES + pt.preset_schemes() + ([] if args.no_ablations else pt.ablation_schemes())
    if args.schemes:
        unknown = sorted(set(args.schemes.split(",")) - set(schemes))
        if unknown:
            raise SystemExit(f"unknown scheme(s) {unknown}; known: {schemes}")
        schemes = ["dynamic"] + [s for s in schemes if s in args.schemes.split(",") and s != "dynamic"]
    model, tokenizer = load_model(args.model)
    ratios = pt.measure_bytes(model, schemes, args.length)
    ratios_d128 = pt.measure_bytes(pt.tiny_head_dim_128(), schemes, args.length)
    depths = [float(d) for d in args.depths.split(",")]
    tasks = args.tasks.split(",")
    damage, needle_rows = pt.measure_damage(model, tokenizer, schemes, args.length, depths, tasks, args.samples,
                                            show_progress=not args.quiet)
    rows = pt.build_rows(schemes, ratios, ratios_d128, damage)
    command = "python scripts/presets_table.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    meta = run_meta(model, args.model, command.strip(), length=args.length, depths=depths, tasks=tasks,
                    samples=args.samples)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pt.save(rows, needle_rows, meta, out / f"{args.name}.json", out / f"{args.name}.md", args.length)
    print(pt.format_tables(rows, args.length))
    return 0


if __name__ == "__main__":
    sys.exit(main())
