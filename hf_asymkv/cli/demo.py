"""`hf-asymkv demo`: one long-document retrieval prompt, full precision and AsymKVCache side by side."""

from __future__ import annotations

from .args import add_model_args, load_model_from_args, set_threads

__all__ = ["add_parser"]


def _cmd_demo(args) -> int:
    from ..evals.demo import format_demo, run_demo

    if not 0.0 <= args.depth <= 1.0:  # checked here too, so that a typo fails before the model loads
        raise ValueError(f"--depth must be in [0, 1], got {args.depth}")
    if args.context < 64:
        raise ValueError(f"--context must be >= 64 tokens, got {args.context}")
    set_threads(args.threads)
    model, tokenizer = load_model_from_args(args)
    rows, info = run_demo(model, tokenizer, context_tokens=args.context, depth=args.depth, seed=args.seed)
    print(format_demo(rows, info))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="long-document retrieval, DynamicCache vs AsymKVCache side by side")
    add_model_args(p)
    p.add_argument("--context", type=int, default=3000, help="document length in tokens (default 3000)")
    p.add_argument("--depth", type=float, default=0.35, help="needle depth in [0, 1] (default 0.35)")
    p.add_argument("--seed", type=int, default=7, help="prompt seed (default 7)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.set_defaults(func=_cmd_demo)
