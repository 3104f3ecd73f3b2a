"""The `hf-asymkv` command line: the parser and the error handling; each command group lives in its own module.

Command modules import their heavy dependencies (torch, transformers, the tools) inside the commands, so that
building the parser and ``--help`` stay fast.
"""

from __future__ import annotations

import argparse
import sys

from . import bench, calibrate, demo, evals, hub

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-asymkv", description="Asymmetric KV-cache quantization for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(sub)
    calibrate.add_parser(sub)
    evals.add_parser(sub)
    bench.add_parsers(sub)
    hub.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..models import ModelNotAvailableError
    from ..plots import MissingExtraError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    # Bad input, a missing model package or eval extra, or a --model that is neither a folder nor a reachable Hub id
    # (OSError, FileNotFoundError included): one line on stderr, exit 2.
    except (ValueError, OSError, ModelNotAvailableError, MissingExtraError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
