"""`hf-asymkv demo`: one long-document retrieval prompt, full precision and AsymKVCache side by side."""

from __future__ import annotations

from .args import add_model_args, add_threads_arg, at_least, fraction, load_model_from_args, set_threads

__all__ = ["add_parser"]


def _cmd_demo(args) -> int:
    from ..evals.demo import format_demo, run_demo

    set_threads(args.threads)
    model, tokenizer = load_model_from_args(args)
    rows, info = run_demo(model, tokenizer, context_tokens=args.context, depth=args.depth, seed=args.seed,
                          timing_runs=args.repeats)
    print(format_demo(rows, info))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="long-document retrieval, DynamicCache vs AsymKVCache side by side")
    add_model_args(p)
    p.add_argument("--context", type=at_least(64), default=3000, help="document length in tokens, >= 64")
    p.add_argument("--depth", type=fraction, default=0.35, help="needle depth in [0, 1]")
    p.add_argument("--seed", type=int, default=7, help="prompt seed")
    p.add_argument("--repeats", type=at_least(2, zero_ok=True), default=0,
                   help="time decoding over this many interleaved runs of each cache and show the median and range "
                        "(0: no speed figure; a single run is noise on a busy machine)")
    add_threads_arg(p)
    p.set_defaults(func=_cmd_demo)
