"""`AsymKVCache`: a `transformers.Cache` that builds one layer object per model layer from the config.

Full-attention layers get an :class:`~hf_asymkv.layer.AsymKVLayer`; sliding-window and chunked layers keep
transformers' own bounded full-precision `DynamicSlidingWindowLayer` (a window of a few hundred or thousand
tokens is not where long-context memory goes); layers without KV (linear attention, shared-KV consumers,
MLP-only) get whatever transformers' `DynamicCache` would give them. The container stays dumb: every storage
decision lives in the layer.
"""

from __future__ import annotations

import math
import os
from collections import Counter

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, DynamicCache, get_layer_types_and_kwargs

from .attention import ATTN_IMPLEMENTATION
from .layer import OVERFLOW_POLICIES, AsymKVLayer
from .quant import GRANULARITIES, QuantSpec
from .scales import KVScales

__all__ = ["AsymKVCache", "KEY_FORMATS", "VALUE_BITS"]

KEY_FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2")
VALUE_BITS = (2, 4, 8)
_SLIDING_TYPES = ("sliding_attention", "chunked_attention")
# Default chosen by measurement, see README "Choosing the key format" (scripts/key_format.py).
DEFAULT_KEY_FORMAT = "int8"


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}.")


def _positive_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")


def _head_dim(config: PreTrainedConfig) -> int:
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        head_dim = config.hidden_size // config.num_attention_heads
    return int(head_dim)


def _layer_configs(config: PreTrainedConfig, n_layers: int) -> list[PreTrainedConfig]:
    """One config per layer: heterogeneous configs (e.g. Gemma4, whose full-attention layers have their own
    ``head_dim``) refuse global reads of per-layer attributes, so those are read from each layer's view."""
    per_layer = getattr(config, "per_layer_config", None)
    if per_layer is None or len(per_layer) != n_layers:
        return [config] * n_layers
    return [per_layer[i] for i in range(n_layers)]


def _layer_types(config: PreTrainedConfig) -> list[str]:
    """Per-layer cache type, exactly as transformers' own `DynamicCache` sees it.

    KV-sharing consumer layers and MLP/MoE-only layers come back as ``"dummy"``; missing ``layer_types`` are
    inferred per layer (``get_layer_types_and_kwargs``, the resolution `DynamicCache` itself uses).
    """
    return list(get_layer_types_and_kwargs(config)[0])


def _default_group(head_dims: list[int]) -> int:
    """Largest channel group <= 128 that divides every head_dim (the head_dim itself when <= 128)."""
    g = math.gcd(*head_dims)
    return max(d for d in range(1, min(g, 128) + 1) if g % d == 0)


