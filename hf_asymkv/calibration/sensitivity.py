"""Per-layer sensitivity: the attention KL that each layer's keys and values cost at each width.

For every layer ``l`` and every candidate width, only layer ``l`` is quantized (every other layer keeps its whole
history in the exact window) and the last ``queries`` tokens of a calibration window are fed after that cache;
the cost is the attention KL against full precision (:func:`hf_asymkv.evals.attention.attention_stats`)
**averaged over all layers**, the same figure the evaluation reports: a layer's keys move its own attention,
and its keys and values move every later layer's through the residual stream. Keys are measured with 8-bit
values, values with 8-bit keys (the 8-bit partner costs ~100x less than the widths compared).

Measured in isolation, the costs add up only approximately when every layer is quantized at once (errors
compound); :mod:`.allocate` treats them as additive, and the evaluation of the allocated config says how well
that held.

The candidate widths are :data:`KEY_WIDTHS` (settings the presets use for keys) and :data:`VALUE_WIDTHS`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicCache

from ..core.cache import AsymKVCache
from ..core.compat import cache_kwargs
from ..core.config import AsymKVConfig
from ..core.quant import dequantize
from ..core.shapes import layer_shapes
from ..core.store import encode_blocks
from ..evals.attention import attention_stats, eager_attention
from ..evals.evaluate import cache_from_prefix
from ..models import input_device

__all__ = ["KEY_WIDTHS", "SENSITIVITY_VERSION", "VALUE_WIDTHS", "layer_sensitivity", "prefill_sensitivity",
           "width_bits"]

SENSITIVITY_VERSION = 1
"""Version of the sensitivity dict (:func:`layer_sensitivity`), stored beside the scales."""

KEY_WIDTHS: dict[str, dict] = {name: {**settings, "key_wide_fraction": settings.get("key_wide_fraction", 0.0)} for
                               name, settings in {
    "int2-b64": dict(key_format="int2", key_symmetric=False, key_block_size=64),
    "int2": dict(key_format="int2", key_symmetric=False, key_block_size=32),  # max's keys before 2026-12-05
    "int3-b128": dict(key_format="int3", key_symmetric=False, key_block_size=128),
    "int3": dict(key_format="int3", key_symmetric=False, key_block_size=64),  # tight's keys
    "int3w": dict(key_format="int3", key_symmetric=False, key_block_size=64, key_wide_fraction=0.25),  # max's
    "int4-b128": dict(key_format="int4", key_symmetric=False, key_block_size=128),
    "int4": dict(key_format="int4", key_symmetric=False, key_block_size=64),
    "int4w": dict(key_format="int4", key_symmetric=False, key_block_size=64, key_wide_fraction=0.25),  # compact's
    "int8": dict(key_format="int8", key_symmetric=True, key_block_size=128),  # balanced's keys
}.items()}
"""Key settings compared per layer, by name: the presets' per-channel keys, and the same codes in longer blocks
(fewer scale bytes), so that an allocation can also pay for protection by cheapening insensitive layers. Each names
``key_wide_fraction`` (0 but for ``int4w`` and ``int3w``), so that a layer override never inherits the preset's wide channels
for a format that has none."""
VALUE_WIDTHS: dict[str, dict] = {f"v{bits}": dict(value_bits=bits) for bits in (1, 2, 3, 4, 8)}
"""Value settings compared per layer (per-token groups, rotated as in every preset)."""
_EXACT = 1 << 30  # a window longer than any prompt: that layer keeps its whole history exact


def width_bits(settings: dict, head_dim: int) -> float:
    """Stored bits per K or V element of a :data:`KEY_WIDTHS` / :data:`VALUE_WIDTHS` entry, scales included
    (fp16 scale, and zero when asymmetric: per channel and block for keys, per token and group for values; the high
    bits and channel indices of wide key channels).

    Raises:
        ValueError: settings that are neither a key nor a value width.
    """
    config = AsymKVConfig(**settings)
    if "key_format" in settings:
        spec = config.key_spec()
        wide = spec.wide_count(head_dim)  # a whole byte of high bits per token and head, one byte per channel index
        wide_bits = 8 * -(-wide // 8) / head_dim + 8 * wide / (config.key_block_size * head_dim)
        return spec.bits + (16 if spec.symmetric else 32) / config.key_block_size + (wide_bits if wide else 0.0)
    if set(settings) == {"value_bits"}:
        group = config.resolved([head_dim]).value_group_size
        return config.value_bits + 32 / group
    raise ValueError(f"width settings must name key_format or value_bits, got {settings!r}")


def _known(names: list[str] | None, widths: dict, kind: str) -> list[str]:
    unknown = [n for n in names or () if n not in widths]
    if unknown:
        raise ValueError(f"unknown {kind} widths {unknown}; known: {list(widths)}")
    return list(widths) if names is None else list(names)


@torch.no_grad()
def _probs(model, cache, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer ``[heads, q, keys]`` attention probabilities of ``ids`` fed after ``cache``."""
    with eager_attention(model):
        out = model(input_ids=ids, **cache_kwargs(cache), use_cache=True, output_attentions=True, logits_to_keep=1)
    return [a[0].float() for a in out.attentions]


