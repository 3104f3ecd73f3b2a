"""Argument helpers every `hf-asymkv` command shares: list parsers, model flags, threads, the command line.

Nothing heavy is imported here (torch and transformers load inside the functions that need them), so that
``--help`` stays fast.
"""

from __future__ import annotations

import argparse

__all__ = ["DTYPES", "add_model_args", "command_line", "float_list", "int_list", "load_model_from_args",
           "set_threads", "torch_dtype"]

DTYPES = ("float32", "bfloat16", "float16")


def int_list(text: str) -> list[int]:
    """``"1024,4096"`` -> ``[1024, 4096]`` (positive integers), for argparse ``type=``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
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

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"HF model id, local folder or .gguf file (default: the embedded {DEFAULT_MODEL})")
    p.add_argument("--dtype", default=dtype, choices=DTYPES, help=f"model dtype (default {dtype})")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--device-map", default=None,
                   help="accelerate device_map (overrides --device): auto, balanced, sequential, a device, or a JSON "
                        "object / .json file of module -> device, e.g. '{\"model.layers.0\": 0, \"lm_head\": \"cpu\"}'")
    p.add_argument("--offload-folder", default=None, help="folder for the weights of 'disk' entries of --device-map")
