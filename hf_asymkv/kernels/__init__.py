"""Kernels: a Triton decode attention that reads the quantized cache's codes as stored (GPU), and a native read-out of
the codes on CPU.

- :mod:`.regions`: what the kernel reads, as plain tensors (:class:`~.regions.StoredCodes`, a quantized region,
  exact segments) and :func:`~.regions.unsupported` (what it cannot serve);
- :mod:`.backend`: ``HF_ASYMKV_ATTENTION_BACKEND`` (``auto``/``triton``/``torch``) and the choice per call;
- :mod:`.decode`: the launcher (:func:`~.decode.decode_attention`), and :mod:`.triton_decode`: the kernels.
  Both import Triton (an optional dependency: ``pip install "hf-asymkv[gpu]"``);
- :mod:`.cpu_readout`: packed codes to float32 K/V in one native pass (``cpu_readout.c``, compiled on first use),
  ``HF_ASYMKV_CPU_READOUT`` (``auto``/``native``/``torch``).

This package depends on no other part of hf_asymkv: the core translates its layers' storage into these plain
regions (:mod:`hf_asymkv.core.backend`). Importing it imports nothing heavy.
"""

from __future__ import annotations

import os

__all__ = ["env_choice"]


def env_choice(name: str, choices: tuple[str, ...], what: str) -> str:
    """The value of environment variable ``name`` (lower-cased; ``choices[0]`` when unset or empty), read at every call.

    Raises:
        ValueError: a value outside ``choices`` (the message names ``what`` it should be and lists the choices).
    """
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={os.environ[name]!r} is not {what}; allowed: {list(choices)}.")
    return value
