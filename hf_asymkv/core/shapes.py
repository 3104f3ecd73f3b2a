"""Per-layer shapes of a model config: which layers hold KV, and with how many heads of which width.

One place answers "what does layer ``i`` cache": :func:`layer_shapes`. The cache sizes its layers from it, the
scales file validates and fingerprints against it, calibration and export read it. Heterogeneous configs (Gemma4:
full-attention layers with their own ``head_dim``, KV-sharing layers without a cache) are read layer by layer;
``head_dim`` missing from a config is ``hidden_size // num_attention_heads``, as transformers' attention derives it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .compat import cache_layer_types

__all__ = ["NO_KV_LAYER_TYPES", "SLIDING_LAYER_TYPES", "LayerShape", "kv_layer_indices", "layer_shapes", "layer_types"]

SLIDING_LAYER_TYPES = ("sliding_attention", "chunked_attention")
"""Layer types kept in transformers' own bounded full-precision sliding-window layer."""

NO_KV_LAYER_TYPES = ("dummy", "linear_attention", "conv", "moe", "mlp")
"""Layer types that hold no K/V: KV-sharing consumers and attention-free layers, recurrent and convolution states
(transformers' ``DummyLayer`` and ``LinearAttentionLayer``)."""


@dataclass(frozen=True)
class LayerShape:
    """What one layer of a model caches.

    Attributes:
        layer_type: the cache layer type (``"full_attention"``, ``"sliding_attention"``, ``"chunked_attention"``,
            ``"dummy"`` for KV-sharing consumers and KV-less layers, or another transformers type).
        kv_heads: key/value heads of the layer's attention (0 for a config without attention heads).
        head_dim: width of one key head (and value head, unless ``value_head_dim`` says otherwise).
        value_head_dim: width of one value head where it differs (a config's ``v_head_dim``: MiMo-V2, MLA-style
            models), else 0.
    """

    layer_type: str
    kv_heads: int
    head_dim: int
    value_head_dim: int = 0

    @property
    def widths(self) -> tuple[int, ...]:
        """The key and value head widths (one entry when they are equal): what group sizes must divide."""
        return tuple(sorted({self.head_dim, self.value_head_dim or self.head_dim}))

    @property
    def holds_kv(self) -> bool:
        """Full or sliding attention: the layers whose K/V a cache (and a scales file) holds (a config without
        attention heads holds none, whatever transformers infers its layer types to be)."""
        return (self.layer_type == "full_attention" or self.layer_type in SLIDING_LAYER_TYPES) and self.head_dim > 0

    @property
    def quantized(self) -> bool:
        """The layers an :class:`~hf_asymkv.AsymKVCache` quantizes (full attention)."""
        return self.layer_type == "full_attention" and self.head_dim > 0

    @property
    def unknown(self) -> bool:
        """A layer type this package does not know (transformers adds types every release: ``hybrid``,
        ``heavily_compressed_attention``, ...): the cache keeps transformers' own layer for it, unquantized."""
        known = ("full_attention", *SLIDING_LAYER_TYPES, *NO_KV_LAYER_TYPES)
        return self.layer_type not in known


def layer_types(config) -> list[str]:
    """Per-layer cache type of a (text) config, exactly as transformers' own `DynamicCache` sees it.

    KV-sharing consumer layers and MLP/MoE-only layers come back as ``"dummy"`` (transformers 5.23+; older
    releases leave KV-sharing layers out); missing ``layer_types`` are inferred per layer, the resolution
    `DynamicCache` itself uses (:func:`~hf_asymkv.core.compat.cache_layer_types`).
    """
    return cache_layer_types(config)


def _per_layer_configs(text_config, n_layers: int) -> list:
    """One config per layer: heterogeneous configs (e.g. Gemma4, whose full-attention layers have their own
    ``head_dim``) refuse global reads of per-layer attributes, so those are read from each layer's view. The cache
    may have fewer layers than the config (transformers < 5.23 drops trailing KV-sharing layers)."""
    per_layer = getattr(text_config, "per_layer_config", None)
    if per_layer is None or len(per_layer) < n_layers:
        return [text_config] * n_layers
    return [per_layer[i] for i in range(n_layers)]


def _shape(layer_config, text_config, layer_type: str) -> LayerShape:
    if getattr(layer_config, "num_attention_heads", None) is None and not hasattr(text_config, "num_attention_heads"):
        return LayerShape(layer_type, 0, 0)  # a config without attention heads (Mamba, RWKV): no K/V to size
    heads = getattr(layer_config, "num_attention_heads", None) or text_config.num_attention_heads
    kv_heads = getattr(layer_config, "num_key_value_heads", None) or heads
    head_dim = getattr(layer_config, "head_dim", None) or layer_config.hidden_size // heads
    value_head_dim = getattr(layer_config, "v_head_dim", None) or 0
    return LayerShape(layer_type, int(kv_heads), int(head_dim), int(value_head_dim) if value_head_dim != head_dim else 0)


def layer_shapes(config) -> list[LayerShape]:
    """One :class:`LayerShape` per cache layer of ``config`` (any model config: multimodal configs use their text
    decoder), in layer order, as transformers' ``DynamicCache`` lays the layers out."""
    text = config.get_text_config(decoder=True)
    types = layer_types(text)
    return [_shape(c, text, t) for c, t in zip(_per_layer_configs(text, len(types)), types)]


def kv_layer_indices(config) -> list[int]:
    """Indices of the layers that hold KV (full or sliding attention) of a model config."""
    return [i for i, shape in enumerate(layer_shapes(config)) if shape.holds_kv]
