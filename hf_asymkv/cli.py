"""The `hf-asymkv` command line. Each subcommand parses its arguments and calls into the library."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _load(args):
    import torch

    from .models import load_model

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    return load_model(args.model, dtype=dtype, device=args.device)


def _cmd_demo(args) -> int:
    import torch

    from .demo import format_demo, run_demo

    torch.set_num_threads(max(1, args.threads)) if args.threads else None
    model, tokenizer = _load(args)
    rows, info = run_demo(model, tokenizer, context_tokens=args.context, depth=args.depth, seed=args.seed)
    print(format_demo(rows, info))
    return 0


def _cmd_memory(args) -> int:
    from .bench import format_memory_table, measure_kv_memory, save_rows

    model, _ = _load(args)
    rows = measure_kv_memory(model, args.schemes.split(","), args.lengths, decode_tokens=args.decode_tokens)
    print(format_memory_table(rows))
    if args.out:
        save_rows(rows, args.out, {"model": args.model, "dtype": args.dtype, "command": " ".join(sys.argv)})
    return 0


def _add_model_args(p: argparse.ArgumentParser, dtype: str = "float32") -> None:
    from .models import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"HF model id, local folder or .gguf file (default: the embedded {DEFAULT_MODEL})")
    p.add_argument("--dtype", default=dtype, choices=["float32", "bfloat16", "float16"], help="model dtype")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-asymkv", description="Asymmetric KV-cache quantization for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="long-document retrieval, DynamicCache vs AsymKVCache side by side")
    _add_model_args(p)
    p.add_argument("--context", type=int, default=3000, help="document length in tokens (default 3000)")
    p.add_argument("--depth", type=float, default=0.35, help="needle depth in [0, 1] (default 0.35)")
    p.add_argument("--seed", type=int, default=7, help="prompt seed (default 7)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("memory", help="real KV bytes after a prefill, per cache scheme, vs DynamicCache")
    _add_model_args(p, dtype="bfloat16")
    p.add_argument("--lengths", type=_int_list, default=[4096], help="prefill lengths, e.g. 1024,4096")
    p.add_argument("--schemes", default="dynamic,asymkv,hf-quanto-int4,hf-fp8", help="comma-separated scheme names")
    p.add_argument("--decode-tokens", type=int, default=0, help="greedy steps after the prefill (default 0)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.set_defaults(func=_cmd_memory)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .models import ModelNotAvailableError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ModelNotAvailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
