"""One cache layer as named tensors and a JSON record, and back: the layer half of a prompt-cache file.

:mod:`~hf_asymkv.core.prompt_cache` writes what :func:`layer_state` returns for every layer of an
:class:`~hf_asymkv.AsymKVCache` and hands :func:`restore_layer` each record with a reader of the file's tensors.
Three kinds of layer:

- ``dynamic`` (:class:`~hf_asymkv.core.layer.AsymKVLayer`): for each store (``key``, ``value``) the live rows of every
  buffer (``sinks``, ``codes``, ``scales``, ``zeros``, ``wide_bits``, ``wide_channels``, ``window``) with the capacity it
  had, the left-padded rows' sink overlay (``anchors``, ``overlay``), and the layer's counters (length, pending tokens,
  deferral flags, statistics);
- ``static`` (:class:`~hf_asymkv.core.static.StaticAsymKVLayer`): the rows of its preallocated buffers that hold
  tokens (filled block slots, sinks, window), the overlay where a row is padded, the filled length, the block count
  and the device counters;
- ``transformers``: the layers the cache keeps as transformers builds them (sliding windows, layer types it does not
  know, KV-less ``DummyLayer``): their ``keys``/``values`` and length attributes, written back into the layer the
  cache builds for the same model.

Restoring writes into a layer the cache has just built for the same model and settings. Every tensor's shape and dtype
is checked against what the layer's settings and the record imply before it is read (a :class:`TensorSource`), and the
record's lengths against each other, so a file that does not match is refused with a ``ValueError`` naming the tensor
or the length, never loaded wrong. A restored dynamic buffer gets back the capacity it had, so the loaded cache holds
the bytes the saved one held (``memory_footprint()``) and grows at the same steps.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from .layer import AsymKVLayer
from .nbytes import reachable_tensors
from .shapes import LayerShape
from .static import STATIC_COUNTERS, StaticAsymKVLayer
from .store import GrowableBuffer

__all__ = ["DTYPES", "TensorSource", "layer_state", "restore_layer"]

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool)}
"""Dtypes a record may name, by their torch name without the ``torch.`` prefix."""
KINDS = ("key", "value")
CARRIED = ("keys", "values", "cumulative_length", "cumulative_length_int")
"""What a transformers layer's record carries; ``_sliding_window_tensor`` (its window as a tensor) is rebuilt from the
config. A transformers layer holding any other tensor (recurrent states, indexer keys) is refused at save."""
REBUILT = ("_sliding_window_tensor",)


class TensorSource(Protocol):
    """Where :func:`restore_layer` reads tensors: by name, each checked before it is read."""

    def read(self, name: str, shape: tuple[int | None, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor ``name`` on the load device; ``ValueError`` when it is missing or not of ``shape`` (None: any
        size on that axis) and ``dtype``."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layer_state(layer, prefix: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(record, {name: tensor})`` of ``layer``, tensor names starting with ``prefix`` (views: the caller copies).

    Raises:
        ValueError: a transformers layer holding state the format does not carry, or an AsymKVLayer with keys
            assigned and values not (a half-done kvpress assignment).
    """
    if isinstance(layer, AsymKVLayer):
        return _dynamic_state(layer, prefix)
    if isinstance(layer, StaticAsymKVLayer):
        return _static_state(layer, prefix)
    return _transformers_state(layer, prefix)


def restore_layer(layer, record: dict, prefix: str, source: TensorSource, shape: LayerShape, batch: int,
                  device: torch.device) -> None:
    """Write ``record`` and its tensors (read from ``source``) into ``layer``, freshly built by the cache.

    Raises:
        ValueError: a record of another kind of layer, or tensors and lengths that do not fit the layer's settings,
            the model's ``shape`` or each other (the message names them).
    """
    kind = record.get("kind")
    expected = ("dynamic" if isinstance(layer, AsymKVLayer) else "static" if isinstance(layer, StaticAsymKVLayer)
                else "transformers")
    if kind != expected:
        raise ValueError(f"the file holds a {kind!r} layer, the cache builds a {expected!r} one here")
    if kind == "transformers" and record.get("class") != type(layer).__name__:
        raise ValueError(f"the file holds transformers' {record.get('class')!r} layer, the cache builds a "
                         f"{type(layer).__name__!r} here")
    if not _flag(record, "initialized"):
        return
    dtype = _dtype(record.get("dtype"))
    widths = {"key": shape.head_dim, "value": shape.value_head_dim or shape.head_dim}
    empty = [torch.empty(batch, shape.kv_heads, 0, widths[k], dtype=dtype, device=device) for k in KINDS]
    if kind == "transformers":
        _restore_transformers(layer, record, prefix, source, empty)
    elif kind == "dynamic":
        _restore_dynamic(layer, record, prefix, source, empty)
    else:
        _restore_static(layer, record, prefix, source, empty)


