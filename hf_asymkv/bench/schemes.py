"""Named cache schemes, so that every benchmark and evaluation compares the same things by the same names.

Each scheme is a factory ``config -> Cache``. transformers' own caches sit beside ours: ``dynamic`` (full
precision), ``hf-quanto-int4`` (`QuantizedCache` with optimum-quanto, KIVI-style, re-quantizes its history
at every flush; ``hf-quanto-int2`` likewise at 2 bits) and ``hf-fp8`` (`QuantizedCache` fp8, one per-tensor
scale frozen at prefill). The presets are ``asymkv-<preset name>``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, DynamicCache, QuantizedCache

from ..core.attention import ATTN_IMPLEMENTATION, register
from ..core.cache import AsymKVCache
from ..core.presets import PRESETS

__all__ = ["ATTENTION", "SCHEMES", "check_scheme", "make_cache", "scheme_attention", "scheme_names", "with_baseline"]

Factory = Callable[[PreTrainedConfig], Cache]

SCHEMES: dict[str, tuple[str, Factory]] = {
    "dynamic": ("full precision DynamicCache", lambda c: DynamicCache(config=c)),
    "hf-quanto-int4": (
        "transformers QuantizedCache, optimum-quanto int4 (K and V per-channel groups of 64, window 128)",
        lambda c: QuantizedCache("quanto", c, nbits=4),
    ),
    "hf-fp8": ("transformers QuantizedCache fp8 (per-tensor scale frozen at prefill)", lambda c: QuantizedCache("fp8", c)),
    "asymkv": ("ours, defaults: K int8 per-channel blocks, V int4 per-token, window 128", lambda c: AsymKVCache(c)),
    "asymkv-fused": (
        "ours, defaults, with the fused attention over the codes (attn_implementation='asymkv_sdpa')",
        lambda c: _fused_cache(c),
    ),
    "asymkv-fp8": ("ours with K fp8-e4m3 per-channel", lambda c: AsymKVCache(c, key_format="fp8_e4m3")),
    "asymkv-sinks4": ("ours with 4 exact sink tokens", lambda c: AsymKVCache(c, sink_tokens=4)),
    "asymkv-w32": ("ours with a 32-token exact window", lambda c: AsymKVCache(c, residual_length=32)),
    "asymkv-w512": ("ours with a 512-token exact window", lambda c: AsymKVCache(c, residual_length=512)),
    "k4v4-sym": (
        "baseline: symmetric int4 K per-channel and V per-token",
        lambda c: AsymKVCache(c, key_format="int4", value_bits=4, value_symmetric=True),
    ),
    "k4v8-inverted": ("baseline: K int4 per-channel, V int8 per-token", lambda c: AsymKVCache(c, key_format="int4", value_bits=8)),
    "int8-per-tensor": (
        "baseline: K and V int8 with one scale per block of all heads/channels",
        lambda c: AsymKVCache(c, key_granularity="tensor", value_bits=8, value_granularity="tensor", value_symmetric=True),
    ),
}

for _name, _config in PRESETS.items():  # the presets (hf_asymkv.PRESETS) by their scheme names
    SCHEMES[f"asymkv-{_name}"] = (f"ours, preset {_name!r}: {_config.describe()}",
                                  lambda c, _name=_name: AsymKVCache.from_preset(_name, c))
SCHEMES["hf-quanto-int2"] = (
    "transformers QuantizedCache, optimum-quanto int2 (K and V per-channel groups of 64, window 128)",
    lambda c: QuantizedCache("quanto", c, nbits=2),
)

# Schemes that need the model's attention implementation switched while they run.
ATTENTION = {"asymkv-fused": ATTN_IMPLEMENTATION}


def _fused_cache(config: PreTrainedConfig) -> AsymKVCache:
    cache = AsymKVCache(config)
    if not cache.fused_attention:
        raise ValueError("scheme 'asymkv-fused' needs the model on attn_implementation='asymkv_sdpa': build it "
                         "inside `with scheme_attention(model, 'asymkv-fused'):`.")
    return cache


@contextlib.contextmanager
def scheme_attention(model, name: str) -> Iterator[None]:
    """Switch ``model`` to the attention implementation scheme ``name`` needs (if any), restore it after."""
    wanted = ATTENTION.get(name)
    before = model.config._attn_implementation
    if wanted is None or wanted == before:
        yield
        return
    register()
    model.set_attn_implementation(wanted)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def with_baseline(schemes: list[str]) -> list[str]:
    """``"dynamic"`` first (every ratio is against it), then the others in the given order."""
    return ["dynamic"] + [s for s in schemes if s != "dynamic"]


def scheme_names() -> list[str]:
    return list(SCHEMES)


def make_cache(name: str, config: PreTrainedConfig) -> Cache:
    """Build the cache called ``name`` for ``config``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    check_scheme(name)
    return SCHEMES[name][1](config)


def check_scheme(name: str) -> None:
    """Raise ``ValueError`` naming ``name`` and the known schemes when ``name`` is not one of them."""
    if name not in SCHEMES:
        raise ValueError(f"Unknown cache scheme {name!r}; known schemes: {scheme_names()}.")
