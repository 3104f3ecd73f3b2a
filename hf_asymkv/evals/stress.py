"""An outlier stress model: keys with huge channel outliers in chosen layers, and exactly the same outputs.

Production models such as Qwen2/2.5 carry key channels 100-200x the median channel (a large key bias in the
first and last layers), where per-tensor and per-token key formats break; the embedded SmolLM2 has mild ones.
Such keys can be made from any Llama-like model without changing what it computes: for a KV head ``g``,
multiply the ``k_proj`` rows of one rotary channel pair ``(i, i + head_dim/2)`` by ``s`` and the same rows of
``q_proj`` of every query head that reads ``g`` by ``1/s`` (biases too). RoPE rotates each pair within itself,
so it commutes with a scaling of the pair, and every logit ``q·k`` is unchanged; the keys the cache stores now
carry a pair ``s`` times larger than before. It is a stress case, not a real model: every result made with it
says so (the CLI's ``--stress-outliers``).

:func:`scale_key_pair` is the exact primitive; :func:`add_key_outliers` picks, per KV head of each chosen layer,
its largest pair (by the largest norm the pair reaches on a measurement text, which bounds the pair's channels
after RoPE) and scales it so that it becomes ``ratio`` times the head's median pair. :data:`OUTLIER_PRESETS`
names per-layer ratio patterns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads inside the functions: the CLI parses --stress-outliers without it
    import torch

__all__ = ["OUTLIER_PRESETS", "PairScale", "add_key_outliers", "forward_with_hooks", "key_pair_ranges",
           "layer_ratios", "parse_outlier_spec", "scale_key_pair", "stress_description", "stress_model"]

OUTLIER_PRESETS = {
    # Qwen2/2.5's pattern: huge outliers in the first and last layers, mild ones elsewhere
    "qwen": {0: 150.0, -1: 150.0, "*": 10.0},
    # the same huge outliers in every layer
    "all": {"*": 150.0},
}
"""Per-layer target ratios (largest pair / median pair of each KV head); ``-1`` is the last layer, ``"*"`` every
layer not named."""


@dataclass(frozen=True)
class PairScale:
    """One applied scaling: the pair ``(pair, pair + head_dim/2)`` of KV head ``kv_head`` in ``layer``, keys x
    ``scale``; ``ratio_before``/``ratio_after``: the pair's range over the head's median pair range."""

    layer: int
    kv_head: int
    pair: int
    scale: float
    ratio_before: float
    ratio_after: float


def _attention_modules(model) -> list:
    """The attention module of every decoder layer, checked for the projections the rescaling needs.

    Raises:
        ValueError: a layer without separate ``q_proj``/``k_proj`` linear layers, with a per-head norm on q or k
            (it would undo the scaling), or a model with partial rotary embeddings (pairs are not ``(i, i+d/2)``).
    """
    import torch

    text = model.config.get_text_config(decoder=True)
    if getattr(text, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor={text.partial_rotary_factor}) are not "
                         "supported: the rescaling needs every channel in a rotary pair (i, i + head_dim/2)")
    modules = [layer.self_attn for layer in model.get_decoder().layers]
    for i, attn in enumerate(modules):
        if not all(isinstance(getattr(attn, name, None), torch.nn.Linear) for name in ("q_proj", "k_proj")):
            raise ValueError(f"layer {i}: {type(attn).__name__} has no q_proj/k_proj linear layers; the outlier stress "
                             "model needs a Llama-like attention")
        if getattr(attn, "k_norm", None) is not None or getattr(attn, "q_norm", None) is not None:
            raise ValueError(f"layer {i}: {type(attn).__name__} normalizes q/k per head (q_norm/k_norm), which undoes "
                             "a row scaling; the outlier stress model needs a Llama-like attention without them")
    return modules


def _shapes(model) -> tuple[int, int, int]:
    """``(query heads, kv heads, head_dim)`` of the decoder."""
    text = model.config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return heads, kv_heads, head_dim


def _scale_rows(linear: torch.nn.Linear, rows: torch.Tensor, factor: float) -> None:
    """Multiply ``rows`` of ``linear``'s weight (and bias) by ``factor``, in float32, stored back in their dtype."""
    import torch

    with torch.no_grad():
        for param in (linear.weight, linear.bias):
            if param is not None:
                param[rows] = (param[rows].float() * factor).to(param.dtype)