# ---------------------------------------------------------------------- record fields
def _int(record: dict, key: str, low: int = 0) -> int:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"record field {key!r} must be an int >= {low}, got {value!r}")
    return value


def _flag(record: dict, key: str) -> bool:
    value = record.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"record field {key!r} must be true or false, got {value!r}")
    return value


def _dtype(name) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"record names dtype {name!r}; known: {sorted(DTYPES)}")
    return DTYPES[name]


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# ---------------------------------------------------------------------- dynamic layers
def _buffers(store) -> dict[str, GrowableBuffer]:
    """A dynamic store's buffers by their name in the file (``zeros`` and the wide parts only where the spec has them)."""
    return {"sinks": store.sinks, **store.blocks.buffers(), "window": store.window}


def _dynamic_state(layer: AsymKVLayer, prefix: str) -> tuple[dict, dict]:
    layer.check_no_half_assignment()
    tensors = {}
    if layer.key_absmax is not None:  # calibrated ranges: future blocks are scaled by them
        tensors[f"{prefix}.key_absmax"] = layer.key_absmax.float()
    record = {"kind": "dynamic", "initialized": bool(layer.is_initialized), "key_absmax": layer.key_absmax is not None}
    if not layer.is_initialized:
        return record, tensors
    stats = {name: int(n) for name, n in layer.stats.items() if n}  # folds the append kernel's device counts in
    record.update(dtype=dtype_name(layer.dtype), cumulative_length=layer.cumulative_length,
                  pending_tokens=layer.pending_tokens, record_past=layer.record_past,
                  keep_latest_exact=layer.keep_latest_exact, rollbacks=layer.rollbacks, stats=stats, stores={})
    if layer.first_held:  # a quantized sliding-window layer that has dropped blocks its window left behind
        record["dropped"] = layer.first_held
    for kind, store in zip(KINDS, layer.stores):
        buffers = {}
        for name, buf in _buffers(store).items():
            if buf.data is not None:
                buffers[name] = [buf.length, buf.data.shape[2]]
                tensors[f"{prefix}.{kind}.{name}"] = buf.live
        overlay = store.overlay
        for name, t in (("anchors", overlay.anchors), ("overlay", overlay.tokens)):
            if t is not None:
                tensors[f"{prefix}.{kind}.{name}"] = t
        record["stores"][kind] = {"scale_dtype": dtype_name(store.spec.scale_dtype), "buffers": buffers,
                                  "anchors": overlay.anchors is not None, "overlay": overlay.tokens is not None}
    return record, tensors


