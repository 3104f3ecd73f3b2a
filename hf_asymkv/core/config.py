"""`AsymKVConfig`: every setting of the cache, declared and validated in one place.

`AsymKVCache`, the published ``asymkv_config.json``, the presets and the command line all read this one
frozen dataclass. A config is model-agnostic: group sizes may be left to ``None`` and are resolved against a
model's head dims by :meth:`AsymKVConfig.resolved`. What one layer needs of it is a :class:`LayerConfig`
(:meth:`AsymKVConfig.layer_config`): its two :class:`~hf_asymkv.core.quant.QuantSpec` (block size included),
window, sinks, overflow policy and buffer :class:`Growth`; layers and stores take that one object.

Per-layer overrides (``layer_overrides={0: {"key_format": "int8"}, -1: {...}}``) change any of
:data:`~hf_asymkv.core.registry.LAYER_SETTINGS` for given layer indices (negative ones count from the last layer); they are validated
when the config is built (each override must make a valid config) and again when the model is known
(:meth:`AsymKVConfig.layer_configs`: indices in range and naming quantized layers, group sizes that divide that
layer's head_dim). A preset may carry them; the cache, its footprint and both attention paths read each layer's
own :class:`LayerConfig`.

The dict form (:meth:`AsymKVConfig.to_dict`) carries ``config_version``; :meth:`AsymKVConfig.from_dict`
reads every version it knows and refuses newer ones by name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .quant import GRANULARITIES, QuantSpec
from .registry import KEY_FORMATS, LAYER_SETTINGS, OVERFLOW_POLICIES, VALUE_BITS

__all__ = ["AsymKVConfig", "CONFIG_VERSION", "Growth", "KEY_FORMATS", "LAYER_SETTINGS", "LEGACY_DEFAULTS", "LayerConfig",
           "OVERFLOW_POLICIES", "SUPPORTED_CONFIG_VERSIONS", "VALUE_BITS"]

CONFIG_VERSION = 5
"""Version of the dict form written by :meth:`AsymKVConfig.to_dict`: 2 added ``key_symmetric``, ``key_rotation``
and ``value_rotation``; 3 changed the defaults to the ``balanced`` preset (4 sinks, window 64, rotated V); 4 added
``layer_overrides`` (absent before: no overrides); 5 added ``key_wide_fraction`` (absent before: 0, none). A field missing from an older dict takes the default of that
dict's version (:data:`LEGACY_DEFAULTS`), so a stored config keeps its meaning."""
SUPPORTED_CONFIG_VERSIONS = (1, 2, 3, 4, 5)
"""``config_version`` values :meth:`AsymKVConfig.from_dict` reads."""
LEGACY_DEFAULTS = {"residual_length": 128, "sink_tokens": 0, "value_rotation": False}
"""Defaults of config versions 1 and 2 that version 3 changed (key_symmetric/key_rotation kept theirs)."""


def _check_choice(name: str, value, allowed) -> None:
    if isinstance(value, bool) and not any(isinstance(a, bool) for a in allowed) or value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}.")


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")


