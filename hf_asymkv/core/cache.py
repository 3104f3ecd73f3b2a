"""`AsymKVCache`: a `transformers.Cache` that builds one layer object per model layer from the config.

Full-attention layers get an :class:`~hf_asymkv.core.layer.AsymKVLayer`; sliding-window and chunked layers keep
transformers' own bounded full-precision `DynamicSlidingWindowLayer` (a window of a few hundred or thousand
tokens is not where long-context memory goes); layers without KV (linear attention, shared-KV consumers,
MLP-only) get whatever transformers' `DynamicCache` would give them. The container stays dumb: every storage
decision lives in the layer.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections import Counter

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, DynamicCache, StaticCache

from .attention import ATTN_IMPLEMENTATION
from .compat import reset_layer
from .config import KEY_FORMATS, VALUE_BITS, AsymKVConfig, Growth
from .hooks import caller_hooked
from .layer import AsymKVLayer
from .nbytes import reachable_tensors, tensor_nbytes
from .reuse import ReuseWatch
from .rollback import Snapshot, restores_layers_on_error
from .scales import KVScales
from .shapes import SLIDING_LAYER_TYPES, LayerShape, kv_layer_indices, layer_shapes, layer_types
from .sliding_layer import SlidingAsymKVLayer
from .static import StaticAsymKVLayer

__all__ = ["EXACT_PARTS", "QUANTIZED_LAYERS", "AsymKVCache", "UnquantizedLayersWarning", "KEY_FORMATS", "SLIDING_LAYER_TYPES", "VALUE_BITS", "kv_layer_indices", "layer_types"]
"""``SLIDING_LAYER_TYPES``, ``kv_layer_indices`` and ``layer_types`` live in :mod:`hf_asymkv.core.shapes`; they are
served here too for code written against earlier releases."""

EXACT_PARTS = ("sink_", "window_", "pending_", "padded_sink_", "full_precision_layers")
"""Footprint parts stored in the model's dtype (exact tokens); the others (codes, scales, zeros, wide bits) have
dtypes of their own."""

QUANTIZED_LAYERS = (AsymKVLayer, StaticAsymKVLayer)
"""The layer classes an :class:`AsymKVCache` quantizes with (dynamic, and static with ``max_cache_len``)."""


class UnquantizedLayersWarning(UserWarning):
    """The model has layer types this package does not quantize nor know (kept as transformers builds them)."""


def _warn_unknown_layer_types(shapes: list[LayerShape]) -> None:
    """One warning naming the layer types :class:`AsymKVCache` leaves to transformers (see :attr:`LayerShape.unknown`),
    which layers they are, and what is quantized."""
    unknown = [i for i, shape in enumerate(shapes) if shape.unknown]
    if not unknown:
        return
    types = sorted({shapes[i].layer_type for i in unknown})
    quantized = sum(shape.quantized for shape in shapes)
    warnings.warn(UnquantizedLayersWarning(
        f"AsymKVCache does not know the layer type(s) {types} (layers {unknown} of {len(shapes)}): they are kept as "
        f"transformers' own cache layers for them, in full precision, and memory_footprint() counts them in "
        f"'full_precision_layers'. {quantized} full-attention layer(s) are quantized."), stacklevel=3)


class AsymKVCache(Cache):
    """Asymmetric KV cache: keys 8-bit per channel, values 4-bit per token, recent tokens exact.

    Args:
        config: the model config (`model.config`); multimodal configs use their text decoder.
        cache_config: an :class:`hf_asymkv.AsymKVConfig` (default: ``AsymKVConfig()``, the ``balanced`` preset).
        scales: calibrated ranges: a ``kv_scales.safetensors`` path or a :class:`hf_asymkv.KVScales`
            (validated against ``config``). Full-attention layers then use the calibrated per-channel K scale
            for every block, except where a key exceeds it (``overflow_policy``).
        key_absmax: calibrated per-layer K ranges as tensors, ``{layer_idx: Tensor[kv_heads, head_dim]}``
            (what ``scales`` provides; give one or the other).
        max_cache_len: preallocate every layer for this many tokens (prompt and generated) and make the cache
            compileable, as transformers' ``StaticCache`` (:class:`~hf_asymkv.core.static.StaticAsymKVLayer`; sliding
            layers get transformers' static sliding-window layer); None (default): layers grow as needed.
        **settings: any :class:`hf_asymkv.AsymKVConfig` field (``key_format``: one of
            :data:`hf_asymkv.KEY_FORMATS`; ``value_bits``: one of :data:`hf_asymkv.VALUE_BITS`;
            ``residual_length``, ``sink_tokens``, ``layer_overrides``, ...), applied over ``cache_config``.

    Raises:
        ValueError: an unknown or invalid setting, a group size that does not divide the model's head_dim,
            a layer override naming a layer the model does not quantize, scales of another model, or a config
            without attention layers (the message names the problem).

    Example::

        from hf_asymkv import AsymKVCache

        cache = AsymKVCache(model.config)
        out = model.generate(**inputs, **cache_kwargs(cache), max_new_tokens=64)  # hf_asymkv.cache_kwargs
        cache.memory_footprint()["ratio_vs_model_dtype"], cache.stats()["tokens_quantized"]

    ``cache_kwargs(cache)`` is ``{"cache": cache}`` on transformers 5.24+ and ``{"past_key_values": cache}`` before
    (:func:`hf_asymkv.core.compat.cache_kwargs`); on 5.24+ ``cache=cache`` may be written directly.

    When ``model.config`` uses ``attn_implementation="asymkv_sdpa"`` (see :func:`hf_asymkv.register_attention`),
    the layers hand attention their stored codes instead of dense K/V (``cache.fused_attention`` is True).

    A plain prefill is stored as it arrives: after ``model(ids)`` or ``generate``'s prefill the cache holds what
    :meth:`memory_footprint` reports, nothing exact waits. When the attention module that updates a layer has
    forward hooks (a kvpress press, :mod:`hf_asymkv.core.hooks`), its multi-token update stays exact in that layer
    until the cache's next update of any layer (:meth:`settle`), so that the press reads it exact and can replace it
    with the tokens it keeps (``layer.keys = ...``, :mod:`hf_asymkv.core.kv_assign`), which are then quantized once;
    after such a forward the last layer's update still waits (``memory_footprint()`` counts it as ``pending_*``),
    and ``settle()`` quantizes it now.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        cache_config: AsymKVConfig | None = None,
        *,
        scales: str | os.PathLike | KVScales | None = None,
        key_absmax: dict[int, torch.Tensor] | None = None,
        max_cache_len: int | None = None,
        **settings,
    ):
        if not isinstance(config, PreTrainedConfig):
            raise ValueError(f"config must be a transformers PreTrainedConfig (model.config), got {type(config).__name__}.")
        if cache_config is not None and not isinstance(cache_config, AsymKVConfig):
            raise ValueError(f"cache_config must be an AsymKVConfig, got {type(cache_config).__name__}.")
        cache_config = (cache_config or AsymKVConfig()).replace(**settings) if settings else cache_config or AsymKVConfig()
        text_config = config.get_text_config(decoder=True)
        if max_cache_len is not None and cache_config.quantize_sliding:
            raise ValueError("quantize_sliding=True needs a dynamic cache: a static cache (max_cache_len) keeps "
                             "transformers' static sliding-window layers.")
        self.scales = None
        if scales is not None:
            if key_absmax is not None:
                raise ValueError("give calibrated ranges as scales= or as key_absmax=, not both.")
            self.scales = scales if isinstance(scales, KVScales) else KVScales.load(scales, config)
            if isinstance(scales, KVScales):
                scales.validate(config)
            key_absmax = dict(self.scales.k_channel_absmax)

        shapes = layer_shapes(config)
        if not any(shape.holds_kv or shape.unknown for shape in shapes):
            declared = getattr(text_config, "layer_types", None) or [shape.layer_type for shape in shapes]
            raise ValueError(
                f"config {type(config).__name__} has no attention layers (layer types {sorted(set(declared))}); "
                "AsymKVCache needs at least one full or sliding attention layer."
            )
        _warn_unknown_layer_types(shapes)
        # Group sizes must divide the head_dim of every layer that quantizes (the full-attention ones).
        self.shapes = shapes
        self.cache_config = self._resolved(cache_config)
        self.layer_configs = self._layer_configs(self.cache_config)
        key_absmax = self._checked_key_ranges(key_absmax, shapes, from_scales=scales is not None)
        # The configs the model's attention reads its implementation from: looked up at every update, so that
        # `model.set_attn_implementation(...)` after the cache was built takes effect.
        self._attn_configs = (config, text_config)
        self._max_cache_len = max_cache_len
        self.held_layer: int | None = None  # the layer whose latest update waits for settle() (class docstring)
        super().__init__(layers=self._build_layers(text_config, key_absmax, max_cache_len))

    def _quantizes(self, shape: LayerShape, cache_config: AsymKVConfig) -> bool:
        """Whether the layer of ``shape`` is stored quantized: full attention, and sliding windows with
        ``quantize_sliding``."""
        return shape.quantized or (cache_config.quantize_sliding and shape.layer_type == "sliding_attention"
                                   and shape.head_dim > 0)

    def _resolved(self, cache_config: AsymKVConfig) -> AsymKVConfig:
        widths = {w for shape in self.shapes if self._quantizes(shape, cache_config) for w in shape.widths}
        return cache_config.resolved(sorted(widths or {shape.head_dim for shape in self.shapes if shape.head_dim}
                                            or {1}))

    def _layer_configs(self, cache_config: AsymKVConfig) -> dict:
        quantized = {i: shape.widths for i, shape in enumerate(self.shapes) if self._quantizes(shape, cache_config)}
        configs = cache_config.layer_configs(quantized, [shape.layer_type for shape in self.shapes])
        # A sliding window leaves the first tokens behind: no sinks there. Its layer holds a bounded number of tokens,
        # dropping a block for each it adds: its buffers grow by exactly what is needed (no unused capacity).
        return {i: dataclasses.replace(c, sink_tokens=0, growth=Growth(1.0, c.growth.max_tokens))
                if self.shapes[i].layer_type == "sliding_attention" else c for i, c in configs.items()}

    def apply_layer_overrides(self, layer_overrides) -> None:
        """Replace the per-layer overrides (``AsymKVConfig.layer_overrides``) of a cache none of whose layers holds a
        quantized block yet: protection chosen from the prefill (set ``keep_latest_exact`` on the layers so that
        the prefill stays exact, measure it, then call this before the next update).

        Raises:
            ValueError: an invalid override (named by layer, as at construction), a layer that already holds
                quantized blocks, or a static cache (its buffers are sized for its settings: give ``layer_overrides``
                when building it); nothing is changed then.
        """
        if self.max_cache_len is not None:
            raise ValueError("a static cache (max_cache_len) is allocated for its settings; give layer_overrides when "
                             "building it.")
        config = self._resolved(self.cache_config.replace(layer_overrides=layer_overrides))
        layer_configs = self._layer_configs(config)
        for i, layer_config in layer_configs.items():
            try:
                self.layers[i].check_reconfigure(layer_config)
            except ValueError as exc:
                raise ValueError(f"layer {i}: {exc}") from None
        for i, layer_config in layer_configs.items():
            self.layers[i].reconfigure(layer_config)
        self.cache_config, self.layer_configs = config, layer_configs

    @property
    def max_cache_len(self) -> int | None:
        """Tokens every layer is preallocated for (a static cache), or None (dynamic). A property of our own:
        transformers 5.0-5.x's ``Cache.max_cache_len`` is a read-only property over the layers."""
        return self._max_cache_len

    @property
    def model_config(self) -> PreTrainedConfig:
        """The model config the cache was built for (``config`` as given)."""
        return self._attn_configs[0]

    def save(self, path: str | os.PathLike, *, input_ids: torch.Tensor | None = None,
             metadata: dict[str, str] | None = None):
        """Save the cache to one safetensors file (atomically), settled first: a prompt cache to load later.
        See :func:`hf_asymkv.core.prompt_cache.save_prompt_cache` (``input_ids``: the ids the cache holds, whose hash a
        load checks; ``metadata``: strings of your own). Returns the path."""
        from .prompt_cache import save_prompt_cache

        return save_prompt_cache(self, path, input_ids=input_ids, metadata=metadata)

    @classmethod
    def load(cls, path: str | os.PathLike, config: PreTrainedConfig, *, input_ids: torch.Tensor | None = None,
             cache_config: AsymKVConfig | None = None, device: str | torch.device = "cpu") -> AsymKVCache:
        """A cache saved with :meth:`save`, read back for the model of ``config`` onto ``device``: it continues exactly
        as the saved one. Refuses (``ValueError`` naming the file and the problem) another model's file, another format
        version, an altered file, settings other than ``cache_config``, and ``input_ids`` (the saved prompt and what
        follows) whose first tokens are not the saved ones. See :mod:`hf_asymkv.core.prompt_cache`.

        Example::

            cache = AsymKVCache.load("doc.safetensors", model.config, input_ids=ids)   # ids: the prompt + a question
            out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=64)
        """
        from .prompt_cache import open_prompt_cache

        with open_prompt_cache(path, config, input_ids=input_ids, cache_config=cache_config, device=device) as saved:
            cache = cls(config, saved.cache_config, key_absmax=saved.key_absmax, max_cache_len=saved.max_cache_len)
            saved.restore(cache)
        return cache

    @property
    def fused_attention(self) -> bool:
        """Whether the model currently runs ``attn_implementation="asymkv_sdpa"`` (layers then hand attention
        their codes as :class:`~hf_asymkv.core.kv_view.QuantizedKV`; every other attention gets dense K/V)."""
        return any(getattr(c, "_attn_implementation", None) == ATTN_IMPLEMENTATION for c in self._attn_configs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' ``Cache.update``, with the read-out form (dense or codes) decided for this call; a new
        prompt on a cache that already answered one is warned about once (:mod:`~hf_asymkv.core.reuse`). An exception
        inside leaves the cache's bookkeeping and the layer as they were (:mod:`~hf_asymkv.core.rollback`; our layers
        see to their own state)."""
        if torch.compiler.is_compiling():  # a graph's step runs whole or not at all, as far as Python state goes
            return self._update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        own = [] if layer is None or isinstance(layer, QUANTIZED_LAYERS) else [layer]  # transformers' layer
        saved = Snapshot([self, self.reuse_watch, *own])
        try:
            return self._update(key_states, value_states, layer_idx, *args, **kwargs)
        except BaseException:
            saved.restore()
            raise

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.held_layer is not None and self.held_layer != layer_idx:
            self.layers[self.held_layer].settle()  # its update has had its turn (e.g. a press hook) before this one
            self.held_layer = None
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if not isinstance(layer, QUANTIZED_LAYERS):
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer.return_views = self.fused_attention
        # the first quantized layer, once per forward; a compiled step cannot read lengths on the host
        if layer_idx == self.reuse_watch.layer_idx and not torch.compiler.is_compiling():
            if isinstance(layer, StaticAsymKVLayer):
                layer.check_room(key_states.shape[-2])
            self.reuse_watch.update(key_states.shape[-2], layer)
        if isinstance(layer, AsymKVLayer):  # a prefill waits exact only for a hook that reads it (a press)
            layer.hold_updates = key_states.shape[-2] > 1 and caller_hooked()
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if isinstance(layer, AsymKVLayer) and layer.pending_tokens and not layer.defers:
            self.held_layer = layer_idx  # static layers quantize in the step itself: nothing is held
        return out

    def settle(self) -> None:
        """Quantize now what the latest multi-token update of a layer still holds exact (what the next update would
        do first): e.g. before reading ``memory_footprint()`` right after a prefill. A layer that defers (past
        recording, ``keep_latest_exact``) keeps its pending tokens."""
        for layer in self.layers:  # every layer: updates made on a layer directly are held too
            if isinstance(layer, AsymKVLayer):
                layer.settle()
        self.held_layer = None

    @restores_layers_on_error()
    def crop(self, max_length: int) -> None:
        """transformers' ``Cache.crop``; a rollback someone asked for is not a new prompt on a used cache. Every layer
        or none: an exception leaves them all as they were (:mod:`~hf_asymkv.core.rollback`)."""
        super().crop(max_length)
        if self.reuse_watch.layer_idx is not None:
            self.reuse_watch.rewound(int(self.layers[self.reuse_watch.layer_idx].get_seq_length()))

    @restores_layers_on_error(writes_in_place=True)
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """transformers' ``Cache.reorder_cache`` (beam search), every layer or none: an exception restores the dynamic
        layers and marks static ones interrupted (their rows move in place; :mod:`~hf_asymkv.core.rollback`)."""
        super().reorder_cache(beam_idx)

    @restores_layers_on_error()
    def batch_repeat_interleave(self, repeats: int) -> None:
        """transformers' ``Cache.batch_repeat_interleave``, every layer or none."""
        super().batch_repeat_interleave(repeats)

    @restores_layers_on_error()
    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """transformers' ``Cache.batch_select_indices``, every layer or none."""
        super().batch_select_indices(indices)

    def reset(self) -> None:
        """Empty every layer, keeping the layer objects (transformers' sliding-window layers too, on every release:
        :func:`~hf_asymkv.core.compat.reset_layer`)."""
        for layer in self.layers:
            reset_layer(layer)
        self.held_layer = None
        self.reuse_watch.rewound()

    @property
    def reuse_watch(self) -> ReuseWatch:
        """The :class:`~hf_asymkv.core.reuse.ReuseWatch` of this cache (made on first use; it watches nothing on a
        model without a quantized layer)."""
        if "_reuse_watch" not in self.__dict__:
            self._reuse_watch = ReuseWatch(next((i for i, lay in enumerate(self.layers)
                                                 if isinstance(lay, QUANTIZED_LAYERS)), None))
        return self._reuse_watch

    def activate_past_recording(self, **kwargs) -> None:
        """Make a rollback (``crop``) of the latest update's tokens exact: each update's tokens stay pending until
        the next update or crop (see :mod:`hf_asymkv.core.layer`), so quantization runs one update late and the
        window stays bounded. transformers' ``generate`` calls this for assisted decoding; from 5.25 it passes
        ``recurrent_states_to_keep=`` (meant for recurrent layers), forwarded to every layer as transformers' own
        ``Cache`` does. ``reset()`` turns it off."""
        for layer in self.layers:
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording(**kwargs)

    def _checked_key_ranges(self, key_absmax: dict | None, shapes: list[LayerShape], from_scales: bool) -> dict:
        """The calibrated ranges of the quantized layers, after checking that each layer's key spec can use one and
        that each has the layer's ``[kv_heads, head_dim]``: refused here, naming the layer, rather than at the first
        update deep inside ``generate``."""
        if key_absmax is None:
            return {}
        c = self.cache_config
        if c.key_granularity != "channel" or not c.key_symmetric or c.key_rotation:
            raise ValueError("calibrated key ranges are symmetric per-channel scales of unrotated keys: they need "
                             "key_granularity='channel', key_symmetric=True and key_rotation=False, got "
                             f"{c.key_granularity!r}, key_symmetric={c.key_symmetric}, key_rotation="
                             f"{c.key_rotation} (drop the scales, or override those settings).")
        if from_scales:  # a scales file covers every layer with KV; we use the full-attention ones
            key_absmax = {i: k for i, k in key_absmax.items() if i in self.layer_configs}
        bad = sorted(set(key_absmax) - set(self.layer_configs))
        if bad:
            raise ValueError(f"calibrated key ranges given for layers {bad}, which are not full-attention layers.")
        for i, k in sorted(key_absmax.items()):
            spec = self.layer_configs[i].key_spec
            if spec.granularity != "channel" or not spec.symmetric or spec.rotated:
                raise ValueError(f"layer {i}: its layer_overrides make keys {spec.fmt}/{spec.granularity} symmetric="
                                 f"{spec.symmetric} rotated={spec.rotated}, which cannot use a calibrated key range "
                                 "(symmetric per-channel, unrotated).")
            expected = (shapes[i].kv_heads, shapes[i].head_dim)
            if tuple(k.shape) != expected:
                raise ValueError(f"calibrated key range of layer {i} has shape {tuple(k.shape)}, the model's layer {i} "
                                 f"needs [kv_heads, head_dim] = {list(expected)} (scales of another model?)")
        return key_absmax

    @property
    def settings(self) -> dict:
        """The resolved settings (group sizes chosen for this model) as a plain dict."""
        return self.cache_config.settings()

    @property
    def key_spec(self):
        return self.cache_config.key_spec()

    @property
    def value_spec(self):
        return self.cache_config.value_spec()

    @classmethod
    def from_pretrained(cls, dir_or_repo_id: str | os.PathLike, config: PreTrainedConfig, *,
                        revision: str | None = None, token: str | None = None, **overrides) -> AsymKVCache:
        """A cache with published scales: a folder written by ``hf-asymkv publish`` or a Hub repo holding one.

        Args:
            dir_or_repo_id: local publish folder, or Hub repo id (downloads only ``kv_scales.safetensors``,
                ``asymkv_config.json`` and ``README.md``).
            config: the model config (``model.config``); the scales must belong to it.
            revision, token: for Hub repos.
            **overrides: ``AsymKVConfig`` settings that win over the published ones.

        Raises:
            ValueError: malformed publication or scales for another model (the message names the problem).
            OSError: not a local folder and the Hub download failed.

        Example::

            cache = AsymKVCache.from_pretrained("org/model-asymkv-scales", config=model.config)
            out = model.generate(**inputs, **cache_kwargs(cache), max_new_tokens=64)  # hf_asymkv.cache_kwargs
        """
        from .pretrained import load_published

        for name in ("scales", "key_absmax", "cache_config"):
            if name in overrides:
                raise ValueError(f"from_pretrained takes its ranges and settings from {dir_or_repo_id!r}; "
                                 f"do not pass {name}= (pass single settings as overrides).")
        if not isinstance(config, PreTrainedConfig):
            raise ValueError("config must be a transformers PreTrainedConfig (model.config), "
                             f"got {type(config).__name__}.")
        scales, cache_config = load_published(dir_or_repo_id, config, revision=revision, token=token)
        return cls(config, cache_config, scales=scales, **overrides)

    @classmethod
    def from_preset(cls, name: str, config: PreTrainedConfig, **overrides) -> AsymKVCache:
        """A cache with the settings of preset ``name`` (:data:`hf_asymkv.PRESETS`), ``overrides`` applied on top.

        Args:
            name: ``"quality"``, ``"balanced"``, ``"lean"``, ``"compact"``, ``"tight"`` or ``"max"`` (see the
                README's "Presets").
            config: the model config (``model.config``).
            **overrides: ``AsymKVConfig`` settings, ``scales=`` or ``key_absmax=`` (calibrated key ranges apply to
                symmetric per-channel keys only; ``compact`` and ``max`` refuse them), ``max_cache_len=`` (a static,
                compileable cache: see the class).

        Raises:
            ValueError: an unknown preset (the message lists the valid names) or an invalid override.

        Example::

            cache = AsymKVCache.from_preset("compact", model.config)
            static = AsymKVCache.from_preset("compact", model.config, max_cache_len=4096)  # for torch.compile
        """
        from .presets import preset_config

        extra = {k: overrides.pop(k) for k in ("scales", "key_absmax", "max_cache_len") if k in overrides}
        if "cache_config" in overrides:
            raise ValueError("from_preset builds the cache_config from the preset; pass single settings as overrides.")
        return cls(config, preset_config(name, **overrides), **extra)

    def _build_layers(self, text_config, key_absmax: dict[int, torch.Tensor], max_cache_len: int | None) -> list:
        # What DynamicCache (StaticCache for a static cache) builds for this config, one layer per layer type: reused
        # for every layer we do not quantize, so sliding windows, linear attention and KV-sharing layers behave
        # exactly as transformers'.
        if max_cache_len is None:
            layers = DynamicCache(config=text_config).layers
            for i, layer_config in self.layer_configs.items():
                if getattr(layers[i], "is_sliding", False):  # quantize_sliding: the window transformers gave it
                    layers[i] = SlidingAsymKVLayer(layer_config, int(layers[i].sliding_window),
                                                   key_absmax=key_absmax.get(i))
                else:
                    layers[i] = AsymKVLayer(layer_config, key_absmax=key_absmax.get(i))
            return layers
        layers = [StaticAsymKVLayer(c, max_cache_len, key_absmax=key_absmax.get(i))  # checks max_cache_len first
                  for i, c in self.layer_configs.items()]
        built = StaticCache(config=text_config, max_cache_len=max_cache_len).layers
        for i, layer in zip(self.layer_configs, layers):
            built[i] = layer
        return built

    def memory_footprint(self) -> dict[str, int | float]:
        """Real bytes of every tensor the cache holds, unused capacity included, and what full-precision caches
        holding the same tokens would take. The cache is counted as it is (nothing is quantized to count it): an
        update still held exact for a press (see the class) is the part ``pending_keys``/``pending_values``.

        Returns:
            - ``{part: bytes}`` for the quantized layers' parts (codes, scales, zeros, sinks, window,
              ``unused_capacity`` as an informational subset) and ``full_precision_layers`` for the layers kept
              exact (sliding windows);
            - ``total``: the sum of the parts, ``unused_capacity`` counted once;
            - ``model_dtype_equivalent``: the bytes of a ``DynamicCache`` in the model's own dtype (the dtype
              the K/V states arrive in: 4 bytes/element on an fp32 model, 2 on bf16/fp16) holding the same
              tokens: ``2 * itemsize * batch * kv_heads * seq * head_dim`` per layer, sliding layers at their
              own window. This is what a user compares against on their own model;
            - ``ratio_vs_model_dtype``: ``model_dtype_equivalent / total`` (how many times smaller than that
              ``DynamicCache``; 0.0 while empty);
            - ``bf16_equivalent``: a bf16 ``DynamicCache`` (2 bytes/element) holding the same tokens, whatever the
              model's dtype; on an fp32 model it is half of ``model_dtype_equivalent``;
            - ``total_on_bf16``: this cache's ``total`` on a bf16 model (its exact parts, stored in the model's dtype:
              sinks, window, pending tokens, full-precision layers, at 2 bytes per element; codes, scales and zeros
              have their own dtypes); ``ratio_vs_bf16``: ``bf16_equivalent / total_on_bf16``, how many times smaller
              than a bf16 ``DynamicCache``: the basis of the README's, the demo's and the presets table's ratios,
              the same on an fp32 and a bf16 model;
            - ``tokens``: the longest length a layer holds (the context the ratios are for);
            - a static cache (``max_cache_len``) also says ``allocated`` (``total``: every buffer is allocated at the
              first update, for ``max_cache_len`` tokens), ``bookkeeping`` (its lengths, counters, anchors and
              rotation matrices) and ``used`` (``total - unused_capacity - bookkeeping``: the bytes of the tokens
              held, what a dynamic cache with the same settings would hold, slack aside).
        """
        parts: Counter = Counter()
        equivalent: Counter = Counter()
        exact_itemsize = 2
        for layer in self.layers:
            if isinstance(layer, QUANTIZED_LAYERS):
                parts.update(layer.memory_footprint())
                if layer.is_initialized:
                    elements = layer.dense_elements()
                    equivalent["bf16"] += elements * 2
                    equivalent["model_dtype"] += elements * layer.dtype.itemsize
                    exact_itemsize = layer.dtype.itemsize
            else:  # transformers' own layer: every tensor it holds (K/V, recurrent states, compressor buffers)
                parts["full_precision_layers"] += tensor_nbytes([layer])
                # a DynamicCache holds the same layer: its K/V where it has them, else all it holds
                kv = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None]
                held = kv or list(reachable_tensors(layer))
                equivalent["bf16"] += sum(t.numel() * 2 if t.is_floating_point() else t.nbytes for t in held)
                equivalent["model_dtype"] += sum(t.nbytes for t in held)
        total = sum(v for k, v in parts.items() if k != "unused_capacity")
        exact = sum(v for k, v in parts.items() if k.startswith(EXACT_PARTS))
        on_bf16 = total - exact + exact * 2 // exact_itemsize
        used = total - parts["unused_capacity"] - parts["bookkeeping"]
        static = {"allocated": total, "used": used} if self.max_cache_len else {}
        return {**dict(parts), "total": total, "model_dtype_equivalent": equivalent["model_dtype"],
                "ratio_vs_model_dtype": equivalent["model_dtype"] / total if total else 0.0,
                "bf16_equivalent": equivalent["bf16"], "total_on_bf16": on_bf16,
                "ratio_vs_bf16": equivalent["bf16"] / on_bf16 if on_bf16 else 0.0,
                "tokens": max((int(layer.get_seq_length()) for layer in self.layers
                               if getattr(layer, "is_initialized", False) and hasattr(layer, "get_seq_length")),
                              default=0), **static}

    def stats(self) -> dict[str, int]:
        """Counters summed over layers: ``tokens_quantized``, ``blocks_quantized``, ``flushes``,
        ``key_overflow_channels``, ``key_widened_blocks``, ``key_clipped_values``, ``requantized_tokens`` (tokens a
        rollback returned from a block to the window, quantized again later), ``nonfinite_values`` (NaN/inf
        elements that reached a quantized block), read as the cache is (a held update counts once it is settled)."""
        total: Counter = Counter()
        for layer in self.layers:
            if isinstance(layer, QUANTIZED_LAYERS):
                total.update(layer.stats)
        keys = ("tokens_quantized", "blocks_quantized", "flushes", "key_overflow_channels", "key_widened_blocks",
                "key_clipped_values", "requantized_tokens", "nonfinite_values")
        return {k: int(total.get(k, 0)) for k in keys} | {k: int(v) for k, v in total.items() if k not in keys}

    def __repr__(self) -> str:
        static = f", max_cache_len={self.max_cache_len}" if self.max_cache_len else ""
        return f"AsymKVCache({self.cache_config.describe()}, layers={len(self.layers)}{static})"
