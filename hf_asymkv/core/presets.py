"""Named settings, chosen by measurement: ``AsymKVCache.from_preset("compact", model.config)``.

Each preset is an :class:`~hf_asymkv.core.config.AsymKVConfig`; its bytes and damage on the default model are
in the README ("Presets"), measured by ``scripts/presets_table.py`` (``results/presets/``). Ratios below are
``memory_footprint()`` totals (capacity included) against a bf16 ``DynamicCache`` after a 4096-token prefill
of SmolLM2-135M (head_dim 64), as measured in ``results/presets/smollm2.md``.
"""

from __future__ import annotations

from .config import AsymKVConfig

__all__ = ["PRESETS", "preset_config", "preset_names"]

PRESETS: dict[str, AsymKVConfig] = {
    # least damage at >= 2x: 8-bit K, 6-bit rotated V (2.11x)
    "quality": AsymKVConfig(key_format="int8", value_bits=6, value_rotation=True, sink_tokens=4, residual_length=64),
    # the default (AsymKVConfig() equals it): the 0.1 default's bytes (2.42x) with 3.2x less tail KL: rotated V,
    # 4 exact sinks, window 64
    "balanced": AsymKVConfig(key_format="int8", value_bits=4, value_rotation=True, sink_tokens=4, residual_length=64),
    # between balanced and compact (3.25x): K int4 asymmetric per channel in 32-token blocks, V int4 rotated; on
    # Gemma-3-270M the smallest setting of ours with KIVI-4's accuracy (README, Frontier)
    "lean": AsymKVConfig(key_format="int4", key_symmetric=False, key_block_size=32, value_bits=4,
                         value_rotation=True, sink_tokens=4, residual_length=32),
    # >= 3.5x (3.66x): K int4 asymmetric per channel in 64-token blocks (KIVI-like), V int3 rotated, window 64 (the
    # 32-token groups and window of 0.2's first compact lost 1 of 48 needle prompts on SmolLM2; these lose none)
    "compact": AsymKVConfig(key_format="int4", key_symmetric=False, key_block_size=64, value_bits=3,
                            value_rotation=True, sink_tokens=4, residual_length=64),
    # just under 5x (4.995x) for far less damage than max: K int3 asymmetric per channel in 64-token blocks, V int2
    # rotated, window 32
    "tight": AsymKVConfig(key_format="int3", key_symmetric=False, key_block_size=64, value_bits=2,
                          value_rotation=True, sink_tokens=4, residual_length=32),
    # >= 5x (5.23x), lossy: K int2 asymmetric per channel in 32-token blocks, V int2 rotated
    "max": AsymKVConfig(key_format="int2", key_symmetric=False, key_block_size=32, value_bits=2,
                        value_rotation=True, sink_tokens=4, residual_length=64),
}


def preset_names() -> list[str]:
    return list(PRESETS)


def preset_config(name: str, **overrides) -> AsymKVConfig:
    """The preset called ``name`` with ``overrides`` (any ``AsymKVConfig`` field) applied.

    Raises:
        ValueError: an unknown name (the message lists the presets) or an invalid override.
    """
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}; presets: {preset_names()}.")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
