"""The real bytes behind any object's tensors: every tensor reachable from it, each storage counted once.

What :meth:`~hf_asymkv.core.cache.AsymKVCache.memory_footprint` counts for the layers it does not build itself
(transformers' sliding-window, linear-attention, hybrid and other layers, whatever they hold), and what
:func:`hf_asymkv.bench.memory.cache_nbytes` counts for any cache. Nothing is estimated from shapes: a view into a
larger buffer costs the whole buffer (unused capacity is real memory).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["reachable_tensors", "tensor_nbytes"]


def reachable_tensors(obj, depth: int = 0) -> Iterable[torch.Tensor]:
    """Every plain tensor reachable from ``obj`` (tensors, subclass tensors, tuples/lists/dicts, attributes)."""
    if depth > 6 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            names, _ = obj.__tensor_flatten__()
            for name in names:
                yield from reachable_tensors(getattr(obj, name), depth + 1)
        else:
            yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from reachable_tensors(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from reachable_tensors(item, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        for item in vars(obj).values():
            yield from reachable_tensors(item, depth + 1)


def tensor_nbytes(objs: Iterable, seen: set | None = None) -> int:
    """Bytes of the storages behind every tensor reachable from ``objs``, each storage counted once.

    A storage's full size is counted, so a view into a larger buffer costs the whole buffer (unused
    capacity is real memory).
    """
    seen = set() if seen is None else seen
    total = 0
    for obj in objs:
        for t in reachable_tensors(obj):
            storage = t.untyped_storage()
            key = (storage.data_ptr(), t.device)
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
    return total
