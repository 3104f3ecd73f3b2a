"""The cache settings the command line offers (key formats, value widths, overflow policies, the
``AsymKVConfig`` defaults, the preset names), read from the core's own definitions without running them.

The core's modules import torch, and ``--help`` must not (``tests/cli/test_cli_app.py``). So the values are read
from the source of ``hf_asymkv/core/config.py`` and ``presets.py`` with :mod:`ast`: the literal tuples
``KEY_FORMATS``, ``VALUE_BITS`` and ``OVERFLOW_POLICIES``, the literal defaults of the ``AsymKVConfig`` fields
and the keys of ``PRESETS``. They are the core's values, not copies kept beside them, so the choices and the
defaults ``--help`` shows cannot drift from what the cache accepts; ``tests/cli/test_settings.py`` holds them
equal to the imported ones (and fails, naming the name, if the core stops writing one of them as a literal).

Note for the merge: the core is gaining a torch-free registry of scheme and preset names; once it lands, read
the names from it here and keep this module only for what it does not hold.
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
    defaults: dict  # AsymKVConfig field -> default value
    presets: tuple[str, ...]


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
    """``{field: literal default}`` of the dataclass ``cls`` in ``tree``."""
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if node is None:
        raise LookupError(f"hf_asymkv.core: no class {cls}")
    return {f.target.id: ast.literal_eval(f.value) for f in node.body
            if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name) and f.value is not None}


@functools.cache
def core_settings() -> CoreSettings:
    """The core's setting names and defaults (parsed once, a few milliseconds; no torch).

    Raises:
        LookupError: the core no longer defines one of the names as a literal (a test catches it first).
    """
    config, presets = _module("config"), _module("presets")
    preset_dict = _assigned(presets, "PRESETS")
    if not isinstance(preset_dict, ast.Dict):
        raise LookupError("hf_asymkv.core.presets: PRESETS is not a dict literal")
    return CoreSettings(
        key_formats=tuple(ast.literal_eval(_assigned(config, "KEY_FORMATS"))),
        value_bits=tuple(ast.literal_eval(_assigned(config, "VALUE_BITS"))),
        overflow_policies=tuple(ast.literal_eval(_assigned(config, "OVERFLOW_POLICIES"))),
        defaults=_field_defaults(config, "AsymKVConfig"),
        presets=tuple(ast.literal_eval(key) for key in preset_dict.keys),
    )
