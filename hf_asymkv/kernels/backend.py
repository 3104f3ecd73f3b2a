"""Which implementation runs the fused attention over quantized K/V: ``HF_ASYMKV_ATTENTION_BACKEND``.

- ``auto`` (default): the Triton kernel for CUDA tensors when Triton is installed and the kernel serves the
  request; the native kernel (:mod:`.cpu_attention`) for CPU tensors when it builds and serves the request; the
  torch implementation otherwise;
- ``triton``: the Triton kernel, or an error that says what is missing (Triton itself, a device it runs on,
  a feature of the request). CPU tensors run it under Triton's interpreter (``TRITON_INTERPRET=1``, set before
  Triton is imported): that is how the kernels are tested without a GPU;
- ``native``: the native CPU kernel, or an error that says why it cannot serve the call;
- ``torch``: the torch implementation (:func:`hf_asymkv.core.attention.fused_attention`).

This module imports neither Triton nor the core.
"""

from __future__ import annotations

import functools
import os

import torch

from . import env_choice

__all__ = ["BACKENDS", "ENV_VAR", "choose_backend", "requested_backend", "triton_problem", "triton_version",
           "use_native"]

ENV_VAR = "HF_ASYMKV_ATTENTION_BACKEND"
BACKENDS = ("auto", "triton", "torch", "native")
INSTALL_HINT = "pip install 'hf-asymkv[gpu]'"


def requested_backend() -> str:
    """The backend ``HF_ASYMKV_ATTENTION_BACKEND`` names (``auto`` when unset or empty), read at every call.

    Raises:
        ValueError: a value outside :data:`BACKENDS`.
    """
    return env_choice(ENV_VAR, BACKENDS, "an attention backend")


@functools.lru_cache(maxsize=1)  # process-wide, immutable: a race imports Triton (under the import lock) twice at most
def triton_version() -> str | None:
    """Triton's version, or None when it cannot be imported."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def triton_problem(device: torch.device) -> str | None:
    """Why the Triton kernel cannot run on tensors of ``device`` (None when it can)."""
    if triton_version() is None:
        return f"Triton is not installed ({INSTALL_HINT})"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"Triton runs on CUDA tensors (or CPU tensors with TRITON_INTERPRET=1); these are on {device.type!r}"


def choose_backend(device: torch.device, request_problem: str | None) -> str:
    """``"triton"`` or ``"torch"`` for one fused-attention call.

    Args:
        device: where the query and the cache live.
        request_problem: what of this request the kernel cannot serve (a phrase), or None.

    Raises:
        ImportError: ``triton`` was asked for and Triton is not installed.
        ValueError: ``triton`` was asked for and it cannot serve the request (the message says why), or an
            unknown backend name.
    """
    backend = requested_backend()
    if backend in ("torch", "native") or backend == "auto" and device.type != "cuda":
        return "torch"
    problem = triton_problem(device) or request_problem
    if backend == "auto":
        return "triton" if problem is None else "torch"
    if problem is not None:
        error = ImportError if triton_version() is None else ValueError
        raise error(f"{ENV_VAR}=triton cannot serve this attention call: {problem}. Unset it (or set 'auto') to "
                    "fall back to the torch implementation.")
    return "triton"


def use_native(device: torch.device, problem: str | None) -> bool:
    """Whether the native CPU kernel runs one fused-attention call (``problem``: what of the call it cannot serve, a
    phrase, or None); ``auto`` takes it for CPU tensors it serves.

    Raises:
        ValueError: ``native`` was asked for and it cannot serve the call (the message says why), or an unknown
            backend name.
    """
    backend = requested_backend()
    if backend not in ("auto", "native"):
        return False
    if device.type != "cpu":
        problem = f"the native kernel runs on CPU tensors; these are on {device.type!r}"
    if backend == "native" and problem is not None:
        raise ValueError(f"{ENV_VAR}=native cannot serve this attention call: {problem}. Unset it (or set 'auto') to "
                         "fall back to the torch implementation.")
    return problem is None