def scale_key_pair(model, layer: int, kv_head: int, pair: int, scale: float) -> None:
    """Scale the rotary pair ``(pair, pair + head_dim/2)`` of KV head ``kv_head``'s keys by ``scale`` in
    ``layer``, and the same channels of every query head reading that KV head by ``1/scale``: outputs unchanged.

    Raises:
        ValueError: a layer, head or pair out of range, a scale that is not a finite number > 0, or a model the
            rescaling does not apply to (see :func:`_attention_modules`).
    """
    import torch

    modules = _attention_modules(model)
    heads, kv_heads, head_dim = _shapes(model)
    half = head_dim // 2
    for name, value, limit in (("layer", layer, len(modules)), ("kv_head", kv_head, kv_heads), ("pair", pair, half)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
            raise ValueError(f"{name} must be an int in [0, {limit - 1}], got {value!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    channels = torch.tensor([pair, pair + half])
    group = heads // kv_heads  # query heads g*group .. (g+1)*group - 1 read KV head g (transformers' repeat_kv)
    attn = modules[layer]
    _scale_rows(attn.k_proj, kv_head * head_dim + channels, scale)
    query_rows = torch.cat([q * head_dim + channels for q in range(kv_head * group, (kv_head + 1) * group)])
    _scale_rows(attn.q_proj, query_rows, 1.0 / scale)


def key_pair_ranges(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer ``[kv_heads, head_dim/2]``: the largest norm each key rotary pair reaches over ``input_ids``.

    RoPE rotates a pair without changing its norm, so this bounds both channels of the pair after RoPE (what the
    cache stores), whatever the positions. Measured on the ``k_proj`` outputs (pre-RoPE) with forward hooks that
    are always removed.
    """
    import torch

    modules = _attention_modules(model)
    _, kv_heads, head_dim = _shapes(model)
    half = head_dim // 2
    ranges: dict[int, torch.Tensor] = {}

    def hook(index: int):
        def record(module, args, output):
            k = output.float().reshape(-1, kv_heads, head_dim)
            ranges[index] = torch.hypot(k[..., :half], k[..., half:]).amax(0).cpu()
        return record

    forward_with_hooks(model, input_ids, [attn.k_proj.register_forward_hook(hook(i)) for i, attn in enumerate(modules)])
    return [ranges[i] for i in range(len(modules))]


def forward_with_hooks(model, input_ids: torch.Tensor, handles: list) -> None:
    """One forward pass over ``input_ids`` (no cache, no gradients) for the hooks behind ``handles`` to record
    what they need; the hooks are removed afterwards, also when the pass fails."""
    import torch

    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()


def layer_ratios(spec: Mapping, num_layers: int) -> dict[int, float]:
    """``{layer: ratio}`` for every layer ``spec`` names (negative indices from the end, ``"*"`` the rest).

    Raises:
        ValueError: a layer out of range, named twice, or a ratio that is not a number >= 1.
    """
    out, default = {}, None
    for key, ratio in spec.items():
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1 <= ratio < float("inf"):
            raise ValueError(f"outlier ratio of layer {key!r} must be a finite number >= 1, got {ratio!r}")
        if key == "*":
            default = float(ratio)
            continue
        if isinstance(key, bool) or not isinstance(key, int) or not -num_layers <= key < num_layers:
            raise ValueError(f"layer {key!r} is not a layer of this model (layers 0..{num_layers - 1}, or -1 for the "
                             f"last); allowed keys: a layer index or '*'")
        if key % num_layers in out:
            raise ValueError(f"layer {key % num_layers} is named twice in the outlier spec")
        out[key % num_layers] = float(ratio)
    if default is not None:
        out.update({i: default for i in range(num_layers) if i not in out})
    return dict(sorted(out.items()))


def add_key_outliers(model, input_ids: torch.Tensor, ratios: Mapping) -> list[PairScale]:
    """Make, in each layer of ``ratios``, every KV head's largest key pair ``ratio`` times its median pair.

    Args:
        model: a Llama-like causal LM in memory (modified in place; outputs unchanged up to rounding).
        input_ids: ``[1, T]`` measurement text for the pair ranges (:func:`key_pair_ranges`).
        ratios: ``{layer: ratio}``; negative layers count from the end, ``"*"`` covers every layer not named.
            A pair already beyond its ratio is left as it is (scale 1).

    Returns:
        What was applied, one :class:`PairScale` per (layer, KV head).

    Raises:
        ValueError: a bad layer or ratio (:func:`layer_ratios`), or a model the rescaling does not apply to.
    """
    targets = layer_ratios(ratios, len(_attention_modules(model)))
    ranges = key_pair_ranges(model, input_ids)
    applied = []
    for layer, ratio in targets.items():
        for head, pairs in enumerate(ranges[layer]):
            median, pair = float(pairs.median()), int(pairs.argmax())
            before = float(pairs[pair]) / median
            scale = max(ratio / before, 1.0)
            if scale > 1.0:
                scale_key_pair(model, layer, head, pair, scale)
            applied.append(PairScale(layer, head, pair, scale, before, before * scale))
    return applied


def parse_outlier_spec(text: str) -> dict:
    """``--stress-outliers``: a name of :data:`OUTLIER_PRESETS`, or ``"LAYER:RATIO,..."`` with ``*`` for the
    other layers (``"0:150,-1:150,*:10"`` is ``qwen``).

    Raises:
        ValueError: neither a preset name nor a well-formed spec (the message lists the presets).
    """
    if text in OUTLIER_PRESETS:
        return dict(OUTLIER_PRESETS[text])
    spec = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        layer, sep, ratio = part.partition(":")
        try:
            key = "*" if layer.strip() == "*" else int(layer)
            spec[key] = float(ratio)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--stress-outliers: expected a preset ({', '.join(OUTLIER_PRESETS)}) or LAYER:RATIO "
                             f"pairs such as '0:150,-1:150,*:10', got {text!r}")
    if not spec:
        raise ValueError(f"--stress-outliers: empty spec {text!r}")
    return spec


def stress_description(name: str) -> str:
    """The label every output of a stress model carries."""
    return f"STRESS CASE: {name} keys with synthetic outliers (function-preserving rescaling, not a real model)"


def stress_model(model, tokenizer, spec: str, measure_tokens: int = 512) -> dict:
    """Turn ``model`` into the outlier stress model ``spec`` (:func:`parse_outlier_spec`), measuring pair ranges
    on ``measure_tokens`` tokens of the built-in text.

    Returns:
        What results record: ``{"spec", "ratios", "measure_tokens", "applied": [PairScale as dicts]}``.
    """
    from ..models import input_device
    from .haystack import load_text
    from .ppl import text_windows

    ratios = parse_outlier_spec(spec)
    ids = text_windows(tokenizer, load_text(None)[0], measure_tokens, 1)[0].to(input_device(model))
    applied = add_key_outliers(model, ids, ratios)
    return {"spec": spec, "ratios": {str(k): v for k, v in ratios.items()}, "measure_tokens": measure_tokens,
            "applied": [asdict(a) for a in applied]}