class AsymKVCache(Cache):
    """Asymmetric KV cache: keys 8-bit per channel, values 4-bit per token, recent tokens exact.

    Args:
        config: the model config (`model.config`); multimodal configs use their text decoder.
        key_format: one of :data:`KEY_FORMATS`; ``int8`` by default (measured, see README).
        value_bits: 2, 4 or 8 (asymmetric integer, scale + zero per group).
        value_group_size: channels per V scale; must divide head_dim (of every full-attention layer, for
            configs with per-layer head dims); defaults to the largest such divisor <= 128 (``min(head_dim, 128)``
            for the usual head dims 64/128/256).
        key_block_size: tokens per quantized block (K per-channel scales are per block).
        residual_length: newest tokens kept in the model dtype (>= 0).
        sink_tokens: first tokens kept in the model dtype (>= 0).
        key_granularity: ``"channel"`` (default), ``"token"`` or ``"tensor"`` (baselines).
        key_group_size: channels per K scale for ``key_granularity="token"`` (default head_dim).
        value_granularity: ``"token"`` (default), ``"channel"`` or ``"tensor"`` (baselines).
        value_symmetric: symmetric V codes (baseline K4V4 "symmetric"); default asymmetric.
        scales: calibrated ranges: a ``kv_scales.safetensors`` path or a :class:`~hf_asymkv.scales.KVScales`
            (validated against ``config``). Full-attention layers then use the calibrated per-channel K scale
            for every block, except where a key exceeds it (``overflow_policy``).
        key_absmax: calibrated per-layer K ranges as tensors, ``{layer_idx: Tensor[kv_heads, head_dim]}``
            (what ``scales`` provides; give one or the other).
        overflow_policy: what a calibrated layer does with a key beyond its range: one of
            :data:`~hf_asymkv.layer.OVERFLOW_POLICIES`.
        growth_factor: capacity multiplier of the code buffers (> 1; amortized O(1) appends).
        max_growth_tokens: the most capacity (tokens) one growth adds, bounding unused memory.

    Example::

        cache = AsymKVCache(model.config)
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
        cache.memory_footprint()["total"], cache.stats()["tokens_quantized"]

    When ``model.config`` uses ``attn_implementation="asymkv_sdpa"`` (see :func:`hf_asymkv.attention.register`),
    the layers hand attention their stored codes instead of dense K/V (``cache.fused_attention`` is True).
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        *,
        key_format: str = DEFAULT_KEY_FORMAT,
        value_bits: int = 4,
        value_group_size: int | None = None,
        key_block_size: int = 128,
        residual_length: int = 128,
        sink_tokens: int = 0,
        key_granularity: str = "channel",
        key_group_size: int | None = None,
        value_granularity: str = "token",
        value_symmetric: bool = False,
        scales: str | os.PathLike | KVScales | None = None,
        key_absmax: dict[int, torch.Tensor] | None = None,
        overflow_policy: str = "widen",
        growth_factor: float = 1.25,
        max_growth_tokens: int = 256,
    ):
        if not isinstance(config, PreTrainedConfig):
            raise ValueError(f"config must be a transformers PreTrainedConfig (model.config), got {type(config).__name__}.")
        text_config = config.get_text_config(decoder=True)
        _choice("key_format", key_format, KEY_FORMATS)
        _choice("value_bits", value_bits, VALUE_BITS)
        _choice("key_granularity", key_granularity, GRANULARITIES)
        _choice("value_granularity", value_granularity, GRANULARITIES)
        _choice("overflow_policy", overflow_policy, OVERFLOW_POLICIES)
        _positive_int("key_block_size", key_block_size)
        _positive_int("residual_length", residual_length, 0)
        _positive_int("sink_tokens", sink_tokens, 0)
        _positive_int("max_growth_tokens", max_growth_tokens)
        if not (isinstance(growth_factor, (int, float)) and growth_factor > 1):
            raise ValueError(f"growth_factor must be a number > 1, got {growth_factor!r}.")
        if scales is not None:
            if key_absmax is not None:
                raise ValueError("give calibrated ranges as scales= or as key_absmax=, not both.")
            self.scales = scales if isinstance(scales, KVScales) else KVScales.load(scales, config)
            if isinstance(scales, KVScales):
                scales.validate(config)
            key_absmax = dict(self.scales.k_channel_absmax)
        else:
            self.scales = None

        layer_types = _layer_types(text_config)
        if not any(t == "full_attention" or t in _SLIDING_TYPES for t in layer_types):
            declared = getattr(text_config, "layer_types", None) or layer_types
            raise ValueError(
                f"config {type(config).__name__} has no attention layers (layer types {sorted(set(declared))}); "
                "AsymKVCache needs at least one full or sliding attention layer."
            )
        # Group sizes must divide the head_dim of every layer that quantizes (the full-attention ones).
        layer_configs = _layer_configs(text_config, len(layer_types))
        quantized = [i for i, t in enumerate(layer_types) if t == "full_attention"] or range(len(layer_types))
        head_dims = sorted({_head_dim(layer_configs[i]) for i in quantized})
        value_group_size = _default_group(head_dims) if value_group_size is None else value_group_size
        key_group_size = math.gcd(*head_dims) if key_group_size is None else key_group_size
        for name, size in (("value_group_size", value_group_size), ("key_group_size", key_group_size)):
            _positive_int(name, size)
            if any(hd % size for hd in head_dims):
                divisors = [g for g in range(1, math.gcd(*head_dims) + 1) if all(hd % g == 0 for hd in head_dims)]
                hd_text = f"head_dim={head_dims[0]}" if len(head_dims) == 1 else f"every head_dim {head_dims}"
                raise ValueError(f"{name} must divide {hd_text} (one of {divisors}), got {size}.")
        self.key_spec = QuantSpec(key_format, key_granularity, key_group_size, True, torch.bfloat16)
        self.value_spec = QuantSpec(f"int{value_bits}", value_granularity, value_group_size, value_symmetric,
                                    torch.float16)

        if key_absmax is not None:
            if key_granularity != "channel":
                raise ValueError(f"calibrated key ranges need key_granularity='channel', got {key_granularity!r}.")
            full = {i for i, t in enumerate(layer_types) if t == "full_attention"}
            if scales is not None:  # a scales file covers every layer with KV; we use the full-attention ones
                key_absmax = {i: k for i, k in key_absmax.items() if i in full}
            bad = sorted(set(key_absmax) - full)
            if bad:
                raise ValueError(f"calibrated key ranges given for layers {bad}, which are not full-attention layers.")
        self.settings = dict(
            key_format=key_format, value_bits=value_bits, value_group_size=value_group_size,
            key_block_size=key_block_size, residual_length=residual_length, sink_tokens=sink_tokens,
            key_granularity=key_granularity, key_group_size=key_group_size, value_granularity=value_granularity,
            value_symmetric=value_symmetric, overflow_policy=overflow_policy, growth_factor=growth_factor,
            max_growth_tokens=max_growth_tokens,
        )  # fmt: skip
        # Decided once, here: the fused attention takes QuantizedKV, every other attention needs dense K/V.
        self.fused_attention = ATTN_IMPLEMENTATION in (getattr(config, "_attn_implementation", None),
                                                       getattr(text_config, "_attn_implementation", None))
        layers = self._build_layers(text_config, layer_types, key_absmax or {})
        super().__init__(layers=layers)

    @classmethod
    def from_pretrained(cls, dir_or_repo_id: str | os.PathLike, config: PreTrainedConfig, *,
                        revision: str | None = None, token: str | None = None, **overrides) -> AsymKVCache:
        """A cache with published scales: a folder written by ``hf-asymkv publish`` or a Hub repo holding one.

        Args:
            dir_or_repo_id: local publish folder, or Hub repo id (downloads only ``kv_scales.safetensors``,
                ``asymkv_config.json`` and ``README.md``).
            config: the model config (``model.config``); the scales must belong to it.
            revision, token: for Hub repos.
            **overrides: ``AsymKVCache`` settings that win over the published ones.

        Raises:
            ValueError: malformed publication or scales for another model (the message names the problem).
            OSError: not a local folder and the Hub download failed.

        Example::

            cache = AsymKVCache.from_pretrained("org/model-asymkv-scales", config=model.config)
            out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
        """
        from .publish import load_published

        for name in ("scales", "key_absmax"):
            if name in overrides:
                raise ValueError(f"from_pretrained takes its ranges from {dir_or_repo_id!r}; do not pass {name}=.")
        if not isinstance(config, PreTrainedConfig):
            raise ValueError("config must be a transformers PreTrainedConfig (model.config), "
                             f"got {type(config).__name__}.")
        scales, settings = load_published(dir_or_repo_id, config, revision=revision, token=token)
        return cls(config, scales=scales, **{**settings, **overrides})

    def _build_layers(self, text_config, layer_types: list[str], key_absmax: dict[int, torch.Tensor]) -> list:
        # What DynamicCache builds for this config (one layer per layer type): reused for every layer we do not
        # quantize, so sliding windows, linear attention and KV-sharing layers behave exactly as transformers'.
        fallback = DynamicCache(config=text_config).layers
        s = self.settings
        layers = []
        for i, layer_type in enumerate(layer_types):
            if layer_type == "full_attention":
                layers.append(AsymKVLayer(
                    self.key_spec, self.value_spec, block_size=s["key_block_size"],
                    residual_length=s["residual_length"], sink_tokens=s["sink_tokens"],
                    growth_factor=s["growth_factor"], max_growth_tokens=s["max_growth_tokens"],
                    key_absmax=key_absmax.get(i),
                    overflow_policy=s["overflow_policy"], return_views=self.fused_attention,
                ))  # fmt: skip
            else:
                layers.append(fallback[i])
        return layers

    def memory_footprint(self) -> dict[str, int]:
        """Real bytes of every tensor the cache holds, unused capacity included.

        Returns:
            ``{part: bytes}`` for the quantized layers' parts (codes, scales, zeros, sinks, window,
            ``unused_capacity`` as an informational subset), ``full_precision_layers`` for the layers kept
            exact (sliding windows), ``total``, and ``bf16_equivalent``: what a bf16 ``DynamicCache`` would hold
            for the same tokens (``2 * 2 bytes * batch * kv_heads * seq * head_dim`` per layer, sliding layers
            at their own window).
        """
        parts: Counter = Counter()
        for layer in self.layers:
            if isinstance(layer, AsymKVLayer):
                parts.update(layer.memory_footprint())
                if layer.is_initialized:
                    parts["bf16_equivalent"] += layer.dense_elements() * 2
            else:
                held = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None]
                parts["full_precision_layers"] += sum(t.numel() * t.element_size() for t in held)
                parts["bf16_equivalent"] += sum(t.numel() * 2 for t in held)
        total = sum(v for k, v in parts.items() if k not in ("unused_capacity", "bf16_equivalent"))
        return {**dict(parts), "total": total, "bf16_equivalent": parts["bf16_equivalent"]}

    def stats(self) -> dict[str, int]:
        """Counters summed over layers: ``tokens_quantized``, ``blocks_quantized``, ``flushes``,
        ``key_overflow_channels``, ``key_widened_blocks``, ``key_clipped_values``, ``requantized_tokens``."""
        total: Counter = Counter()
        for layer in self.layers:
            if isinstance(layer, AsymKVLayer):
                total.update(layer.stats)
        keys = ("tokens_quantized", "blocks_quantized", "flushes", "key_overflow_channels", "key_widened_blocks",
                "key_clipped_values", "requantized_tokens")
        return {k: int(total.get(k, 0)) for k in keys} | {k: int(v) for k, v in total.items() if k not in keys}

    def __repr__(self) -> str:
        s = self.settings
        return (
            f"AsymKVCache(K={s['key_format']}/{s['key_granularity']}, V=int{s['value_bits']}/"
            f"{s['value_granularity']}(g={s['value_group_size']}), block={s['key_block_size']}, "
            f"window={s['residual_length']}, sinks={s['sink_tokens']}, layers={len(self.layers)})"
        )
