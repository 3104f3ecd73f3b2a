"""Interrupted calls: a cache layer is left as it was, or refuses every use until ``reset()``.

An exception can land anywhere inside a call: Ctrl-C is a ``KeyboardInterrupt`` raised between two bytecodes, an
out-of-memory error comes from the next allocation (a block's codes, a grown buffer, the dense read-out). Users then
retry with a smaller batch or continue the conversation, so what the call leaves behind must be either the layer
as it was before the call, or a layer that says it is broken, never one that a later call trips over (or reads
wrong without a word).

- The dynamic layer (:class:`~hf_asymkv.core.layer.AsymKVLayer`) is restored. Its calls write new rows only past
  a buffer's live length, or into fresh tensors that they then assign (:class:`~hf_asymkv.core.store.GrowableBuffer`
  never writes over its live rows), so everything the layer holds is described by the attributes of its objects:
  tensor references, lengths, specs, counters. :func:`restores_on_error` copies those attribute dictionaries
  before the call (references only: no tensor is copied, a few microseconds) and puts them back when an exception
  leaves it. What the copies keep alive until the call returns: tensors the call replaces (a flush's old window).
- The static layer (:class:`~hf_asymkv.core.static.StaticAsymKVLayer`) writes its preallocated buffers in place
  (what lets a compiled graph or a CUDA graph replay it), so an interrupted write cannot be undone without copying
  them each step. It marks itself (``layer.interrupted``: the call's name) before its first in-place write and clears
  the mark after the last; while the mark is set every use raises :class:`InterruptedUpdateError`, which says to
  call ``reset()``, and ``reset()`` clears it. Inside a compiled graph no mark is written (a graph does not branch
  on Python state): an interrupt inside a compiled step goes unnoticed, and ``reset()`` is the way back.
- The cache (:class:`~hf_asymkv.core.cache.AsymKVCache`) restores its own bookkeeping and transformers' layers it
  keeps (sliding windows assign new tensors, so a copy of their attributes restores them too) with
  :func:`snapshot`, for its calls that loop over layers as well (a crop, a beam reorder).

Not covered: an interrupt between two layers' updates inside one forward (in the model's code, not the cache's)
leaves the layers before it one update ahead of the layers after it; the cache cannot tell that apart from layers
used on purpose at different lengths, so ``reset()`` (or ``crop`` to the shorter length) is the user's to call.
"""

from __future__ import annotations

import functools
from collections import Counter

import torch

__all__ = ["InterruptedUpdateError", "Snapshot", "StaticSnapshot", "check_usable", "restores_layers_on_error",
           "restores_on_error", "snapshot"]

MUTABLE_VALUES = (dict, Counter, list, set)
"""Attribute values changed in place (a layer's counters): copied, not referenced, by a snapshot."""


class InterruptedUpdateError(RuntimeError):
    """A static cache layer's call was interrupted after it had written part of its buffers: call ``reset()``."""


class Snapshot:
    """The attribute dictionaries of some objects, to put back with :meth:`restore` (tensors by reference).

    Containers changed in place (:data:`MUTABLE_VALUES`) are copied in the first object only (a layer's counters, the
    cache's list of layers): the objects a layer is made of hold none (``tests/core/test_rollback.py`` checks it),
    and a scan of every attribute would cost as much as the copies themselves.
    """

    def __init__(self, objects) -> None:
        self.saved = [(obj, vars(obj).copy()) for obj in objects]
        first = self.saved[0][1] if self.saved else {}
        for name, value in first.items():
            if isinstance(value, MUTABLE_VALUES):
                first[name] = value.copy()

    def restore(self) -> None:
        for obj, attributes in self.saved:
            state = vars(obj)
            state.clear()
            state.update(attributes)


def _layer_objects(layer) -> list:
    """The layer and every object its stores are made of (the buffers' tensors are referenced, never copied)."""
    objects = [layer]
    for store in layer.stores:
        blocks = store.blocks
        objects += [store, blocks, store.overlay, store.sinks, store.window, blocks.codes, blocks.scales, blocks.zeros,
                    blocks.wide_bits, blocks.wide_channels]
    return objects


class StaticSnapshot(Snapshot):
    """A static layer's attributes and filled length (what its ``crop`` changes; a 0-d tensor written in place)."""

    def __init__(self, layer) -> None:
        super().__init__([layer])
        self.length = layer.length.clone() if layer.is_initialized else None

    def restore(self) -> None:
        super().restore()
        if self.length is not None:
            self.saved[0][0].length.copy_(self.length)


def snapshot(obj) -> Snapshot:
    """What :meth:`Snapshot.restore` puts back: a dynamic :class:`~hf_asymkv.core.layer.AsymKVLayer` with its stores;
    a static layer's attributes and filled length (:class:`StaticSnapshot`); any other object's own attributes (the
    cache, transformers' dynamic layers, which assign new tensors at every change)."""
    if hasattr(obj, "key_store"):
        return Snapshot(_layer_objects(obj))
    if hasattr(obj, "interrupted"):  # a layer that writes in place and marks itself (the static layer)
        return StaticSnapshot(obj)
    return Snapshot([obj])


def restores_on_error(method):
    """Decorate a method of :class:`~hf_asymkv.core.layer.AsymKVLayer` so that an exception leaving it (any: Ctrl-C
    too) leaves the layer as it was before the call (see the module docstring)."""

    @functools.wraps(method)
    def call(layer, *args, **kwargs):
        saved = snapshot(layer)
        try:
            return method(layer, *args, **kwargs)
        except BaseException:
            saved.restore()
            raise

    return call


def restores_layers_on_error(writes_in_place: bool = False):
    """Decorate a method of :class:`~hf_asymkv.core.cache.AsymKVCache` that calls every layer (a crop, a beam
    reorder) so that an exception leaving it leaves every layer and the cache's bookkeeping as they were: the layers
    before the one it reached too. ``writes_in_place``: the call writes static layers' buffers in place (a reorder),
    which a snapshot cannot undo, so an exception marks them interrupted instead (:func:`check_usable`)."""

    def decorate(method):
        @functools.wraps(method)
        def call(cache, *args, **kwargs):
            saved = [snapshot(cache), snapshot(cache.reuse_watch), *(snapshot(layer) for layer in cache.layers)]
            try:
                return method(cache, *args, **kwargs)
            except BaseException:
                for part in saved:
                    part.restore()
                for layer in cache.layers if writes_in_place else ():
                    if hasattr(layer, "interrupted") and layer.is_initialized:
                        layer.interrupted = method.__name__
                raise

        return call

    return decorate


def check_usable(layer) -> None:
    """Raise :class:`InterruptedUpdateError` when a static layer's call was interrupted mid-write (eager code only:
    a compiled graph does not read the mark)."""
    if torch.compiler.is_compiling():
        return
    what = layer.interrupted
    if what is not None:
        raise InterruptedUpdateError(
            f"this static cache layer's {what}() was interrupted after it had written part of its preallocated "
            "buffers (an exception, Ctrl-C or out of memory, inside the call); what it holds is no longer what the "
            "model computed. Call cache.reset() (it keeps the allocation) and run the request again.")
