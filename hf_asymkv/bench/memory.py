"""Count the real bytes a cache holds, for any `transformers.Cache` (ours, `DynamicCache`, `QuantizedCache`).

Memory claims are made by walking every tensor a cache layer references (tensor subclasses such as
optimum-quanto's packed tensors are opened through ``__tensor_flatten__``), counting each storage once and
including unused capacity. Nothing is estimated from shapes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["cache_nbytes", "tensor_nbytes"]


def _inner_tensors(obj, depth: int = 0) -> Iterable[torch.Tensor]:
    """Every plain tensor reachable from ``obj`` (tensors, subclass tensors, tuples/lists/dicts, attributes)."""
    if depth > 6 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            names, _ = obj.__tensor_flatten__()
            for name in names:
                yield from _inner_tensors(getattr(obj, name), depth + 1)
        else:
            yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _inner_tensors(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _inner_tensors(item, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        for item in vars(obj).values():
            yield from _inner_tensors(item, depth + 1)


def tensor_nbytes(objs: Iterable, seen: set | None = None) -> int:
    """Bytes of the storages behind every tensor reachable from ``objs``, each storage counted once.

    A storage's full size is counted, so a view into a larger buffer costs the whole buffer (unused
    capacity is real memory).
    """
    seen = set() if seen is None else seen
    total = 0
    for obj in objs:
        for t in _inner_tensors(obj):
            storage = t.untyped_storage()
            key = (storage.data_ptr(), t.device)
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
    return total


def cache_nbytes(cache) -> int:
    """Real bytes of every tensor held by ``cache``'s layers (scales, zeros, windows, capacity included).

    Small bookkeeping tensors (e.g. a sliding layer's window-size scalar) are included too: they are real. An
    :class:`~hf_asymkv.AsymKVCache` is settled first (a layer update it still holds exact is quantized, as its next
    update would do): the bytes are those it keeps.
    """
    if hasattr(cache, "settle"):
        cache.settle()
    seen: set = set()
    return sum(tensor_nbytes([layer], seen) for layer in cache.layers)
