"""Fault injection for the interrupt tests (issue 56): an exception at a chosen call or at a chosen line of the core,
and comparable copies of what a cache holds.

- :func:`raise_on_call`: patch a function so that its ``nth`` call (among those ``when`` accepts) raises
  ``KeyboardInterrupt`` instead of running: a named fault point (a block's quantization, a buffer's growth, ...).
- :func:`interrupt_at_line`: raise ``KeyboardInterrupt`` at the ``k``-th line executed in ``hf_asymkv/core`` (as
  Ctrl-C lands between two bytecodes), through :func:`sys.settrace`. ``rollback.py`` is left out: it is the code that
  puts a layer back (an interrupt inside it is not covered, see its docstring).
- :func:`cache_state` / :func:`layer_state`: what a cache or a layer holds, as plain values and cloned tensors, for
  ``==``-style comparison with :func:`assert_same` (bitwise, NaN included).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

import hf_asymkv.core as core
from hf_asymkv.core.layer import AsymKVLayer
from hf_asymkv.core.static import StaticAsymKVLayer

CORE = str(Path(core.__file__).parent) + "/"
UNTRACED = {CORE + "rollback.py"}


class Injected(KeyboardInterrupt):
    """The injected interrupt (a KeyboardInterrupt: what Ctrl-C raises), telling where it landed."""


def raise_on_call(monkeypatch, owner, name: str, nth: int = 1, when=None) -> dict:
    """Make the ``nth`` call of ``owner.name`` for which ``when(*args, **kwargs)`` is true raise :class:`Injected`
    (the other calls run as usual). Returns a record whose ``"fired"`` says whether it did."""
    real = getattr(owner, name)
    record = {"fired": False, "calls": 0}

    def patched(*args, **kwargs):
        if not record["fired"] and (when is None or when(*args, **kwargs)):
            record["calls"] += 1
            if record["calls"] == nth:
                record["fired"] = True
                raise Injected(f"{name} (call {nth})")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, patched)
    return record


@contextlib.contextmanager
def interrupt_at_line(k: int):
    """Raise :class:`Injected` at the ``k``-th line event (1-based) of code in ``hf_asymkv/core`` run inside the block,
    this thread only. Yields a record: ``"where"`` (``file:line``) once it fired, ``"lines"`` the lines counted."""
    record = {"where": None, "lines": 0}

    def local(frame, event, arg):
        if event == "line":
            record["lines"] += 1
            if record["lines"] == k:
                record["where"] = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
                raise Injected(record["where"])
        return local

    def calls(frame, event, arg):
        filename = frame.f_code.co_filename
        return local if filename.startswith(CORE) and filename not in UNTRACED else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield record
    finally:
        sys.settrace(previous)


def run_interrupted(op, k: int) -> str | None:
    """Run ``op()`` with an interrupt at core line ``k``: where it landed (the exception swallowed), or None when the
    call finished first."""
    with contextlib.suppress(Injected), interrupt_at_line(k) as record:
        op()
    return record["where"]


# ------------------------------------------------------------------------------------------------ comparable states
def _clone(t):
    return None if t is None else t.detach().clone()


def layer_state(layer) -> dict:
    """What a layer holds: lengths, counters, footprint and the live part of every buffer (cloned)."""
    if isinstance(layer, AsymKVLayer):
        state = {"initialized": layer.is_initialized, "length": layer.cumulative_length,
                 "pending": layer.pending_tokens, "rollbacks": layer.rollbacks, "stats": dict(layer.stats),
                 "footprint": layer.memory_footprint(), "first_held": layer.first_held}
        for name, buf in layer.buffers().items():
            state[name] = None if buf.data is None else (buf.length, tuple(buf.data.shape), _clone(buf.live))
        for store in layer.stores:
            state[f"{store.kind}_spec"] = store.spec
            state[f"{store.kind}_overlay"] = (_clone(store.overlay.anchors), _clone(store.overlay.tokens))
        return state
    if isinstance(layer, StaticAsymKVLayer):
        return _static_state(layer)
    return {name: (_clone(value) if isinstance(value, torch.Tensor) else value)  # transformers' own layers
            for name, value in vars(layer).items() if isinstance(value, (torch.Tensor, int, bool, type(None)))}


def _static_state(layer: StaticAsymKVLayer) -> dict:
    """The live part of a static layer: what its filled length and stored blocks cover (the rest is filler)."""
    if not layer.is_initialized:
        return {"initialized": False}
    held, blocks = int(layer.length), int(layer.blocks_stored)
    boundary = layer.sink_count + blocks * layer.block_size
    state = {"initialized": True, "length": held, "blocks": blocks, "counts": layer.counts.tolist(),
             "footprint": layer.memory_footprint()}
    for store in layer.stores:
        tg = store.spec.token_group
        quantized = blocks * layer.block_size
        parts = {"sinks": store.sinks[:, :, : min(held, layer.sink_count)],
                 "window": store.window[:, :, : max(0, held - boundary)],
                 "codes": store.codes[:, :, :quantized], "scales": store.scales[:, :, : quantized // tg],
                 "zeros": None if store.zeros is None else store.zeros[:, :, : quantized // tg],
                 "anchors": store.overlay.anchors, "overlay": store.overlay.tokens}
        state.update({f"{store.kind}_{name}": _clone(t) for name, t in parts.items()})
    return state


def cache_state(cache) -> dict:
    """Every layer's :func:`layer_state`, the cache's bookkeeping and its footprint."""
    layers = [layer_state(layer) for layer in cache.layers]
    watch = vars(cache.reuse_watch).copy()
    return {"layers": layers, "held_layer": cache.held_layer, "watch": watch, "footprint": cache.memory_footprint()}


def assert_same(a, b, path: str = "state") -> None:
    """``a`` and ``b`` equal, tensors bit for bit (dtype, shape and bytes: NaN equals NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        assert torch.equal(_bytes(a), _bytes(b)), f"{path}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