def _part_shapes(spec, width: int, dtype: torch.dtype, codes: int) -> dict[str, tuple[int, tuple, torch.dtype]]:
    """Each block part of ``codes`` quantized tokens: ``{name: (rows, trailing shape, dtype)}``; the exact parts'
    rows come from the record."""
    tg, cg = spec.groups(width)
    wide = spec.wide_count(width)
    parts = {"codes": (codes, (spec.packed_dim(width),), spec.code_dtype),
             "scales": (codes // tg, (width // cg,), spec.scale_dtype),
             "zeros": (0 if spec.symmetric else codes // tg, (width // cg,), spec.scale_dtype)}
    if wide:
        parts["wide_bits"] = (codes, (-(-wide // 8),), torch.uint8)
        parts["wide_channels"] = (codes // spec.block_size, (wide,), torch.uint8)
    return {**parts, "sinks": (None, (width,), dtype), "window": (None, (width,), dtype)}


def _restore_dynamic(layer: AsymKVLayer, record: dict, prefix: str, source: TensorSource, empty: list) -> None:
    layer.lazy_initialization(*empty)
    stores = record.get("stores")
    _require(isinstance(stores, dict) and set(stores) == set(KINDS), f"record 'stores' must name {list(KINDS)}")
    lengths = [_restore_store(store, stores[kind], f"{prefix}.{kind}", source, like, layer.block_size)
               for kind, store, like in zip(KINDS, layer.stores, empty)]
    total = _int(record, "cumulative_length")
    pending = _int(record, "pending_tokens")
    _require(lengths[0] == lengths[1], f"key and value stores hold different lengths (sinks, blocks, window): "
                                       f"{lengths[0]} and {lengths[1]}")
    sinks, codes, window = lengths[0]
    dropped = _int(record, "dropped") if "dropped" in record else 0
    _require(not dropped or hasattr(layer, "dropped"), f"{dropped} dropped tokens recorded for a layer that keeps "
                                                       "every token (not a sliding-window layer)")
    _require(dropped % layer.block_size == 0, f"{dropped} dropped tokens, not whole blocks of {layer.block_size}")
    _require(dropped + sinks + codes + window == total, f"dropped {dropped} + sinks {sinks} + quantized {codes} + "
                                                        f"window {window} tokens do not add up to the layer's length "
                                                        f"{total}")
    _require(sinks <= layer.sink_tokens and (sinks == layer.sink_tokens or codes + window == 0),
             f"{sinks} sink tokens stored with sink_tokens={layer.sink_tokens} and {codes + window} tokens after them")
    _require(pending <= window, f"{pending} pending tokens, more than the {window} in the window")
    layer.cumulative_length, layer.pending_tokens, layer.rollbacks = total, pending, _int(record, "rollbacks")
    if dropped:
        layer.dropped = dropped
    layer.record_past, layer.keep_latest_exact = _flag(record, "record_past"), _flag(record, "keep_latest_exact")
    stats = record.get("stats")
    _require(isinstance(stats, dict), "record field 'stats' must be an object")
    layer.stats.update({name: _int(stats, name) for name in stats})


def _restore_store(store, record: dict, prefix: str, source: TensorSource, like: torch.Tensor, block_size: int
                   ) -> tuple[int, int, int]:
    """Fill one dynamic store; returns its ``(sinks, quantized, window)`` token counts."""
    scale_dtype = _dtype(record.get("scale_dtype"))
    if scale_dtype != store.spec.scale_dtype:  # a store whose metadata widened to float32 (QuantizedBlocks.fit)
        _require(scale_dtype == torch.float32, f"{prefix}: scale dtype {scale_dtype} does not fit the settings "
                                               f"({store.spec.scale_dtype}, or float32 once widened)")
        store.blocks.spec = dataclasses.replace(store.spec, scale_dtype=torch.float32)
    buffers = record.get("buffers")
    _require(isinstance(buffers, dict), f"{prefix}: record field 'buffers' must be an object")
    named = _buffers(store)
    _require(set(buffers) <= set(named), f"{prefix}: unknown buffers {sorted(set(buffers) - set(named))} for these "
                                         f"settings (known: {list(named)})")
    spans = {name: _span(buffers, name, prefix) for name in buffers}
    codes = spans.get("codes", (0, 0))[0]
    _require(codes % block_size == 0, f"{prefix}: {codes} quantized tokens, not whole blocks of {block_size}")
    b, h, _, width = like.shape
    for name, (rows, trailing, dtype) in _part_shapes(store.spec, width, like.dtype, codes).items():
        length, capacity = spans.get(name, (0, 0))
        _require(rows is None or length == rows, f"{prefix}.{name}: {length} rows stored, {rows} expected for "
                                                 f"{codes} quantized tokens")
        if name in buffers:
            _fill(named[name], source.read(f"{prefix}.{name}", (b, h, length, *trailing), dtype), capacity)
    overlay = store.overlay
    if _flag(record, "anchors"):
        overlay.anchors = source.read(f"{prefix}.anchors", (b,), torch.int64)
    if _flag(record, "overlay"):
        overlay.tokens = source.read(f"{prefix}.overlay", (b, h, overlay.count, width), like.dtype)
    return spans.get("sinks", (0, 0))[0], codes, spans.get("window", (0, 0))[0]


def _span(buffers: dict, name: str, prefix: str) -> tuple[int, int]:
    value = buffers[name]
    ok = isinstance(value, list) and len(value) == 2 and all(type(v) is int and v >= 0 for v in value)
    _require(ok and value[0] <= value[1], f"{prefix}.{name}: [length, capacity] must be ints with length <= capacity, "
                                          f"got {value!r}")
    return value[0], value[1]


def _fill(buf: GrowableBuffer, live: torch.Tensor, capacity: int) -> None:
    """``buf`` holding ``live`` ``[B, H, n, ...]`` in a buffer of ``capacity`` rows, as the saved one had."""
    length = live.shape[2]
    data = live
    if capacity > length:
        data = live.new_empty(*live.shape[:2], capacity, *live.shape[3:])
        data[:, :, :length] = live
    buf.data, buf.length = data, length


# ---------------------------------------------------------------------- static layers
def _static_parts(store) -> dict[str, torch.Tensor | None]:
    """A static store's preallocated tensors by their name in the file (None: not allocated for these settings)."""
    return {"sinks": store.sinks, "codes": store.codes, "scales": store.scales, "zeros": store.zeros,
            "wide_bits": store.wide_bits, "wide_channels": store.wide_channels, "window": store.window,
            "anchors": store.overlay.anchors, "overlay": store.overlay.tokens}


def _static_rows(store, blocks: int, length: int) -> dict[str, int]:
    """Rows of each part that hold tokens when ``blocks`` slots are filled (slot ``j`` holds block ``j``) and ``length``
    tokens are held: what the file keeps (``memory_footprint()["used"]``). The rest is filler that the attention mask
    hides (zeros in a fresh allocation), or an overlay no padded row uses."""
    rows = blocks * store.spec.block_size
    per_scale = rows // store.spec.groups(store.head_dim)[0]
    window = max(0, length - store.sink_count - rows)
    return {"sinks": min(length, store.sink_count), "codes": rows, "scales": per_scale, "zeros": per_scale,
            "wide_bits": rows, "wide_channels": blocks, "window": window}


def _static_state(layer: StaticAsymKVLayer, prefix: str) -> tuple[dict, dict]:
    tensors = {}
    if layer.key_absmax is not None:
        tensors[f"{prefix}.key_absmax"] = layer.key_absmax.float()
    record = {"kind": "static", "initialized": bool(layer.is_initialized), "key_absmax": layer.key_absmax is not None}
    if not layer.is_initialized:
        return record, tensors
    length, blocks = int(layer.get_seq_length()), int(layer.blocks_stored)
    record.update(dtype=dtype_name(layer.dtype), length=length, blocks_stored=blocks,
                  counts=[int(n) for n in layer.counts.tolist()], record_past=layer.record_past, padded={})
    for kind, store in zip(KINDS, layer.stores):
        for name, rows in _static_rows(store, blocks, length).items():
            t = _static_parts(store)[name]
            if t is not None:
                tensors[f"{prefix}.{kind}.{name}"] = t[:, :, :rows]
        padded = store.overlay.anchors is not None and bool(store.overlay.anchors.any())
        record["padded"][kind] = padded
        if padded:
            tensors[f"{prefix}.{kind}.anchors"] = store.overlay.anchors
            tensors[f"{prefix}.{kind}.overlay"] = store.overlay.tokens
    return record, tensors


def _restore_static(layer: StaticAsymKVLayer, record: dict, prefix: str, source: TensorSource, empty: list) -> None:
    layer.lazy_initialization(*empty)  # allocates every buffer for max_cache_len tokens; the file's parts go in
    length, blocks = _int(record, "length"), _int(record, "blocks_stored")
    boundary = layer.sink_count + blocks * layer.block_size
    _require(length <= layer.max_cache_len, f"{length} tokens held, max_cache_len is {layer.max_cache_len}")
    _require(blocks <= layer.n_blocks, f"{blocks} blocks stored, the layer has {layer.n_blocks} slots")
    _require(blocks == 0 or boundary <= length, f"{blocks} blocks stored after {layer.sink_count} sinks, more than "
                                                f"the {length} tokens held")
    _require(length - boundary <= layer.window_tokens, f"{length - boundary} tokens after the last block, the window "
                                                       f"holds {layer.window_tokens}")
    counts, padded = record.get("counts"), record.get("padded")
    _require(isinstance(counts, list) and len(counts) == len(STATIC_COUNTERS)
             and all(type(n) is int and n >= 0 for n in counts),
             f"record field 'counts' must be {len(STATIC_COUNTERS)} ints >= 0 ({list(STATIC_COUNTERS)}), got {counts!r}")
    _require(isinstance(padded, dict) and set(padded) == set(KINDS), f"record 'padded' must name {list(KINDS)}")
    for kind, store in zip(KINDS, layer.stores):
        parts = [(name, rows) for name, rows in _static_rows(store, blocks, length).items()]
        if _flag(padded, kind):
            _require(store.sink_count > 0, f"{prefix}.{kind}: a padded rows' overlay without sink tokens")
            parts += [("anchors", None), ("overlay", None)]
        for name, rows in parts:
            buf = _static_parts(store)[name]
            if buf is not None:
                target = buf if rows is None else buf[:, :, :rows]
                # in place: the buffers keep their addresses (marked static for compiled graphs)
                target.copy_(source.read(f"{prefix}.{kind}.{name}", tuple(target.shape), buf.dtype))
    layer.length.fill_(length)
    layer.blocks_stored.fill_(blocks)
    layer.counts.copy_(torch.tensor(counts, dtype=layer.counts.dtype))
    layer.record_past = _flag(record, "record_past")


# ---------------------------------------------------------------------- transformers' own layers
def _transformers_state(layer, prefix: str) -> tuple[dict, dict]:
    attributes = vars(layer)
    extra = sorted(name for name, value in attributes.items()
                   if name not in CARRIED + REBUILT and any(t.numel() for t in reachable_tensors(value)))
    if extra:
        raise ValueError(f"{type(layer).__name__} holds state a prompt-cache file does not carry ({extra}); only "
                         f"K/V layers ({list(CARRIED)}) are saved")
    # (transformers' DummyLayer, for KV-less and KV-sharing layers, says it is initialized and holds keys = None)
    initialized = bool(attributes.get("is_initialized", False)) and isinstance(attributes.get("keys"), torch.Tensor)
    record = {"kind": "transformers", "class": type(layer).__name__, "initialized": initialized}
    if not initialized:
        return record, {}
    record["dtype"] = dtype_name(layer.keys.dtype)
    for name in CARRIED[2:]:  # lengths: ints, or 0-d tensors (static layers): stored as ints
        if isinstance(attributes.get(name), (int, torch.Tensor)):
            record[name] = int(attributes[name])
    if isinstance(attributes.get("record_past"), bool):
        record["record_past"] = attributes["record_past"]
    return record, {f"{prefix}.keys": layer.keys, f"{prefix}.values": layer.values}


def _restore_transformers(layer, record: dict, prefix: str, source: TensorSource, empty: list) -> None:
    (b, h, _, key_width), value_width = empty[0].shape, empty[1].shape[3]
    keys = source.read(f"{prefix}.keys", (b, h, None, key_width), empty[0].dtype)
    values = source.read(f"{prefix}.values", (b, h, keys.shape[2], value_width), empty[1].dtype)
    layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])
    for name, t in (("keys", keys), ("values", values)):
        current = getattr(layer, name, None)
        if isinstance(current, torch.Tensor) and current.shape == t.shape and current.dtype == t.dtype:
            current.copy_(t)  # a static layer's buffer keeps its address
        else:
            setattr(layer, name, t)
    for name in CARRIED[2:]:
        if name in record:
            value = _int(record, name)
            current = getattr(layer, name, None)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            else:
                setattr(layer, name, value)
    if "record_past" in record:
        layer.record_past = _flag(record, "record_past")
