"""`hf-asymkv eval press`: kvpress presses alone, our presets alone and both, on the same needle prompts.

kvpress is optional: the parser and ``--help`` never import it (nor torch); the command checks it is installed
before the model loads and names the install command when it is not (:mod:`hf_asymkv.evals.presses`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

from ..core.registry import PRESET_NAMES
from ..evals.needle import TASKS
from ..evals.presses import PRESSES
from .args import (
    add_model_args,
    add_threads_arg,
    at_least,
    command_line,
    fraction_list,
    int_list,
    load_model_from_args,
    name_list,
    output_folder,
    set_threads,
)

__all__ = ["add_parser"]


def compression_ratio(text: str) -> float:
    """argparse ``type=``: a fraction of tokens to drop, in ``[0, 1)``."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1) (the fraction of tokens a press drops), got "
                                         f"{text!r}")
    return value


def _cmd_press(args) -> int:
    from ..evals.common import Heartbeat, check_length, run_meta
    from ..evals.presses import require_kvpress
    from ..models import load_config

    require_kvpress()  # before the model loads
    config = load_config(args.model)
    for length in args.lengths:
        check_length(config, length)
    set_threads(args.threads)
    model, tokenizer = load_model_from_args(args)
    from ..evals.press_eval import run_press_grid

    start = time.perf_counter()
    prompts = len(args.lengths) * len(args.depths) * len(args.tasks) * args.samples
    settings = {"presses": args.presses, "presets": args.presets, "compression_ratio": args.compression_ratio,
                "lengths": args.lengths, "depths": args.depths, "tasks": args.tasks, "samples": args.samples,
                "seed": args.seed, "haystack": "noise", "window": args.window}

    def write(runs) -> str:
        return _write(args, run_meta(model, args.model, command_line(args), seconds=round(time.perf_counter() - start,
                                                                                          1), **settings),
                      runs, prompts)

    runs = run_press_grid(model, tokenizer, args.presses, args.presets, args.compression_ratio, args.lengths,
                          args.depths, args.tasks, args.samples, args.seed, on_prompt=write if args.out else None,
                          tick=None if args.quiet else Heartbeat("eval press"), window=args.window)
    print(write(runs))
    return 0


def _write(args, meta: dict, runs: list, prompts: int) -> str:
    """The table; with ``--out``, ``press.json`` and ``press.md`` (atomically; rewritten after every prompt)."""
    from ..core.fileio import atomic_write_text
    from ..evals.press_report import press_markdown, press_summary
    from ..evals.report import write_json

    rows = press_summary(runs)
    answered = len({(r.length, r.depth, r.task, r.sample) for r in runs})
    table = press_markdown(rows, answered, args.compression_ratio)
    if answered < prompts:
        table = f"**Partial results**: {answered} of {prompts} prompts measured so far.\n\n" + table
    if args.out:
        out = Path(args.out)
        write_json(out / "press.json", {"meta": meta, "summary": rows, "runs": [asdict(r) for r in runs]})
        atomic_write_text(out / "press.md", f"Command: `{meta['command']}`\n\n{table}\n")
    return table


def add_parser(evals) -> None:
    """``eval press`` under the ``eval`` subcommands ``evals``."""
    e = evals.add_parser("press", help="kvpress presses alone, our presets alone and both: bytes and needle damage "
                                       "on the same prompts (needs kvpress)")
    add_model_args(e)
    e.add_argument("--presses", type=name_list(PRESSES, "press"), default="ExpectedAttentionPress,KnormPress,"
                   "StreamingLLMPress", help=f"comma-separated kvpress presses, from: {', '.join(PRESSES)}")
    e.add_argument("--compression-ratio", type=compression_ratio, default=0.5,
                   help="fraction of the context's tokens each press drops, in [0, 1) (default 0.5)")
    e.add_argument("--presets", type=name_list(PRESET_NAMES, "preset"), default="compact",
                   help=f"comma-separated presets, alone and under each press, from: {', '.join(PRESET_NAMES)}")
    e.add_argument("--window", type=at_least(0), default=None,
                   help="every preset's exact window (residual_length) instead of its own: the same bytes per quantized "
                        "token, another number of tokens held exact (runs are named e.g. 'compact, window 96')")
    e.add_argument("--lengths", type=int_list, default="2048,4096", help="needle token budgets (default 2048,4096)")
    e.add_argument("--depths", type=fraction_list, default="0.2,0.5,0.8", help="needle depths in [0, 1]")
    e.add_argument("--tasks", type=name_list(TASKS, "task"), default="single,multikey",
                   help=f"comma-separated needle tasks, from: {', '.join(TASKS)}")
    e.add_argument("--samples", type=at_least(1), default=1, help="prompts per (length, depth, task) cell")
    e.add_argument("--seed", type=int, default=0, help="prompt seed")
    add_threads_arg(e)
    e.add_argument("--quiet", action="store_true", help="no heartbeat lines on stderr")
    e.add_argument("--out", type=output_folder, default=None, help="folder for press.json and press.md")
    e.set_defaults(func=_cmd_press)
