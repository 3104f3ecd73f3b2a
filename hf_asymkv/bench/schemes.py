"""Named cache schemes, so that every benchmark and evaluation compares the same things by the same names.

Each scheme is a factory ``config -> Cache``. transformers' own caches sit beside ours: ``dynamic`` (full
precision), ``hf-quanto-int4``/``hf-quanto-int2`` (`QuantizedCache` with optimum-quanto, re-quantizes its
history at every flush) and ``hf-fp8`` (`QuantizedCache` fp8, one per-tensor scale frozen at prefill). The
presets (``hf_asymkv.PRESETS``) are ``asymkv-<preset name>``; the peers' formats (vLLM, llama.cpp, KIVI),
emulated in :mod:`.peers`, are registered under their names.

Static caches (preallocated for a length, issue 20) are in :data:`STATIC_SCHEMES`, apart: their factory needs the
length (``make_cache(name, config, max_cache_len=N)``), and the ``-compiled`` ones run the decode step through
``torch.compile`` (:func:`scheme_forward`); only ``hf-asymkv bench`` offers them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ..core.registry import PRESET_NAMES
from .peer_names import PEER_SCHEMES

if TYPE_CHECKING:  # torch, transformers and the core load inside the factories: the CLI lists names cheaply
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache

    from ..core.cache import AsymKVCache

__all__ = ["ATTENTION", "COMPILED", "PEER_SCHEMES", "PRESET_NAMES", "SCHEMES", "STATIC_SCHEMES", "check_scheme",
           "make_cache", "scheme_attention", "scheme_forward", "scheme_names", "with_baseline"]

Factory = Callable[["PreTrainedConfig"], "Cache"]
StaticFactory = Callable[["PreTrainedConfig", int], "Cache"]


def _dynamic(config: PreTrainedConfig) -> Cache:
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=config)


def _quantized(backend: str, **kwargs) -> Factory:
    def build(config: PreTrainedConfig) -> Cache:
        from transformers.cache_utils import QuantizedCache

        return QuantizedCache(backend, config, **kwargs)
    return build


def _asymkv(**settings) -> Factory:
    """Ours with ``settings`` over the 0.1 defaults (window 128, no sinks, unrotated V), so that ``asymkv`` and its
    variations keep the meaning of every committed result; ``AsymKVCache()`` itself is ``asymkv-balanced``."""
    def build(config: PreTrainedConfig) -> AsymKVCache:
        from ..core.cache import AsymKVCache
        from ..core.config import LEGACY_DEFAULTS

        return AsymKVCache(config, **{**LEGACY_DEFAULTS, **settings})
    return build


def _fused(make: Factory) -> Factory:
    """``make``'s cache, refused unless the model runs the fused attention (see :func:`scheme_attention`)."""
    def build(config: PreTrainedConfig) -> AsymKVCache:
        cache = make(config)
        if not cache.fused_attention:
            raise ValueError("fused schemes need the model on attn_implementation='asymkv_sdpa': build the cache "
                             "inside `with scheme_attention(model, name):`.")
        return cache
    return build


