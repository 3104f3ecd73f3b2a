"""The cache settings the command line offers (key formats, value widths, overflow policies, the
``AsymKVConfig`` defaults, the preset names), taken from the core's own definitions without importing torch.

``--help`` must not import torch (``tests/cli/test_cli_app.py``), and the core's ``config.py`` does. The names
come from the core's torch-free registry (``hf_asymkv/core/registry.py``) where it exists; before it, and for
the ``AsymKVConfig`` defaults (the dataclass's literal field defaults, which the registry does not hold), they
are read from the source of ``config.py`` / ``presets.py`` with :mod:`ast`. Either way they are the core's values,
not copies kept beside them, so the choices and the defaults ``--help`` shows cannot drift from what the cache
accepts; ``tests/cli/test_settings.py`` holds them equal to the imported ones.

Note for the merge: once ``core/registry.py`` is on main, :func:`_names_from_source` can go.
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


def _assigned(tree: ast.Module, name: str) -> ast.expr:
    """The value node of the top-level ``name = ...`` (or ``name: T = ...``) of ``tree``."""
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
            return node.value
    raise LookupError(f"hf_asymkv.core: no top-level assignment of {name}")


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


def _names_from_source(config: ast.Module) -> tuple[tuple, tuple, tuple, tuple]:
    """``(key formats, value bits, overflow policies, preset names)`` from ``config.py`` and ``presets.py``."""
    preset_dict = _assigned(_module("presets"), "PRESETS")
    if not isinstance(preset_dict, ast.Dict):
        raise LookupError("hf_asymkv.core.presets: PRESETS is not a dict literal")
    return (tuple(ast.literal_eval(_assigned(config, "KEY_FORMATS"))),
            tuple(ast.literal_eval(_assigned(config, "VALUE_BITS"))),
            tuple(ast.literal_eval(_assigned(config, "OVERFLOW_POLICIES"))),
            tuple(ast.literal_eval(key) for key in preset_dict.keys))


@functools.cache
def core_settings() -> CoreSettings:
    """The core's setting names and defaults (read once, a few milliseconds; no torch).

    Raises:
        LookupError: the core no longer defines one of the names as a literal (a test catches it first).
    """
    config = _module("config")
    if (_CORE / "registry.py").is_file():  # the core's torch-free names (round 3)
        from ..core import registry

        names = (registry.KEY_FORMATS, registry.VALUE_BITS, registry.OVERFLOW_POLICIES, registry.PRESET_NAMES)
    else:
        names = _names_from_source(config)
    return CoreSettings(*map(tuple, names), defaults=_field_defaults(config, "AsymKVConfig"))
