"""Count the real bytes a cache holds, for any `transformers.Cache` (ours, `DynamicCache`, `QuantizedCache`).

Memory claims are made by walking every tensor a cache layer references (tensor subclasses such as
optimum-quanto's packed tensors are opened through ``__tensor_flatten__``), counting each storage once and
including unused capacity. Nothing is estimated from shapes.
"""

from __future__ import annotations

from ..core.nbytes import reachable_tensors, tensor_nbytes

__all__ = ["cache_nbytes", "reachable_tensors", "tensor_nbytes"]


def cache_nbytes(cache) -> int:
    """Real bytes of every tensor held by ``cache``'s layers (scales, zeros, windows, capacity included).

    Small bookkeeping tensors (e.g. a sliding layer's window-size scalar) are included too: they are real. Nothing is
    changed to count it: an :class:`~hf_asymkv.AsymKVCache` still holding a press's update exact counts it (its
    ``settle()`` quantizes it first, if that is the state to measure).
    """
    seen: set = set()
    return sum(tensor_nbytes([layer], seen) for layer in cache.layers)
