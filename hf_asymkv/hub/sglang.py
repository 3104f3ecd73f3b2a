"""SGLang's ``--quantization-param-path`` JSON (the format vLLM's ``QuantParamSchema`` defined and SGLang kept).

``{"model_type": ..., "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {tp_rank: {layer: scale}}}}``:
one FP8-E4M3 dequant multiplier per layer that the loader applies to both K and V, listed for every
tensor-parallel rank and every layer (its validator checks both counts against the running server).
"""

from __future__ import annotations

from ..core.scales import KVScales

__all__ = ["SGLANG_FILE", "sglang_scales"]

SGLANG_FILE = "kv_cache_scales.json"


def sglang_scales(scales: KVScales, model_type: str | None, num_layers: int, tp_size: int = 1) -> dict:
    """The JSON document for ``scales``.

    Each layer's value is ``max(k_scale, v_scale)``: one multiplier serves K and V, so it must cover the wider
    of the two ranges (the narrower one then uses fewer FP8 steps; it is never clipped).

    Args:
        scales: calibrated ranges covering layers ``0 .. num_layers-1``.
        model_type: the config's ``model_type`` (the loader compares it with the served model's).
        num_layers: the model's layer count.
        tp_size: tensor-parallel ranks to list (the same per-tensor values on each).

    Raises:
        ValueError: a layer below ``num_layers`` has no ranges.
    """
    missing = [i for i in range(num_layers) if i not in scales.k_channel_absmax]
    if missing:
        raise ValueError(f"SGLang's scale file needs every layer; the scales lack layers {missing}")
    per_layer = {str(i): max(scales.k_scale(i), scales.v_scale(i)) for i in range(num_layers)}
    doc = {"kv_cache": {"dtype": "float8_e4m3fn",
                        "scaling_factor": {str(rank): dict(per_layer) for rank in range(tp_size)}}}
    if model_type:
        doc = {"model_type": model_type, **doc}
    return doc