SCHEMES: dict[str, tuple[str, Factory]] = {
    "dynamic": ("full precision DynamicCache", _dynamic),
    "hf-quanto-int4": (
        "transformers QuantizedCache, optimum-quanto int4 (axis 0: K and V both in groups of 64 consecutive "
        "head_dim values of one token, i.e. per token; window 128)",
        _quantized("quanto", nbits=4),
    ),
    "hf-quanto-int2": (
        "transformers QuantizedCache, optimum-quanto int2 (per-token groups of 64 for K and V, window 128)",
        _quantized("quanto", nbits=2),
    ),
    "hf-fp8": ("transformers QuantizedCache fp8 (per-tensor scale frozen at prefill)", _quantized("fp8")),
    "asymkv": ("ours, the 0.1 default: K int8 per-channel blocks, V int4 per-token, window 128 (AsymKVCache() is "
               "asymkv-balanced since 0.2)", _asymkv()),
    "asymkv-fused": (
        "ours, defaults, with the fused attention over the codes (attn_implementation='asymkv_sdpa')",
        _fused(_asymkv()),
    ),
    "asymkv-fp8": ("ours with K fp8-e4m3 per-channel", _asymkv(key_format="fp8_e4m3")),
    "asymkv-v2": ("ours with V int2 per token", _asymkv(value_bits=2)),
    "asymkv-v8": ("ours with V int8 per token", _asymkv(value_bits=8)),
    "asymkv-sinks4": ("ours with 4 exact sink tokens", _asymkv(sink_tokens=4)),
    # the sinks ablation (README, Evidence): at 4096 tokens 4 sinks shift the block boundaries so the window holds
    # 252 tokens; these two separate the sinks (same 128 exact tokens as the default) from the larger window.
    "asymkv-sinks4-w124": (
        "ours with 4 exact sink tokens and a 124-token window (the default's bytes at 4k)",
        _asymkv(sink_tokens=4, residual_length=124),
    ),
    "asymkv-w256": ("ours with a 256-token exact window (4 sinks' bytes at 4k)", _asymkv(residual_length=256)),
    "asymkv-w32": ("ours with a 32-token exact window", _asymkv(residual_length=32)),
    "asymkv-w512": ("ours with a 512-token exact window", _asymkv(residual_length=512)),
    "k4v4-sym": (
        "baseline: symmetric int4 K per-channel and V per-token",
        _asymkv(key_format="int4", value_bits=4, value_symmetric=True),
    ),
    "k4v8-inverted": ("baseline: K int4 per-channel, V int8 per-token", _asymkv(key_format="int4", value_bits=8)),
    "int8-per-tensor": (
        "baseline: K and V int8 with one scale per block of all heads/channels",
        _asymkv(key_granularity="tensor", value_bits=8, value_granularity="tensor", value_symmetric=True),
    ),
}


def _preset(name: str, **overrides) -> Factory:
    def build(config: PreTrainedConfig) -> AsymKVCache:
        from ..core.cache import AsymKVCache

        return AsymKVCache.from_preset(name, config, **overrides)
    return build


SCHEMES.update({f"asymkv-{name}": (f"ours, preset {name!r} (hf_asymkv.PRESETS)", _preset(name))
                for name in PRESET_NAMES})
# The presets with the sliding-window layers quantized too (AsymKVConfig(quantize_sliding=True); the same as the
# plain preset on a model without sliding layers).
SCHEMES.update({f"asymkv-{name}-sliding": (f"ours, preset {name!r} with the sliding-window layers quantized too "
                                           "(quantize_sliding=True)", _preset(name, quantize_sliding=True))
                for name in PRESET_NAMES})
# The presets through the fused attention (same storage, another read-out): for decode speed.
SCHEMES.update({f"asymkv-{name}-fused": (f"ours, preset {name!r} with the fused attention "
                                         "(attn_implementation='asymkv_sdpa')", _fused(_preset(name)))
                for name in PRESET_NAMES})

def _peer(name: str) -> Factory:
    def build(config: PreTrainedConfig) -> Cache:
        from .peers import make_peer_cache

        return make_peer_cache(name, config)
    return build


SCHEMES.update({name: (f"peer: {label} (emulated, see bench/peers.py)", _peer(name))
                for name, label in PEER_SCHEMES.items()})



def _static_preset(name: str) -> StaticFactory:
    def build(config: PreTrainedConfig, max_cache_len: int) -> AsymKVCache:
        from ..core.cache import AsymKVCache

        return AsymKVCache.from_preset(name, config, max_cache_len=max_cache_len)
    return build


def _hf_static(config: PreTrainedConfig, max_cache_len: int) -> Cache:
    from transformers.cache_utils import StaticCache

    return StaticCache(config=config, max_cache_len=max_cache_len)


