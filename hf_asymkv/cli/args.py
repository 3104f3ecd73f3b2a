"""Argument helpers every `hf-asymkv` command shares: the parser class, checked argument types, model flags,
threads, the command line.

Every value a command takes is checked by its argparse ``type=`` (names, ranges, paths), so a wrong value fails
while the command line is parsed: before any model loads and before anything is written; the message lists
the values allowed, and so does ``--help``. Nothing heavy is imported here (torch and transformers load inside
the functions that need them), so that ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

__all__ = ["DTYPES", "Parser", "add_model_args", "add_threads_arg", "at_least", "command_line", "float_list",
           "check_inputs", "existing_file", "fraction", "fraction_list", "input_arg", "input_problem", "int_list", "load_model_from_args",
           "missing_path", "model_source",
           "name_list", "output_file", "output_folder", "output_path", "set_threads", "torch_dtype"]

DTYPES = ("float32", "bfloat16", "float16")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already states its default, or there is none
    to state (None, a store_true flag, a required option)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        no_default = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if "default" in help_text or no_default or action.required:
            return help_text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with :class:`HelpFormatter`; subcommand parsers inherit the class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def at_least(low: int, zero_ok: bool = False) -> Callable[[str], int]:
    """argparse ``type=``: an integer ``>= low`` (or ``0`` too, with ``zero_ok``: a measurement switched off)."""
    bound = f"0 or >= {low}" if zero_ok else f">= {low}"
    want = f"an integer {bound}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if value < low and not (zero_ok and value == 0):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    parse.__name__ = f"integer {bound}"
    return parse


def fraction(text: str) -> float:
    """argparse ``type=``: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def name_list(known: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """argparse ``type=``: comma-separated names, each one of ``known``, none repeated."""
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}s, got {text!r}")
        if bad := [n for n in names if n not in known]:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {bad}; known {what}s: {', '.join(known)}")
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"{what}s repeated in {text!r}")
        return names
    parse.__name__ = f"{what} list"
    return parse


def output_path(kind: str = "any", whole: bool = False) -> Callable[[str], str]:
    """argparse ``type=``: where a command writes, checked now (a second, no model loaded) rather than at the
    write after the run: the wrong kind of entry already there, a parent that cannot be created because an
    ancestor is a file, or no permission to write there (:func:`hf_asymkv.core.fileio.output_problem`).

    Args:
        kind: ``"file"``, ``"folder"`` or ``"any"`` (the command decides later, from its other flags).
        whole: a folder built beside itself and renamed into place (publish, export-vllm).
    """
    from ..core.fileio import output_problem

    def parse(text: str) -> str:
        problem = output_problem(text, kind, whole=whole)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return text
    parse.__name__ = f"output {kind}"
    return parse


output_file = output_path("file")
"""argparse ``type=``: a file the command writes (see :func:`output_path`)."""
output_folder = output_path("folder")
"""argparse ``type=``: a folder the command writes files into (see :func:`output_path`)."""


def missing_path(text: str) -> str:
    """The one message every command gives for an input path that does not exist."""
    return f"no such file or folder: {text!r}"


def input_problem(text: str, kind: str = "any") -> str | None:
    """Why ``text`` is not an input of ``kind`` (``"file"``, ``"folder"`` or ``"any"``) that exists; None when it is."""
    from pathlib import Path

    path = Path(text).expanduser()
    if not path.exists():
        return missing_path(text)
    if kind == "file" and not path.is_file():
        return f"{text!r} is a folder; give a file"
    if kind == "folder" and not path.is_dir():
        return f"{text!r} is a file; give a folder"
    return None


def existing_file(text: str) -> str | None:
    """:func:`input_problem` for a file."""
    return input_problem(text, "file")


