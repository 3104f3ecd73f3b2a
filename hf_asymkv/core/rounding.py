"""Rounding float32 values into a storage dtype in a chosen direction, with the same result eagerly and compiled.

Scales are stored rounded *up* and zeros rounded *down* into their dtype (bfloat16 for keys, float16 for values), so
that codes never clip (:mod:`~hf_asymkv.core.quant`). Eagerly that is a cast, a comparison, and a ``nextafter``
where the cast went the wrong way. A compiled graph cannot do it so: inductor keeps a value it has cast to a
half-precision dtype at float32 inside a fused kernel (it skips the down-and-up cast pair unless
``torch._inductor.config.emulate_precision_casts`` is set), so the comparison sees no rounding; and it computes
``nextafter`` of half-precision values in float32, which rounds back. Inside a graph the same numbers are computed
on the dtype's grid instead (:func:`to_grid`): every value is then exact in the dtype, so whatever the compiler does
with the final cast, every reader sees the number eager code stores.
"""

from __future__ import annotations

import math

import torch

__all__ = ["round_down", "round_up", "to_grid"]

_BF16_LOW_BITS = 0xFFFF  # bfloat16 values are the float32 values whose low 16 bits are clear
_FP16_MANTISSA_BITS = 10
_FP16_MIN_QUANTUM_FIELD = 127 - 24  # float32 exponent field of 2**-24, float16's smallest step (subnormals)


def to_grid(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """``x`` (float32) rounded up (``up``) or down onto ``dtype``'s values, as float32: the float32 form of
    ``ceil``/``floor`` into ``dtype``, overflow beyond its largest value included (callers clamp).

    bfloat16 is float32 with a shorter mantissa: truncate the bits, and step the magnitude once where bits were
    dropped and the direction points away from zero. float16: divide by the step of ``x``'s binade (a power of two,
    ``2**-24`` at least, so the division and the product back are exact), ``ceil`` or ``floor``, multiply back.

    Raises:
        ValueError: ``x`` not float32, or ``dtype`` not float16, bfloat16 or float32.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"to_grid rounds float32 values, got {x.dtype}.")
    if dtype == torch.float32:
        return x
    bits = x.view(torch.int32)
    if dtype == torch.bfloat16:
        truncated = bits & ~_BF16_LOW_BITS
        away = ((bits & _BF16_LOW_BITS) != 0) & ((bits < 0) != up)  # dropped bits, and a step away from zero
        return (truncated + away.to(torch.int32) * (_BF16_LOW_BITS + 1)).view(torch.float32)
    if dtype == torch.float16:
        field = (bits >> 23) & 0xFF
        quantum = ((field - _FP16_MANTISSA_BITS).clamp(min=_FP16_MIN_QUANTUM_FIELD) << 23).view(torch.float32)
        steps = torch.ceil(x / quantum) if up else torch.floor(x / quantum)
        return steps * quantum
    raise ValueError(f"to_grid rounds into float16, bfloat16 or float32, got {dtype}.")


def round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast positive float32 ``x`` to ``dtype`` so that the result is >= x (and finite)."""
    largest = torch.finfo(dtype).max
    if torch.compiler.is_compiling():
        return to_grid(x, dtype, up=True).clamp(max=largest).to(dtype)
    y = x.to(dtype)
    low = y.float() < x
    if not x.is_cpu or low.any():  # on a GPU the where costs less than the host sync that could skip it
        y = torch.where(low, torch.nextafter(y, torch.full_like(y, math.inf)), y)
    return y.clamp(max=largest)


def round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast float32 ``x`` to ``dtype`` so that the result is <= x (and finite)."""
    finfo = torch.finfo(dtype)
    if torch.compiler.is_compiling():
        return to_grid(x, dtype, up=False).clamp(min=finfo.min, max=finfo.max).to(dtype)
    y = x.to(dtype)
    high = y.float() > x
    if not x.is_cpu or high.any():  # no host sync on a GPU (see round_up)
        y = torch.where(high, torch.nextafter(y, torch.full_like(y, -math.inf)), y)
    return y.clamp(min=finfo.min, max=finfo.max)