STATIC_SCHEMES: dict[str, tuple[str, StaticFactory]] = {
    "hf-static": ("transformers StaticCache (full precision, preallocated), eager", _hf_static),
    "hf-static-compiled": ("transformers StaticCache, whole forward under torch.compile", _hf_static),
}
for _name in PRESET_NAMES:
    STATIC_SCHEMES[f"asymkv-{_name}-static"] = (f"ours, preset {_name!r}, static (max_cache_len), eager",
                                                _static_preset(_name))
    STATIC_SCHEMES[f"asymkv-{_name}-static-compiled"] = (
        f"ours, preset {_name!r}, static (max_cache_len), whole forward under torch.compile", _static_preset(_name))
    STATIC_SCHEMES[f"asymkv-{_name}-static-fused"] = (
        f"ours, preset {_name!r}, static, attention over the codes (attn_implementation='asymkv_sdpa'), eager",
        _static_preset(_name))
    STATIC_SCHEMES[f"asymkv-{_name}-static-fused-compiled"] = (
        f"ours, preset {_name!r}, static, attention over the codes (attn_implementation='asymkv_sdpa'), whole "
        "forward under torch.compile", _static_preset(_name))
COMPILED = frozenset(name for name in STATIC_SCHEMES if name.endswith("-compiled"))
"""Static schemes whose forward (prefill and decode steps) runs ``torch.compile(model.forward, fullgraph=True,
dynamic=False)``."""

# Schemes that need the model's attention implementation switched while they run.
ATTENTION = {name: "asymkv_sdpa" for name in [*SCHEMES, *STATIC_SCHEMES] if "-fused" in name}
"""hf_asymkv.core.attention.ATTN_IMPLEMENTATION (a test holds them equal)"""



@contextlib.contextmanager
def scheme_attention(model, name: str) -> Iterator[None]:
    """Switch ``model`` to the attention implementation scheme ``name`` needs (if any), restore it after."""
    wanted = ATTENTION.get(name)
    before = model.config._attn_implementation
    if wanted is None or wanted == before:
        yield
        return
    from ..core.attention import register

    register()
    model.set_attn_implementation(wanted)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def with_baseline(schemes: list[str]) -> list[str]:
    """``"dynamic"`` first (every ratio is against it), then the others in the given order."""
    return ["dynamic"] + [s for s in schemes if s != "dynamic"]


def scheme_names(static: bool = False) -> list[str]:
    """Every scheme name, in the order of :data:`SCHEMES`, then (with ``static``) :data:`STATIC_SCHEMES`."""
    return list(SCHEMES) + (list(STATIC_SCHEMES) if static else [])


def make_cache(name: str, config: PreTrainedConfig, max_cache_len: int | None = None) -> Cache:
    """Build the cache called ``name`` for ``config``; a static scheme's for ``max_cache_len`` tokens.

    Raises:
        ValueError: unknown name (the message lists the known ones), or a static scheme without ``max_cache_len``.
    """
    if name in STATIC_SCHEMES:
        if max_cache_len is None:
            raise ValueError(f"scheme {name!r} is a static cache: give max_cache_len (the tokens it must hold).")
        return STATIC_SCHEMES[name][1](config, max_cache_len)
    check_scheme(name)
    return SCHEMES[name][1](config)


_COMPILED_FORWARDS: dict[tuple[int, str], Callable] = {}


def scheme_forward(model, name: str, backend: str = "inductor") -> Callable:
    """What runs scheme ``name``'s forward passes: ``model`` itself, or for a :data:`COMPILED` scheme
    ``torch.compile(model.forward, fullgraph=True, dynamic=False, backend=backend)``, made once per model and
    backend (it compiles at its first call of each shape: run untimed calls first). Every compiled scheme and shape
    (prefill, step) is a graph of the same code object: dynamo's recompile limit is raised to hold them all, rather
    than fall back to eager silently past its default of 8."""
    if name not in COMPILED:
        return model
    key = (id(model), backend)
    if key not in _COMPILED_FORWARDS:
        import torch

        config = torch._dynamo.config  # recompile_limit from torch 2.7 (cache_size_limit before)
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, limit, max(getattr(config, limit), 64))

        # the compiled forward holds the model, so its id stays its own while it is here; one model at a time
        _COMPILED_FORWARDS.clear()
        _COMPILED_FORWARDS[key] = torch.compile(model.forward, fullgraph=True, dynamic=False, backend=backend)
    return _COMPILED_FORWARDS[key]


def check_scheme(name: str) -> None:
    """Raise ``ValueError`` naming ``name`` and the known schemes when ``name`` is not one of them."""
    if name not in SCHEMES:
        raise ValueError(f"Unknown cache scheme {name!r}; known schemes: {scheme_names()}.")
