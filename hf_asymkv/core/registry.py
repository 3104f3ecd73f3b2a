"""The names the settings accept and the presets, as plain Python: importing this loads neither torch nor
transformers, so the command line builds its choices and help from it (``hf-asymkv --help`` stays fast) and the
core builds its objects from it (:class:`~hf_asymkv.core.config.AsymKVConfig`, :data:`hf_asymkv.PRESETS`): each
name is written once.
"""

from __future__ import annotations

__all__ = ["KEY_FORMATS", "LAYER_SETTINGS", "OVERFLOW_POLICIES", "PRESET_NAMES", "PRESET_SETTINGS", "VALUE_BITS"]

KEY_FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2", "int4", "int3", "int2")
"""Key storage formats: 8-bit (int8 by measurement, see README) for use; 4/3/2-bit for ablations and presets."""
VALUE_BITS = (1, 2, 3, 4, 5, 6, 8)
"""Value code widths (asymmetric integer, scale + zero per group, unless ``value_symmetric``); 3, 5 and 6 bits
are packed as two bit-plane sets (exactly ``bits / 8`` bytes per value)."""
OVERFLOW_POLICIES = ("widen", "clip", "error")
"""What a calibrated layer does with a key beyond its range: widen that block's scale (counted), saturate
(counted), or raise ``ValueError``."""
LAYER_SETTINGS = ("key_format", "value_bits", "value_group_size", "key_block_size", "residual_length", "sink_tokens",
                  "key_granularity", "key_group_size", "value_granularity", "value_symmetric", "key_symmetric",
                  "value_rotation", "key_rotation", "key_wide_fraction", "overflow_policy")
"""Settings a per-layer override may change (buffer growth is the whole cache's)."""

# Each preset: AsymKVConfig fields over its defaults, and why it is shaped so (its bytes and damage are measured
# by scripts/presets_table.py into results/presets/, quoted in the README's presets table).
PRESET_SETTINGS: dict[str, dict] = {
    # least damage at >= 2x: 8-bit keys, 6-bit rotated values
    "quality": dict(key_format="int8", value_bits=6, value_rotation=True, sink_tokens=4, residual_length=64),
    # the default (AsymKVConfig() equals it): 8-bit keys, 4-bit rotated values, 4 exact sinks, window 64
    "balanced": dict(key_format="int8", value_bits=4, value_rotation=True, sink_tokens=4, residual_length=64),
    # between balanced and compact: asymmetric int4 keys per channel in 32-token blocks, 4-bit rotated values
    "lean": dict(key_format="int4", key_symmetric=False, key_block_size=32, value_bits=4, value_rotation=True,
                 sink_tokens=4, residual_length=32),
    # >= 3.5x: KIVI-like int4 keys in 64-token blocks with a fifth bit for each block's widest quarter of the key
    # channels (half the attention KL, on outlier-heavy keys too), 3-bit rotated values; the window of 32 pays for the
    # fifth bits (results/key_channel_bits/wide_channels.md)
    "compact": dict(key_format="int4", key_symmetric=False, key_block_size=64, key_wide_fraction=0.25, value_bits=3,
                    value_rotation=True, sink_tokens=4, residual_length=32),
    # just under 5x for far less damage than max: int3 keys in 64-token blocks, 2-bit rotated values, window 32
    "tight": dict(key_format="int3", key_symmetric=False, key_block_size=64, value_bits=2, value_rotation=True,
                  sink_tokens=4, residual_length=32),
    # >= 5x, lossy: tight's keys with a fourth bit on each block's widest quarter of channels, paid for by 1-bit
    # rotated values (two fitted levels per token); against the int2-key / 2-bit-value max before 2026-12-05 it is
    # smaller (5.6x vs 5.2x) with 2.3x less attention KL and 1 stress needle prompt lost instead of 5
    # (results/value_bits/stress_qwen_max.md)
    "max": dict(key_format="int3", key_symmetric=False, key_block_size=64, key_wide_fraction=0.25, value_bits=1,
                value_rotation=True, sink_tokens=4, residual_length=32),
}
PRESET_NAMES = tuple(PRESET_SETTINGS)
"""The presets, least compressed first: ``AsymKVCache.from_preset(name, ...)``, scheme ``asymkv-<name>``."""