def input_arg(parser: argparse.ArgumentParser, *flags: str, check: Callable[[str], str | None] = input_problem,
              group=None, **kwargs) -> argparse.Action:
    """``add_argument`` for a path the command reads; ``check(value)`` (default: it exists) runs when the command
    starts (:func:`check_inputs`), before anything heavy loads.

    Not an argparse ``type=``: parsing stays independent of files that an earlier step of a workflow makes (the
    docs' commands are parsed by tests before those files exist); the refusal still comes within the second, with
    one message for a missing path in every command (:func:`missing_path`).

    Args:
        group: the argument group (mutually exclusive or not) to add it to; ``parser`` keeps the check.
    """
    action = (group or parser).add_argument(*flags, **kwargs)
    checks = parser.get_default("input_checks") or []
    parser.set_defaults(input_checks=[*checks, (action.option_strings[0] if action.option_strings else action.dest,
                                                action.dest, check)])
    return action


def check_inputs(args) -> None:
    """Run the :func:`input_arg` checks of the parsed command (the inputs given).

    Raises:
        ValueError: ``"--scales: no such file or folder: 'x'"``, naming the flag.
    """
    for flag, dest, check in getattr(args, "input_checks", None) or []:
        value = getattr(args, dest, None)
        problem = check(value) if value is not None else None
        if problem:
            raise ValueError(f"{flag}: {problem}")


def model_source(text: str) -> str:
    """argparse ``type=``: ``--model``; a local path that does not exist is refused here, not by the Hub client."""
    from ..models import check_model_source

    try:
        check_model_source(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def int_list(text: str) -> list[int]:
    """``"1024,4096"`` -> ``[1024, 4096]`` (positive integers), for argparse ``type=``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def fraction_list(text: str) -> list[float]:
    """``"0,0.5,1"`` -> ``[0.0, 0.5, 1.0]``, each in [0, 1], for argparse ``type=``."""
    values = float_list(text)
    if bad := [v for v in values if not 0.0 <= v <= 1.0]:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {bad}")
    return values


def float_list(text: str) -> list[float]:
    """``"0.1,0.5"`` -> ``[0.1, 0.5]``, for argparse ``type=``."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    return values


def torch_dtype(name: str):
    """One of :data:`DTYPES` (argparse restricts the choices) -> the torch dtype."""
    import torch

    return getattr(torch, name)


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    """``--threads`` (0: torch's choice)."""
    p.add_argument("--threads", type=at_least(0), default=0, help="torch CPU threads (default 0: torch's choice)")


def set_threads(threads: int) -> None:
    """``--threads``: 0 keeps torch's choice."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def command_line(args) -> str:
    """The equivalent `hf-asymkv` command line (also for the scripts/ wrappers), for results' metadata."""
    return " ".join(["hf-asymkv", *args.argv])


def load_model_from_args(args):
    """``(model, tokenizer)`` from ``--model``, ``--dtype``, ``--device``, ``--device-map`` and ``--offload-folder``.

    Raises:
        ValueError: a bad ``--device-map`` (see :func:`~hf_asymkv.models.parse_device_map`), or ``"disk"`` entries
            without ``--offload-folder``.
    """
    from ..models import load_model, parse_device_map

    return load_model(args.model, dtype=torch_dtype(args.dtype), device=args.device,
                      device_map=parse_device_map(getattr(args, "device_map", None)),
                      offload_folder=getattr(args, "offload_folder", None))


def add_model_args(p: argparse.ArgumentParser, dtype: str = "float32") -> None:
    """``--model``, ``--dtype``, ``--device``, ``--device-map``, ``--offload-folder``."""
    from ..models import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, type=model_source,
                   help=f"HF model id, local folder or .gguf file (default: the embedded {DEFAULT_MODEL})")
    p.add_argument("--dtype", default=dtype, choices=DTYPES,
                   help=f"model dtype, one of {', '.join(DTYPES)} (default {dtype})")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--device-map", default=None,
                   help="accelerate device_map (overrides --device): auto, balanced, sequential, a device, or a JSON "
                        "object / .json file of module -> device, e.g. '{\"model.layers.0\": 0, \"lm_head\": \"cpu\"}'")
    p.add_argument("--offload-folder", type=output_folder, default=None,
                   help="folder for the weights of 'disk' entries of --device-map")
