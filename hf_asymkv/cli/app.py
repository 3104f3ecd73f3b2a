"""The `hf-asymkv` command line: the parser and the error handling; each command group lives in its own module.

Command modules import their heavy dependencies (torch, transformers, the tools) inside the commands, so that
building the parser and ``--help`` stay fast (``tests/cli/test_cli_app.py`` holds it). Every argument is checked
while the command line is parsed (:mod:`.args`), before a model loads.

Exit codes: 0 success; 2 a usage error (argparse's message) or a bad value found by a command (``error: ...``
on stderr). ``hf-asymkv`` (or ``hf-asymkv eval``) without a command prints the command list and exits 0: showing
it is what was asked for (as ``--help``).
"""

from __future__ import annotations

import argparse
import sys

from . import bench, calibrate, demo, evals, hub, prompt_cache
from .args import Parser, check_inputs

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hf-asymkv", description="Asymmetric KV-cache quantization for transformers.")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    parser.set_defaults(func=None, usage_parser=parser)
    demo.add_parser(sub)
    calibrate.add_parser(sub)
    evals.add_parser(sub)
    bench.add_parsers(sub)
    hub.add_parsers(sub)
    prompt_cache.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..models import ModelNotAvailableError
    from ..plots import MissingExtraError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.func is None:  # no command: the command list, on stdout, as --help shows it
        args.usage_parser.print_help()
        return 0
    try:
        check_inputs(args)  # input paths exist: before anything heavy loads
        return args.func(args)
    # Bad input, a missing model package or eval extra, or a --model that is neither a folder nor a reachable Hub id
    # (OSError, FileNotFoundError included): one line on stderr, exit 2.
    except (ValueError, OSError, ModelNotAvailableError, MissingExtraError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