@dataclass(frozen=True)
class Growth:
    """How a growable buffer's capacity grows when full.

    Args:
        factor: capacity multiplier (>= 1; 1 grows by exactly what is needed).
        max_tokens: the most token rows one growth adds, bounding unused memory.
    """

    factor: float = 1.25
    max_tokens: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) or not self.factor >= 1:
            raise ValueError(f"growth factor must be a number >= 1, got {self.factor!r}.")
        _check_int("max_tokens", self.max_tokens, 1)

    def capacity(self, current: int, needed: int, multiple: int = 1, max_step: int | None = None) -> int:
        """New capacity (rows) for a buffer of ``current`` rows that must hold ``needed``: ``factor`` x, by at most
        ``max_step`` rows (default ``max_tokens``), never less than ``needed``, rounded up to ``multiple``."""
        step = math.ceil(current * (self.factor - 1))
        step = min(step, self.max_tokens if max_step is None else max_step)
        return -(-max(needed, current + step) // multiple) * multiple


@dataclass(frozen=True)
class LayerConfig:
    """Everything one quantized layer needs: what :class:`~hf_asymkv.core.layer.AsymKVLayer` and its stores take.

    Args:
        key_spec, value_spec: how K and V blocks are stored; both carry the layer's ``block_size``.
        residual_length: newest tokens kept exact.
        sink_tokens: first tokens kept exact.
        overflow_policy: one of :data:`OVERFLOW_POLICIES` (calibrated key ranges).
        growth: how the buffers grow.

    Raises:
        ValueError: specs with different block sizes, a negative window or sink count, an unknown policy.
    """

    key_spec: QuantSpec
    value_spec: QuantSpec
    residual_length: int = 128
    sink_tokens: int = 0
    overflow_policy: str = "widen"
    growth: Growth = Growth()

    def __post_init__(self) -> None:
        if self.key_spec.block_size != self.value_spec.block_size:
            raise ValueError("K and V of a layer are quantized in the same blocks: key_spec.block_size="
                             f"{self.key_spec.block_size} and value_spec.block_size={self.value_spec.block_size} differ.")
        _check_int("residual_length", self.residual_length, 0)
        _check_int("sink_tokens", self.sink_tokens, 0)
        _check_choice("overflow_policy", self.overflow_policy, OVERFLOW_POLICIES)

    @property
    def block_size(self) -> int:
        return self.key_spec.block_size


@dataclass(frozen=True)
class AsymKVConfig:
    """How an :class:`~hf_asymkv.AsymKVCache` stores K and V. The defaults are the ``balanced`` preset (K int8 per
    channel, V int4 per token rotated, 4 sink tokens and a 64-token window exact; README, Presets).

    Args:
        key_format: one of :data:`KEY_FORMATS`; ``int8`` by default (measured, see README).
        value_bits: one of :data:`VALUE_BITS`. 1 stores each group's elements as one of two levels fitted to it
            (2-means, see :func:`~hf_asymkv.core.quant.compute_scale_zero`): asymmetric, per token or channel only.
        value_group_size: channels per V scale; must divide every quantized layer's head_dim. ``None``: the
            largest such divisor <= 128 (``min(head_dim, 128)`` for the usual head dims 64/128/256).
        key_block_size: tokens per quantized block; K per-channel scales are per block.
        residual_length: newest tokens kept in the model dtype (>= 0).
        sink_tokens: first tokens kept in the model dtype (>= 0).
        key_granularity: ``"channel"`` (default), ``"token"`` or ``"tensor"`` (baselines).
        key_group_size: channels per K scale for ``key_granularity="token"`` (``None``: head_dim).
        value_granularity: ``"token"`` (default), ``"channel"`` or ``"tensor"`` (baselines).
        value_symmetric: symmetric V codes (the symmetric K4V4 baseline); default asymmetric.
        key_symmetric: symmetric K codes (default). ``False``: scale and zero per (channel, block), KIVI-style,
            for the low-bit integer key formats; calibrated key ranges need ``True``.
        value_rotation: store V rotated by an orthonormal Hadamard matrix along head_dim
            (:mod:`~hf_asymkv.core.rotation`) before quantizing; reads rotate back (the fused attention rotates
            only its output). Exact sinks and window stay unrotated.
        key_rotation: the same for K (an ablation: it spreads the per-channel outliers that the per-channel
            scales exist for; not used by any preset, and refused with calibrated key ranges).
        key_wide_fraction: the share of each block's key channels (per KV head) whose codes get one more bit,
            chosen by the block's own ranges when it is quantized (:mod:`~hf_asymkv.core.wide`; ``compact`` uses 0.25:
            16 of 64 channels). 0 (default) for none; else in (0, 1), for int2/int3/int4 keys per channel, unrotated.
        overflow_policy: one of :data:`OVERFLOW_POLICIES`.
        growth_factor: capacity multiplier of the buffers (> 1; amortized O(1) appends).
        max_growth_tokens: the most capacity (tokens) one growth adds, bounding unused memory.
        quantize_sliding: also quantize the sliding-window layers (``layer_type="sliding_attention"``: Gemma-3's
            5 of 6, Mistral's, gpt-oss's half), as the full-attention ones, dropping each whole block once it has left
            the window (:class:`~hf_asymkv.core.sliding_layer.SlidingAsymKVLayer`); off by default: they stay transformers'
            own exact layers, which hold at most ``sliding_window - 1`` tokens whatever the context. Worth it where
            the windows are a large share of the cache (Gemma-3-270M at 16k: 1/7 of a bf16 cache, see
            docs/prompt_cache.md). Dynamic caches only; no sinks in those layers (the window leaves them behind).
        layer_overrides: ``{layer index: {setting: value}}`` for settings of :data:`~hf_asymkv.core.registry.LAYER_SETTINGS` that differ
            in given layers (e.g. ``{0: {"key_format": "int8", "key_symmetric": True}}`` to protect layer 0);
            negative indices count from the last layer. An override that gives a layer keys without wide channels
            (int8/fp8, per token, rotated) and does not name ``key_wide_fraction`` drops the config's wide channels
            there. Stored normalized (sorted ``(index, ((setting, value), ...))`` pairs, so the config stays
            immutable and hashable); :meth:`overrides` gives the dict form.

    Raises:
        ValueError: any field out of range (the message names the field, the value and what is allowed); an
            override that is not a valid setting (the message names the layer).
    """

    key_format: str = "int8"
    value_bits: int = 4
    value_group_size: int | None = None
    key_block_size: int = 128
    residual_length: int = 64
    sink_tokens: int = 4
    key_granularity: str = "channel"
    key_group_size: int | None = None
    value_granularity: str = "token"
    value_symmetric: bool = False
    key_symmetric: bool = True
    value_rotation: bool = True
    key_rotation: bool = False
    key_wide_fraction: float = 0.0
    overflow_policy: str = "widen"
    growth_factor: float = 1.25
    max_growth_tokens: int = 256
    quantize_sliding: bool = False
    layer_overrides: Mapping[int, Mapping[str, Any]] | tuple = ()

    def __post_init__(self) -> None:
        _check_choice("key_format", self.key_format, KEY_FORMATS)
        _check_choice("value_bits", self.value_bits, VALUE_BITS)
        _check_choice("key_granularity", self.key_granularity, GRANULARITIES)
        _check_choice("value_granularity", self.value_granularity, GRANULARITIES)
        _check_choice("overflow_policy", self.overflow_policy, OVERFLOW_POLICIES)
        for name in ("value_symmetric", "key_symmetric", "value_rotation", "key_rotation", "quantize_sliding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if not self.key_symmetric and self.key_format.startswith("fp8"):
            raise ValueError(f"key_symmetric=False needs an integer key_format, got {self.key_format!r} (float "
                             "formats are symmetric).")
        if self.value_bits == 1 and (self.value_symmetric or self.value_granularity == "tensor"):
            raise ValueError(f"value_bits=1 needs asymmetric values per 'token' or 'channel' (two fitted levels per "
                             f"group); got value_symmetric={self.value_symmetric}, "
                             f"value_granularity={self.value_granularity!r}.")
        wide = self.key_wide_fraction
        if isinstance(wide, bool) or not isinstance(wide, (int, float)) or not 0 <= wide < 1:
            raise ValueError(f"key_wide_fraction must be a number in [0, 1), got {wide!r}.")
        if wide and not _takes_wide_channels({k: getattr(self, k) for k in _WIDE_KEYS}):
            raise ValueError(f"key_wide_fraction={wide} needs int4, int3 or int2 keys per 'channel', unrotated; got "
                             f"key_format={self.key_format!r}, key_granularity={self.key_granularity!r}, "
                             f"key_rotation={self.key_rotation}.")
        _check_int("key_block_size", self.key_block_size, 1)
        _check_int("residual_length", self.residual_length, 0)
        _check_int("sink_tokens", self.sink_tokens, 0)
        _check_int("max_growth_tokens", self.max_growth_tokens, 1)
        for name in ("value_group_size", "key_group_size"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        growth = self.growth_factor
        if isinstance(growth, bool) or not isinstance(growth, (int, float)) or not growth > 1:
            raise ValueError(f"growth_factor must be a number > 1, got {growth!r}.")
        object.__setattr__(self, "layer_overrides", _normalized_overrides(self.layer_overrides))
        for index, _ in self.layer_overrides:
            self.for_layer(index)  # each override must make a valid config (raises naming the layer)

    # ------------------------------------------------------------------ construction
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, **settings) -> AsymKVConfig:
        """``AsymKVConfig(**settings)`` with a ``ValueError`` (not ``TypeError``) naming unknown settings."""
        unknown = sorted(set(settings) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown AsymKVCache settings {unknown}; allowed: {list(cls.field_names())}.")
        return cls(**settings)

    def replace(self, **overrides) -> AsymKVConfig:
        """A copy with ``overrides`` applied (validated like a new config)."""
        return self.from_kwargs(**{**self.settings(), **overrides})

    def overrides(self) -> dict[int, dict[str, Any]]:
        """``layer_overrides`` as ``{layer index: {setting: value}}`` (a new dict)."""
        return {index: dict(settings) for index, settings in self.layer_overrides}

    def for_layer(self, index: int) -> AsymKVConfig:
        """The settings of layer ``index`` as written (an index of ``layer_overrides``, negative ones as given): this
        config with that layer's override applied and no overrides of its own.

        Raises:
            ValueError: the override does not make a valid config (the message names the layer).
        """
        override = dict(dict(self.layer_overrides).get(index, ()))
        if self.key_wide_fraction and "key_wide_fraction" not in override and not _takes_wide_channels(
                {**{k: getattr(self, k) for k in _WIDE_KEYS}, **override}):
            override["key_wide_fraction"] = 0.0  # keys the override makes int8/fp8/rotated/per-token have none
        try:
            return dataclasses.replace(self, layer_overrides=(), **override)
        except ValueError as exc:
            raise ValueError(f"layer_overrides[{index}]: {exc}") from None

    # ------------------------------------------------------------------ dict form
    def settings(self) -> dict:
        """The fields as a plain dict: JSON scalars, and ``layer_overrides`` as ``{index: {setting: value}}``."""
        return {**dataclasses.asdict(self), "layer_overrides": self.overrides()}

    def to_dict(self) -> dict:
        """``{"config_version": CONFIG_VERSION, <every field>}``: what ``asymkv_config.json`` stores. ``quantize_sliding``
        only when set: a file that does not use it stays readable by the 0.1 releases, which do not know it."""
        settings = self.settings()
        if not settings["quantize_sliding"]:
            del settings["quantize_sliding"]
        return {"config_version": CONFIG_VERSION, **settings}

    @classmethod
    def from_dict(cls, data, where: str = "settings") -> AsymKVConfig:
        """Read :meth:`to_dict` output (no ``config_version`` means 1; a missing field takes the default of the
        dict's version: before version 3, a 128-token window, no sinks and unrotated V).

        Raises:
            ValueError: not a dict, an unsupported version, unknown keys, non-scalar or invalid values; the
                message starts with ``where``.
        """
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")
        data = dict(data)
        version = data.pop("config_version", 1)
        if version not in SUPPORTED_CONFIG_VERSIONS:
            raise ValueError(f"{where}: config_version {version!r} is not supported (supported: "
                             f"{list(SUPPORTED_CONFIG_VERSIONS)}); upgrade hf-asymkv")
        if version < 3:
            data = {**LEGACY_DEFAULTS, **data}
        try:
            if "layer_overrides" in data:
                data["layer_overrides"] = _overrides_from_json(data["layer_overrides"])
            for key, value in data.items():
                if key != "layer_overrides" and not _is_scalar(value):
                    raise ValueError(f"setting {key!r} must be a JSON scalar, got {value!r}")
            return cls.from_kwargs(**data)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    # ------------------------------------------------------------------ per model
    def resolved(self, head_dims: list[int]) -> AsymKVConfig:
        """This config with group sizes chosen for ``head_dims`` (every quantized layer's head_dim).

        Raises:
            ValueError: a group size that does not divide every head_dim (the message lists the divisors).
        """
        g = math.gcd(*head_dims)
        value_group = self.value_group_size
        if value_group is None:  # largest divisor of every head_dim that is <= 128
            value_group = max(d for d in range(1, min(g, 128) + 1) if g % d == 0)
        key_group = g if self.key_group_size is None else self.key_group_size
        for name, size in (("value_group_size", value_group), ("key_group_size", key_group)):
            if any(hd % size for hd in head_dims):
                divisors = [d for d in range(1, g + 1) if g % d == 0]
                hd_text = f"head_dim={head_dims[0]}" if len(set(head_dims)) == 1 else f"every head_dim {head_dims}"
                raise ValueError(f"{name} must divide {hd_text} (one of {divisors}), got {size}.")
        return dataclasses.replace(self, value_group_size=value_group, key_group_size=key_group)

    def key_spec(self) -> QuantSpec:
        """Keys: symmetric unless ``key_symmetric=False``, bf16 scales (a resolved config: group sizes set)."""
        return QuantSpec(self.key_format, self.key_granularity, self.key_group_size, self.key_symmetric,
                         torch.bfloat16, rotated=self.key_rotation, block_size=self.key_block_size,
                         wide_fraction=self.key_wide_fraction)

    def value_spec(self) -> QuantSpec:
        """Values: asymmetric (unless ``value_symmetric``), fp16 scale and zero, in the keys' blocks."""
        return QuantSpec(f"int{self.value_bits}", self.value_granularity, self.value_group_size,
                         self.value_symmetric, torch.float16, rotated=self.value_rotation,
                         block_size=self.key_block_size)

    def layer_config(self) -> LayerConfig:
        """What one layer takes, without overrides (a resolved config: group sizes set)."""
        return LayerConfig(self.key_spec(), self.value_spec(), self.residual_length, self.sink_tokens,
                           self.overflow_policy, Growth(self.growth_factor, self.max_growth_tokens))

    def layer_configs(self, head_dims: Mapping[int, int | tuple[int, ...]], layer_types: list[str]
                      ) -> dict[int, LayerConfig]:
        """Each quantized layer's :class:`LayerConfig`, overrides applied (a resolved config: group sizes set).

        Args:
            head_dims: ``{layer index: head_dim}`` of the layers that quantize, or ``{layer index: (widths)}`` where
                keys and values differ in width (group sizes then divide both).
            layer_types: every layer's cache type (their count bounds the indices; named in errors).

        Raises:
            ValueError: an override index out of range, naming a layer twice (``i`` and ``i - n``) or naming a
                layer that does not quantize, or a group size that does not divide that layer's head_dim (the
                message names the layer).
        """
        n = len(layer_types)
        chosen: dict[int, int] = {}
        for index, _ in self.layer_overrides:
            i = index + n if index < 0 else index
            if not 0 <= i < n:
                raise ValueError(f"layer_overrides names layer {index}, but the model has {n} layers (indices 0 to "
                                 f"{n - 1}, or -1 to -{n} from the end).")
            if i in chosen:
                raise ValueError(f"layer_overrides names layer {i} twice (as {chosen[i]} and {index}).")
            if i not in head_dims:
                raise ValueError(f"layer_overrides names layer {index}, a {layer_types[i]!r} layer that is not "
                                 f"quantized; overrides apply to the quantized layers {sorted(head_dims)}.")
            chosen[i] = index
        configs = {}
        for i, head_dim in head_dims.items():
            layer = self.for_layer(chosen[i]) if i in chosen else dataclasses.replace(self, layer_overrides=())
            try:
                configs[i] = layer.resolved(list(head_dim) if isinstance(head_dim, tuple) else [head_dim]).layer_config()
            except ValueError as exc:
                raise ValueError(f"layer {i}: {exc}") from None
        return configs

    def describe(self) -> str:
        """One line for ``repr`` and logs."""
        key = f"K={self.key_format}{'' if self.key_symmetric else '-asym'}/{self.key_granularity}"
        key += f"+{self.key_wide_fraction:g} wide" if self.key_wide_fraction else ""
        value = f"V=int{self.value_bits}/{self.value_granularity}(g={self.value_group_size})"
        rotated = [kind for kind, on in (("K", self.key_rotation), ("V", self.value_rotation)) if on]
        overridden = [index for index, _ in self.layer_overrides]
        return (f"{key}, {value}, block={self.key_block_size}, window={self.residual_length}, "
                f"sinks={self.sink_tokens}" + (f", rotated={'+'.join(rotated)}" if rotated else "")
                + (f", overrides for layers {overridden}" if overridden else "")
                + (", sliding layers quantized" if self.quantize_sliding else ""))


_WIDE_KEYS = ("key_format", "key_granularity", "key_rotation")


def _takes_wide_channels(keys: Mapping[str, Any]) -> bool:
    """Whether keys of these :data:`_WIDE_KEYS` settings can have wide channels: int2-int4 per channel, unrotated."""
    return keys["key_format"] in ("int4", "int3", "int2") and keys["key_granularity"] == "channel" \
        and not keys["key_rotation"]


def _is_scalar(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _normalized_overrides(value) -> tuple:
    """``{index: {setting: value}}`` (or its normalized form) -> sorted ``((index, ((setting, value), ...)), ...)``.

    Raises:
        ValueError: not a mapping of int layer indices to mappings of :data:`~hf_asymkv.core.registry.LAYER_SETTINGS`.
    """
    items = value.items() if isinstance(value, Mapping) else value
    if not isinstance(value, (Mapping, tuple)):
        raise ValueError(f"layer_overrides must be a dict {{layer index: {{setting: value}}}}, got {value!r}.")
    normalized = {}
    for index, settings in items:
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"layer_overrides keys must be layer indices (int), got {index!r}.")
        settings = dict(settings.items() if isinstance(settings, Mapping) else settings)
        unknown = sorted(set(settings) - set(LAYER_SETTINGS))
        if unknown:
            raise ValueError(f"layer_overrides[{index}]: unknown or not per-layer settings {unknown}; allowed: "
                             f"{list(LAYER_SETTINGS)}.")
        normalized[index] = tuple(sorted(settings.items()))
    return tuple(sorted(normalized.items()))


def _overrides_from_json(value) -> dict[int, dict]:
    """The JSON form of ``layer_overrides`` (string keys) -> ``{int: {setting: scalar}}``."""
    if not isinstance(value, dict):
        raise ValueError(f"layer_overrides must be a JSON object, got {value!r}")
    out = {}
    for key, settings in value.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"layer_overrides keys must be layer indices, got {key!r}") from None
        if not isinstance(settings, dict) or not all(_is_scalar(v) for v in settings.values()):
            raise ValueError(f"layer_overrides[{key}] must be an object of JSON scalars, got {settings!r}")
        out[index] = settings
    return out
