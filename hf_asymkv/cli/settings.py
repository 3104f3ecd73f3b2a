"""The cache settings the command line offers (key formats, value widths, overflow policies, the
``AsymKVConfig`` defaults, the preset names), taken from the core's own definitions without importing torch.

``--help`` must not import torch (``tests/cli/test_cli_app.py``), and the core's ``config.py`` does. The names
come from the core's torch-free registry (:mod:`hf_asymkv.core.registry`); the ``AsymKVConfig`` defaults (the
dataclass's literal field defaults, which the registry does not hold) are read from the source of ``config.py``
with :mod:`ast`. Either way they are the core's values, not copies kept beside them, so the choices and the
defaults ``--help`` shows cannot drift from what the cache accepts; ``tests/cli/test_settings.py`` holds them equal
to the imported ones.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CoreSettings", "core_settings"]

_CORE = Path(__file__).resolve().parents[1] / "core"


@dataclass(frozen=True)
class CoreSettings:
    """What the core accepts and defaults to, as the CLI offers it."""

    key_formats: tuple[str, ...]
    value_bits: tuple[int, ...]
    overflow_policies: tuple[str, ...]
    presets: tuple[str, ...]
    defaults: dict  # AsymKVConfig field -> default value


def _module(name: str) -> ast.Module:
    path = _CORE / f"{name}.py"
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _field_defaults(tree: ast.Module, cls: str) -> dict:
    """``{field: literal default}`` of the dataclass ``cls`` in ``tree`` (fields without a literal default are
    left out)."""
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if node is None:
        raise LookupError(f"hf_asymkv.core: no class {cls}")
    defaults = {}
    for f in node.body:
        if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name) and f.value is not None:
            try:
                defaults[f.target.id] = ast.literal_eval(f.value)
            except ValueError:  # a default_factory or an expression: not a setting the CLI offers
                continue
    return defaults


@functools.cache
def core_settings() -> CoreSettings:
    """The core's setting names and defaults (read once, a few milliseconds; no torch).

    Raises:
        LookupError: the core no longer defines one of the names as a literal (a test catches it first).
    """
    from ..core import registry

    names = (registry.KEY_FORMATS, registry.VALUE_BITS, registry.OVERFLOW_POLICIES, registry.PRESET_NAMES)
    return CoreSettings(*map(tuple, names), defaults=_field_defaults(_module("config"), "AsymKVConfig"))
