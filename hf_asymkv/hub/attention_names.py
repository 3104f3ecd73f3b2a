"""Where a checkpoint keeps each decoder layer's attention module, so that its KV scale tensors are named after it.

An engine attaches ``<attention module>.k_scale`` / ``.v_scale`` to the module of that name (vLLM maps the
suffix onto its own ``.attn.k_scale``), so the prefix must be the checkpoint's own: ``model.layers.{i}.self_attn``
for Llama, ``gpt_neox.layers.{i}.attention`` for GPT-NeoX, ``model.language_model.layers.{i}.self_attn`` or
``language_model.model.layers.{i}.self_attn`` for multimodal checkpoints, whichever the weights use.

Two sources, checked against each other:

- the model's module tree, built from the config on the ``meta`` device (no weights are read): in the text
  decoder (``get_decoder()``), the attention modules (class name ending in ``Attention``) that carry a
  ``layer_idx``, with the names of their parameters;
- the checkpoint's weight names: a layer's prefix is the saved name of one of those parameters minus the
  parameter's own path. A checkpoint saved under other names (transformers renames some multimodal checkpoints
  on load) is matched by the tail of the module name (``layers.{i}.self_attn``), and among several matches
  (a vision tower has ``layers.{i}.self_attn`` too) by the most name parts shared with the module name.

When the model class is not in transformers (custom code), the weight names alone are used: every
``<prefix>.{i}.<module>.k_proj.weight``. A layer with no prefix, or more than one equally good, is refused
with the names that were found.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["attention_modules", "attention_prefixes"]

_LAYER = re.compile(r"(?:^|\.)(\d+)\.")


def _meta_model(config):
    """The model of ``config`` on the ``meta`` device (no memory, no weights), or None when transformers has
    no class for it."""
    import torch
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            with torch.device("meta"):
                return cls(config)
    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    except ValueError:  # not a causal LM transformers knows
        return None


def attention_modules(config) -> dict[int, tuple[str, list[str]]] | None:
    """``{layer_idx: (module name, [its parameter names, relative])}`` of the text decoder's attention modules,
    from the module tree (None when transformers has no class for ``config``)."""
    model = _meta_model(config)
    if model is None:
        return None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    base = next((name for name, module in model.named_modules() if module is decoder), "")
    found = {}
    for name, module in decoder.named_modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and type(module).__name__.endswith("Attention") and index not in found:
            full = f"{base}.{name}" if base else name
            found[index] = (full, [p for p, _ in module.named_parameters()])
    return found


def _shared_parts(a: str, b: str) -> int:
    return len(set(a.split(".")) & set(b.split(".")))


def _saved_prefix(module: str, params: list[str], names: set[str]) -> list[str]:
    """The saved prefixes of ``module`` (in-memory name) among the weight ``names``: the exact name if saved
    under it, else the best matches of its tail (see the module docstring)."""
    exact = [module for p in params if f"{module}.{p}" in names]
    if exact:
        return exact[:1]
    parts = module.split(".")
    numbered = [k for k, part in enumerate(parts) if part.isdigit()]
    if not numbered:
        return []
    tail = ".".join(parts[max(numbered[-1] - 1, 0):])  # the layer list, the index and on: "layers.0.self_attn"
    found = {n[: -len(p) - 1] for n in names for p in params
             if n.endswith(f".{tail}.{p}") or n == f"{tail}.{p}"}
    if not found:
        return []
    best = max(_shared_parts(module, f) for f in found)
    return sorted(f for f in found if _shared_parts(module, f) == best)


def _from_weight_names(names: set[str]) -> dict[int, list[str]]:
    """``{layer: [prefixes]}`` from ``<prefix>.k_proj.weight`` names that hold a layer index."""
    out: dict[int, list[str]] = {}
    for name in sorted(names):
        if name.endswith(".k_proj.weight"):
            indices = _LAYER.findall(name)
            if indices:
                out.setdefault(int(indices[-1]), []).append(name.removesuffix(".k_proj.weight"))
    return out


def attention_prefixes(config, weight_names: Iterable[str], layers: Iterable[int], where: str = "the checkpoint"
                       ) -> dict[int, str]:
    """``{layer: attention module prefix as saved}`` for every one of ``layers``.

    Args:
        config: the checkpoint's config (its model is built on ``meta`` to read the module tree).
        weight_names: every tensor name of the checkpoint (its weight map).
        layers: the layers that need a prefix (those with KV scales).
        where: the checkpoint, for messages.

    Raises:
        ValueError: a layer with no attention module in the weights, or with several equally good candidates;
            the message lists the attention modules that were found.
    """
    names = set(weight_names)
    modules = attention_modules(config)
    if modules is None:
        candidates = _from_weight_names(names)
        source = "k_proj.weight names (transformers has no class for this config)"
    else:
        candidates = {i: _saved_prefix(module, params, names) for i, (module, params) in modules.items()}
        source = "the model's attention modules"
    prefixes, problems = {}, []
    for i in layers:
        found = candidates.get(i, [])
        if len(found) == 1:
            prefixes[i] = found[0]
        else:
            problems.append(f"layer {i}: {'no attention module' if not found else 'ambiguous: ' + ', '.join(found)}")
    if problems:
        seen = sorted({p for found in candidates.values() for p in found})
        raise ValueError(f"{where}: cannot name the KV scales of every layer after its attention module (from "
                         f"{source}): {'; '.join(problems[:6])}{' ...' if len(problems) > 6 else ''}. Attention "
                         f"modules found in the weights: {seen[:8] or 'none'}{' ...' if len(seen) > 8 else ''}")
    return prefixes
