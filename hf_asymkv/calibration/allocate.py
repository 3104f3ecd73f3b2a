"""Per-layer key and value widths under a bytes budget, from measured sensitivity (KVTuner-style).

Input: :func:`.sensitivity.layer_sensitivity` (the attention KL each layer's keys and values cost at each width).
Every layer starts at the cheapest key and value width; then, greedily, the one upgrade (a layer's keys or
values to a wider setting) that removes the most KL per added bit and still fits the budget is taken, until
none fits or none helps. Costs are treated as additive across layers (measured one layer at a time); the
evaluation of the result says how far that held.

The budget is in stored bits per K/V element, averaged over the quantized layers (keys + values of a layer
count as two elements); :func:`preset_bits` gives a preset's, so that an allocation can spend exactly what a
preset spends (its window and sinks are the same, so the bytes are too, up to rounding).
"""

from __future__ import annotations

from ..core.config import AsymKVConfig
from .sensitivity import KEY_WIDTHS, SENSITIVITY_VERSION, VALUE_WIDTHS, width_bits

__all__ = ["allocate", "allocation_overrides", "check_sensitivity", "preset_bits"]


def check_sensitivity(sensitivity: dict) -> None:
    """Raise ``ValueError`` (naming what is wrong) unless ``sensitivity`` is a :func:`layer_sensitivity` dict of
    a version this code reads, with one finite, non-negative cost per layer for every width it names."""
    if not isinstance(sensitivity, dict) or sensitivity.get("version") != SENSITIVITY_VERSION:
        found = sensitivity.get("version") if isinstance(sensitivity, dict) else type(sensitivity).__name__
        raise ValueError(f"sensitivity: version {found!r} is not supported (supported: {SENSITIVITY_VERSION})")
    layers = sensitivity.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"sensitivity: 'layers' must be a non-empty list of layer indices, got {layers!r}")
    for kind, known in (("keys", KEY_WIDTHS), ("values", VALUE_WIDTHS)):
        table = sensitivity.get(kind)
        if not isinstance(table, dict) or not table:
            raise ValueError(f"sensitivity: {kind!r} must map widths to per-layer costs, got {table!r}")
        for width, costs in table.items():
            if width not in known:
                raise ValueError(f"sensitivity: unknown {kind} width {width!r}; known: {list(known)}")
            if (not isinstance(costs, list) or len(costs) != len(layers)
                    or not all(isinstance(c, (int, float)) and 0 <= c < float("inf") for c in costs)):
                raise ValueError(f"sensitivity: {kind}[{width!r}] must hold {len(layers)} finite costs >= 0 (one "
                                 f"per layer), got {costs!r}")


def preset_bits(config: AsymKVConfig, head_dim: int) -> float:
    """Stored bits per K/V element of ``config``'s keys and values (scales included; no overrides), the mean of
    the two: the budget that spends what ``config`` spends."""
    key = {k: getattr(config, k) for k in ("key_format", "key_symmetric", "key_block_size", "key_wide_fraction")}
    return (width_bits(key, head_dim) + width_bits({"value_bits": config.value_bits}, head_dim)) / 2


def allocate(sensitivity: dict, budget_bits: float, head_dim: int) -> dict[int, tuple[str, str]]:
    """``{layer index: (key width, value width)}`` with the least summed KL whose mean bits fit ``budget_bits``.

    Args:
        sensitivity: a :func:`.sensitivity.layer_sensitivity` dict.
        budget_bits: mean stored bits per K/V element over the layers (:func:`preset_bits`).
        head_dim: the layers' head_dim (value scales are per group of it).

    Raises:
        ValueError: a malformed sensitivity dict, or a budget below what the cheapest widths cost (the message
            gives that floor).
    """
    check_sensitivity(sensitivity)
    layers = sensitivity["layers"]
    options = {kind: sorted(((width_bits(widths[w], head_dim), w) for w in sensitivity[kind]))
               for kind, widths in (("keys", KEY_WIDTHS), ("values", VALUE_WIDTHS))}
    choice = {(i, kind): 0 for i in range(len(layers)) for kind in options}  # index into options[kind]
    total = budget_bits * 2 * len(layers)
    spent = sum(options[kind][0][0] for _, kind in choice)
    if spent > total + 1e-9:
        raise ValueError(f"budget_bits {budget_bits!r} is below the cheapest widths' {spent / (2 * len(layers)):.3f}")
    while True:
        best = None
        for (i, kind), now in choice.items():
            bits_now, width_now = options[kind][now]
            cost_now = sensitivity[kind][width_now][i]
            for nxt in range(now + 1, len(options[kind])):
                bits, width = options[kind][nxt]
                gain = cost_now - sensitivity[kind][width][i]
                if gain > 0 and spent + bits - bits_now <= total + 1e-9:
                    rate = gain / max(bits - bits_now, 1e-9)
                    if best is None or rate > best[0]:
                        best = (rate, i, kind, nxt, bits - bits_now)
        if best is None:
            break
        _, i, kind, nxt, extra = best
        choice[(i, kind)], spent = nxt, spent + extra
    return {layer: (options["keys"][choice[(i, "keys")]][1], options["values"][choice[(i, "values")]][1])
            for i, layer in enumerate(layers)}


def allocation_overrides(allocation: dict[int, tuple[str, str]]) -> dict[int, dict]:
    """``AsymKVConfig.layer_overrides`` of an :func:`allocate` result: each layer's key and value settings."""
    return {layer: {**KEY_WIDTHS[key], **VALUE_WIDTHS[value]} for layer, (key, value) in allocation.items()}
