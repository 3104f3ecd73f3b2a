"""hf_asymkv: asymmetric KV-cache quantization for Hugging Face transformers.

Keys are stored 8-bit per channel (INT8 or FP8), values 4-bit per token, the newest tokens exact.

The public names below come from the core (:mod:`hf_asymkv.core`) and are imported on first use, so that
``import hf_asymkv`` and the ``hf-asymkv`` command line (``--help`` above all) do not pay for torch and
transformers until something needs them. The tools live in their own subpackages.

- :class:`AsymKVCache`: the ``transformers.Cache``; :class:`AsymKVConfig`: its settings, one frozen object.
- :data:`KEY_FORMATS`, :data:`VALUE_BITS`, :data:`OVERFLOW_POLICIES`: the values those settings accept;
  :data:`PRESETS`: named settings (``AsymKVCache.from_preset``); :func:`cache_kwargs`: the cache keyword of the
  installed transformers.
- :class:`KVScales`: calibrated K/V ranges (``kv_scales.safetensors``); :class:`AsymKVLayer`, :class:`QuantSpec`:
  one layer's storage and one tensor's quantization spec; :func:`register_attention`: the fused attention.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .version import __version__

if TYPE_CHECKING:  # what static tools see; at run time the names load on first use (__getattr__)
    from .core.attention import register as register_attention
    from .core.cache import AsymKVCache
    from .core.compat import cache_kwargs
    from .core.config import KEY_FORMATS, OVERFLOW_POLICIES, VALUE_BITS, AsymKVConfig
    from .core.layer import AsymKVLayer
    from .core.presets import PRESETS
    from .core.quant import QuantSpec
    from .core.scales import KVScales

# public name -> (core module, attribute)
_PUBLIC = {
    "AsymKVCache": ("cache", "AsymKVCache"),
    "AsymKVConfig": ("config", "AsymKVConfig"),
    "AsymKVLayer": ("layer", "AsymKVLayer"),
    "KEY_FORMATS": ("config", "KEY_FORMATS"),
    "KVScales": ("scales", "KVScales"),
    "OVERFLOW_POLICIES": ("config", "OVERFLOW_POLICIES"),
    "PRESETS": ("presets", "PRESETS"),
    "QuantSpec": ("quant", "QuantSpec"),
    "VALUE_BITS": ("config", "VALUE_BITS"),
    "cache_kwargs": ("compat", "cache_kwargs"),
    "register_attention": ("attention", "register"),
}

__all__ = [
    "KEY_FORMATS",
    "OVERFLOW_POLICIES",
    "PRESETS",
    "VALUE_BITS",
    "AsymKVCache",
    "AsymKVConfig",
    "AsymKVLayer",
    "KVScales",
    "QuantSpec",
    "__version__",
    "cache_kwargs",
    "register_attention",
]
"""Written out (not derived from :data:`_PUBLIC`) so that static tools see the re-exports; a test checks the two
agree."""


def __getattr__(name: str):
    """Import a public name from the core on first access (PEP 562) and keep it in the module namespace."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hf_asymkv' has no attribute {name!r}; public names: {__all__}")
    module, attribute = _PUBLIC[name]
    # threads asking at once: the import system's lock makes one of them import, and each stores the same object
    value = getattr(importlib.import_module(f".core.{module}", __name__), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
