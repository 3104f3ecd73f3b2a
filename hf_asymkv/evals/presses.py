"""NVIDIA kvpress presses by name, for ``hf-asymkv eval press``: an optional dependency, imported on use only.

kvpress 0.5 pins ``transformers>=4.56,<5.3``; hf-asymkv supports 5.0 and up, so both install together on
transformers 5.0-5.2 (``pip install kvpress "transformers>=5.0,<5.3"``). Nothing else in hf-asymkv imports it:
``import hf_asymkv`` and ``hf-asymkv --help`` never do (this module is plain Python until :func:`make_press`).
"""

from __future__ import annotations

from ..plots import MissingExtraError

__all__ = ["KVPRESS_INSTALL", "PRESSES", "make_press", "require_kvpress"]

PRESSES = ("ExpectedAttentionPress", "SnapKVPress", "KnormPress", "StreamingLLMPress", "TOVAPress")
"""Presses the evaluation builds (``NAME(compression_ratio=R)``): kvpress's scorer presses that compress the prefill,
the kind :class:`~hf_asymkv.AsymKVCache` composes with (:mod:`hf_asymkv.core.kv_assign`)."""

KVPRESS_INSTALL = 'pip install kvpress "transformers>=5.0,<5.3"'
"""The install command that brings kvpress in beside hf-asymkv (kvpress 0.5 pins transformers below 5.3)."""


def require_kvpress():
    """The ``kvpress`` module.

    Raises:
        MissingExtraError: kvpress is not installed (the message names the install command).
    """
    try:
        import kvpress
    except ImportError as exc:
        raise MissingExtraError(f"presses come from NVIDIA kvpress, which is not installed ({exc}): "
                                f"{KVPRESS_INSTALL}") from None
    return kvpress


def make_press(name: str, compression_ratio: float):
    """``kvpress.<name>(compression_ratio=compression_ratio)``.

    Raises:
        ValueError: a name outside :data:`PRESSES` or a ratio outside ``[0, 1)`` (the message lists the allowed).
        MissingExtraError: kvpress is not installed.
    """
    if name not in PRESSES:
        raise ValueError(f"unknown press {name!r}; presses: {list(PRESSES)}")
    if not 0.0 <= compression_ratio < 1.0:
        raise ValueError(f"compression ratio must be in [0, 1) (the fraction of tokens a press drops), got "
                         f"{compression_ratio!r}")
    return getattr(require_kvpress(), name)(compression_ratio=compression_ratio)