def _cost(model, prefilled, ids, ref, layers: list[int], layer: int, settings: dict) -> float:
    """Mean attention KL over layers with only ``layer`` quantized with ``settings``."""
    exact = {i: {"residual_length": _EXACT} for i in layers if i != layer}
    config = AsymKVConfig(**settings, layer_overrides=exact)
    probs = _probs(model, cache_from_prefix(AsymKVCache(model.config, config), prefilled), ids)
    return sum(attention_stats(r, p, ks=())["kl"] for r, p in zip(ref, probs)) / len(ref)


def layer_sensitivity(model, ids: torch.Tensor, queries: int = 16, key_widths: list[str] | None = None,
                      value_widths: list[str] | None = None, tick: Callable[[str], None] | None = None) -> dict:
    """Attention KL of every (layer, width) for keys and for values, on one calibration window.

    Args:
        ids: ``[1, T]`` token ids of natural text (``T > queries``).
        queries: last tokens whose attention is compared.
        key_widths, value_widths: names of :data:`KEY_WIDTHS` / :data:`VALUE_WIDTHS` to measure (default: all).
        tick: called after each layer with where the run is.

    Returns:
        ``{"version", "tokens", "queries", "layers": [quantized layer indices], "keys": {width: [KL per quantized
        layer]}, "values": {...}, "widths": {width: settings}}``; KL in nats, mean over layers, heads and queries.

    Raises:
        ValueError: ``queries`` outside ``[1, T - 1]``, ids not ``[1, T]``, or an unknown width name.
    """
    key_widths = _known(key_widths, KEY_WIDTHS, "key")
    value_widths = _known(value_widths, VALUE_WIDTHS, "value")
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must be [1, T] token ids, got shape {tuple(ids.shape)}")
    if not 1 <= queries < ids.shape[1]:
        raise ValueError(f"queries must be in [1, {ids.shape[1] - 1}] for a {ids.shape[1]}-token window, got {queries}")
    ids = ids.to(input_device(model))
    prefilled = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :-queries], **cache_kwargs(prefilled), use_cache=True, logits_to_keep=1)
    ref = _probs(model, copy.deepcopy(prefilled), ids[:, -queries:])
    layers = [i for i, shape in enumerate(layer_shapes(model.config)) if shape.quantized]
    out = {"version": SENSITIVITY_VERSION, "tokens": int(ids.shape[1]), "queries": queries, "layers": layers,
           "keys": {w: [] for w in key_widths}, "values": {w: [] for w in value_widths},
           "widths": {w: {**KEY_WIDTHS, **VALUE_WIDTHS}[w] for w in key_widths + value_widths}}
    for layer in layers:
        for width in key_widths:
            out["keys"][width].append(_cost(model, prefilled, ids[:, -queries:], ref, layers, layer,
                                            {**KEY_WIDTHS[width], "value_bits": 8}))
        for width in value_widths:
            out["values"][width].append(_cost(model, prefilled, ids[:, -queries:], ref, layers, layer,
                                              {**KEY_WIDTHS["int8"], **VALUE_WIDTHS[width]}))
        if tick:
            tick(f"sensitivity: layer {layer + 1} of {len(ref)}")
    return out


def _relative_error(x: torch.Tensor, spec) -> float:
    """``||x - q(x)||^2 / ||x||^2`` of a round trip through ``spec`` (its wide key channels included)."""
    codes, scale, zero, wide = encode_blocks(x, spec)
    error = dequantize(codes, scale, zero, spec, wide=wide) - x.float()
    return float(error.square().sum() / x.float().square().sum().clamp_min(1e-30))


def prefill_sensitivity(prefilled, layers: list[int]) -> dict:
    """What a prefill alone can tell, with no extra forward pass: per (layer, width), the relative squared error
    of the layer's prefill keys (values) after a round trip through that width (outlier-heavy channels and
    offsets raise it). A stand-in for :func:`layer_sensitivity` in the same format (costs are not nats, so only
    their order across layers and widths means anything), compared with it in ``docs/protection.md``.

    Args:
        prefilled: a ``DynamicCache`` after the prefill (``layers[i].keys``: ``[batch, kv_heads, T, head_dim]``).
        layers: the quantized layers' indices.

    Raises:
        ValueError: a prefill shorter than the longest key block (the first whole blocks are measured).
    """
    block = max(settings["key_block_size"] for settings in KEY_WIDTHS.values())
    tokens = prefilled.layers[layers[0]].keys.shape[-2] // block * block  # whole blocks of every width
    if not tokens:
        raise ValueError(f"prefill_sensitivity needs a prefill of at least {block} tokens, got "
                         f"{prefilled.layers[layers[0]].keys.shape[-2]}")
    out = {"version": SENSITIVITY_VERSION, "tokens": tokens, "queries": 0,
           "layers": list(layers), "keys": {w: [] for w in KEY_WIDTHS}, "values": {w: [] for w in VALUE_WIDTHS},
           "widths": {**KEY_WIDTHS, **VALUE_WIDTHS}, "source": "prefill"}
    for i in layers:
        keys, values = prefilled.layers[i].keys[..., :tokens, :], prefilled.layers[i].values[..., :tokens, :]
        for width, settings in KEY_WIDTHS.items():
            out["keys"][width].append(_relative_error(keys, AsymKVConfig(**settings).resolved(
                [keys.shape[-1]]).key_spec()))
        for width, settings in VALUE_WIDTHS.items():
            out["values"][width].append(_relative_error(values, AsymKVConfig(**settings).resolved(
                [values.shape[-1]]).value_spec()))
    return out
