"""hf_asymkv: asymmetric KV-cache quantization for Hugging Face transformers.

Keys are stored 8-bit per channel (INT8 or FP8), values 4-bit per token, the newest tokens exact.
Importing the package loads the core only (:mod:`hf_asymkv.core`); the tools live in their own subpackages.
"""

from .core.attention import register as register_attention
from .core.cache import AsymKVCache
from .core.config import KEY_FORMATS, OVERFLOW_POLICIES, VALUE_BITS, AsymKVConfig
from .core.layer import AsymKVLayer
from .core.presets import PRESETS
from .core.quant import QuantSpec
from .core.scales import KVScales
from .version import __version__

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
    "register_attention",
]
