"""hf_asymkv: asymmetric KV-cache quantization for Hugging Face transformers.

Keys are stored 8-bit per channel (INT8 or FP8), values 4-bit per token, the newest tokens exact.
"""

from .attention import register as register_attention
from .cache import AsymKVCache
from .layer import AsymKVLayer
from .quant import QuantSpec
from .scales import KVScales

__all__ = ["AsymKVCache", "AsymKVLayer", "KVScales", "QuantSpec", "__version__", "register_attention"]
__version__ = "0.1.0"
