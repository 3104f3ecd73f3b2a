"""Named settings, chosen by measurement: ``AsymKVCache.from_preset("compact", model.config)``.

Each preset is an :class:`~hf_asymkv.core.config.AsymKVConfig` built from :data:`~hf_asymkv.core.registry.PRESET_SETTINGS`
(plain settings, readable without torch; each entry says why it is shaped so). Their bytes and damage on the
default model are in the README ("Presets"), measured by ``scripts/presets_table.py`` (``results/presets/``).
"""

from __future__ import annotations

from .config import AsymKVConfig
from .registry import PRESET_NAMES, PRESET_SETTINGS

__all__ = ["PRESETS", "preset_config", "preset_names"]

PRESETS: dict[str, AsymKVConfig] = {name: AsymKVConfig(**settings) for name, settings in PRESET_SETTINGS.items()}


def preset_names() -> list[str]:
    return list(PRESET_NAMES)


def preset_config(name: str, **overrides) -> AsymKVConfig:
    """The preset called ``name`` with ``overrides`` (any ``AsymKVConfig`` field) applied.

    Raises:
        ValueError: an unknown name (the message lists the presets) or an invalid override.
    """
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}; presets: {preset_names()}.")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
