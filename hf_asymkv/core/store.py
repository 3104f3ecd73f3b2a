"""Storage of one tensor kind (keys or values) of one layer: growable buffers, quantized blocks, exact ends.

A :class:`TensorStore` holds, in token order::

    [ sinks (exact) ][ quantized blocks: codes, scales, zeros ][ window (exact) ]

plus, for left-padded rows, exact copies of their own first tokens where those lie in the blocks
(:class:`~hf_asymkv.core.sinks.SinkOverlay`).

K and V each get one, built from their own :class:`~hf_asymkv.core.quant.QuantSpec` (which carries the block
size) and the layer's :class:`~hf_asymkv.core.config.Growth`; everything else about them is the same code path. :class:`~hf_asymkv.core.layer.AsymKVLayer` decides *how many* tokens go where
(one decision for both kinds), the stores carry it out.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import torch

from .append import store_dynamic, uses_kernel
from .config import Growth
from .kv_view import QuantizedKV, write_rows
from .packing import PackedCodes, pack_codes
from .quant import (
    QuantSpec,
    code_levels,
    compute_scale_zero,
    dequantize,
    needs_wider_metadata,
    quantize,
    scale_from_absmax,
    storage_offset,
)
from .rotation import dequantize_rotated, hadamard_transform
from .sinks import SinkOverlay
from .wide import WideBits, choose_channels, split_wide

__all__ = ["GrowableBuffer", "QuantizedBlocks", "TensorStore", "encode_blocks", "stored_form"]


def stored_form(x: torch.Tensor, spec: QuantSpec, clean: bool) -> torch.Tensor:
    """What is quantized of ``x`` ``[B, H, m, D]``: ``x @ H`` (float32, :func:`~hf_asymkv.core.rotation.hadamard_transform`)
    for a rotated spec, with NaN/inf first set to 0 when ``clean`` (rotating an inf would spread it over the token's
    every channel); ``x`` itself otherwise."""
    if not spec.rotated:
        return x
    x = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0) if clean else x
    return hadamard_transform(x)


def encode_blocks(x: torch.Tensor, spec: QuantSpec, scale: torch.Tensor | None = None
                  ) -> tuple[PackedCodes, torch.Tensor, torch.Tensor | None, WideBits | None]:
    """Quantize whole blocks ``[B, H, m, D]`` (in their :func:`stored_form`): ``(codes, scale, zero, wide)``, the
    scale (and zero) measured from ``x`` unless a calibrated symmetric ``scale`` ``[B, H, m // tg, D // cg]`` is
    given; ``wide`` the high bits of the blocks' wide channels (:mod:`~hf_asymkv.core.wide`), None without them."""
    if spec.wide_fraction:
        return _encode_wide(x, spec, scale)
    zero = None
    if scale is None:
        scale, zero = compute_scale_zero(x, spec)
    return quantize(x, scale, zero, spec), scale, zero, None


def _encode_wide(x: torch.Tensor, spec: QuantSpec, scale: torch.Tensor | None
                 ) -> tuple[PackedCodes, torch.Tensor, torch.Tensor, WideBits]:
    """:func:`encode_blocks` for a spec with ``wide_fraction``: each block's widest channels (largest scale) take
    the scale (and zero) of a code one bit wider, their codes split into the ordinary planes and the high bits."""
    wider = dataclasses.replace(spec, fmt=f"int{spec.bits + 1}", wide_fraction=0.0)
    if scale is None:
        scale, zero = compute_scale_zero(x, spec)
        wide_scale, wide_zero = compute_scale_zero(x, wider)
    else:  # a calibrated range: the same range, the wider code's step
        zero = wide_zero = None
        wide_scale = scale_from_absmax(scale.float() * spec.qmax, wider)
    channels = choose_channels(scale, spec.wide_count(x.shape[-1]))  # [B, H, N, R]
    chosen = torch.zeros(scale.shape, dtype=torch.bool, device=scale.device).scatter_(-1, channels, True)
    scale = torch.where(chosen, wide_scale, scale)
    zero = None if zero is None else torch.where(chosen, wide_zero, zero)
    levels = code_levels(x, scale, zero, wider)  # the wider code's range; the other channels are clamped below
    per_token = chosen.repeat_interleave(spec.block_size, dim=2)  # [B, H, m, D]
    lo = -spec.qmax if spec.symmetric else 0.0
    stored = torch.where(per_token, levels + storage_offset(wider),
                         levels.clamp(lo, spec.qmax) + storage_offset(spec))
    low, wide = split_wide(stored, channels, spec.bits, spec.block_size)
    return pack_codes(low, spec.bits, spec.block_size), scale, zero, wide


class GrowableBuffer:
    """A tensor that grows along the token axis (dim 2): ``data[:, :, :length]`` is live, the rest capacity."""

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None
        self.length = 0

    @property
    def live(self) -> torch.Tensor:
        return self.data[:, :, : self.length]

    def append(self, x: torch.Tensor, growth: Growth | None = None, multiple: int = 1,
               max_step: int | None = None) -> None:
        """Append ``x`` (``[B, H, n, ...]``).

        When full, capacity grows as ``growth`` says (by ``growth.factor`` x, by at most ``max_step`` rows,
        default ``growth.max_tokens``), rounded up to ``multiple``: one copy of the live rows per growth, so
        O(n / max_step) copies over n appended rows. ``growth=None``: exactly the rows needed.
        """
        self.extend(x.shape[2], x, growth, multiple, max_step).copy_(x)

    def extend(self, n: int, like: torch.Tensor, growth: Growth | None = None, multiple: int = 1,
               max_step: int | None = None) -> torch.Tensor:
        """Make ``n`` more rows live and return them (a view, to be written: what :meth:`append` copies into, and
        where the append kernel writes directly). ``like``: rows of the buffer's shape and dtype (``[B, H, *, ...]``,
        any length); growth as in :meth:`append`."""
        needed = self.length + n
        if self.data is None or needed > self.data.shape[2]:
            cap = 0 if self.data is None else self.data.shape[2]
            new_cap = needed if growth is None else growth.capacity(cap, needed, multiple, max_step)
            new = like.new_empty(*like.shape[:2], new_cap, *like.shape[3:])
            if self.length:
                new[:, :, : self.length] = self.live
            self.data = new
        rows = self.data[:, :, self.length : needed]
        self.length = needed
        return rows

    def truncate(self, length: int) -> None:
        self.length = length

    def drop_front(self, n: int, release: bool = False) -> None:
        """Remove the first ``n`` live rows (the rest moves to the front, in a new tensor: see :meth:`replace_rows`);
        capacity far beyond the live rows is released, so a long-lived buffer does not keep the size of one long
        burst; ``release``: all of it (the new tensor holds the rest exactly)."""
        if n == 0:
            return
        rest = self.data[:, :, n : self.length]
        self.replace_rows(rest, keep_capacity=not release and self.data.shape[2] <= 2 * rest.shape[2] + 64)

    def replace_rows(self, x: torch.Tensor, growth: Growth | None = None, keep_capacity: bool = True) -> None:
        """Hold exactly the rows ``x`` ``[B, H, n, ...]`` instead of the live ones, in a new tensor of this buffer's
        capacity (``keep_capacity=False``: from none; grown as :meth:`append` grows when ``x`` needs more). Never
        written over the rows held before: a caller that kept the old tensor and length still has them
        (:mod:`~hf_asymkv.core.rollback` restores an interrupted update so)."""
        old = self.data if keep_capacity else None
        self.data = None if old is None else old.new_empty(old.shape)
        self.length = 0
        self.append(x, growth)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.data is not None:
            self.data = fn(self.data)

    def nbytes(self) -> tuple[int, int]:
        """``(allocated bytes, bytes of unused capacity)``."""
        if self.data is None:
            return 0, 0
        per_row = self.data[:, :, :1].numel() * self.data.element_size()
        return self.data.numel() * self.data.element_size(), (self.data.shape[2] - self.length) * per_row


class QuantizedBlocks:
    """Append-only quantized blocks of one tensor kind.

    Shapes: codes ``[B, H, N, spec.packed_dim(D)]`` in ``spec.layout`` (token-packed sub-byte codes of whole
    blocks, see :mod:`~hf_asymkv.core.packing`); scales and zeros ``[B, H, N // tg, D // cg]`` with
    ``(tg, cg) = spec.groups(D)`` (zeros stay empty for symmetric specs); with ``R = spec.wide_count(D)``, the
    wide channels' high bits ``[B, H, N, ceil(R / 8)]`` and indices ``[B, H, N // bs, R]``
    (:class:`~hf_asymkv.core.wide.WideBits`). ``N`` is a multiple of
    ``spec.block_size``: blocks are quantized once, whole, and never re-quantized.
    """

    def __init__(self, spec: QuantSpec, growth: Growth):
        self.spec, self.growth = spec, growth
        self.codes, self.scales, self.zeros = GrowableBuffer(), GrowableBuffer(), GrowableBuffer()
        self.wide_bits, self.wide_channels = GrowableBuffer(), GrowableBuffer()
        self.device_counts: torch.Tensor | None = None  # what the append kernel counts (hf_asymkv.core.append)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def max_step(self) -> int:
        """The most code rows one growth adds: ``growth.max_tokens`` rounded down to whole blocks (one at least)."""
        return max(self.block_size, self.growth.max_tokens // self.block_size * self.block_size)

    @property
    def length(self) -> int:
        return self.codes.length

    def fit(self, x: torch.Tensor) -> QuantSpec:
        """Make the metadata dtype hold ``x``'s range and return the spec to quantize ``x`` with.

        Scales and zeros are stored in ``spec.scale_dtype`` (float16 for values) while the range fits; the
        first block that would overflow it switches this store's metadata to float32, existing rows included
        (lossless), so no value is ever decoded from a clamped zero or scale.
        """
        if needs_wider_metadata(x, self.spec):
            self.spec = dataclasses.replace(self.spec, scale_dtype=torch.float32)
            for buf in (self.scales, self.zeros):
                buf.map_batch(lambda t: t.float())
        return self.spec

    def append(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> int:
        """Quantize ``[B, H, m, D]`` (m a multiple of ``block_size``) once and append it.

        Non-finite elements are stored as documented in :func:`~hf_asymkv.core.quant.quantize` (NaN as 0,
        +-inf as the group's extremes) and counted; a rotated spec stores them as 0 (rotating an inf would
        spread it over the token's every channel).

        Args:
            scale: a precomputed (calibrated) symmetric scale ``[B, H, m // tg, D // cg]`` made with the spec
                :meth:`fit` returned for ``x``; measured from ``x`` when None.

        Returns:
            the number of non-finite elements in ``x`` (0 when the append kernel quantizes ``x``: it counts them on
            the device, :func:`~hf_asymkv.core.append.take_counts`).
        """
        if uses_kernel(x, self.spec):
            store_dynamic(self, x, scale)
            return 0
        nonfinite = int((~torch.isfinite(x)).sum())
        x = stored_form(x, self.spec, clean=bool(nonfinite))
        self.fit(x)
        m = x.shape[2]
        codes, scale, zero, wide = encode_blocks(x, self.spec, scale)
        self.codes.append(codes.data, self.growth, self.block_size, self.max_step)
        if wide is not None:
            self.wide_bits.append(wide.bits, self.growth, self.block_size, self.max_step)
        rows = (self.scales, scale), (self.zeros, zero), (self.wide_channels, None if wide is None else wide.channels)
        for buf, meta in rows:
            if meta is not None:  # metadata rows per token: 1 / token_group (1 / block_size for wide channels)
                buf.append(meta, self.growth, 1, max(1, self.max_step * meta.shape[2] // m))
        return nonfinite

    def parts(self, start: int, stop: int
              ) -> tuple[PackedCodes, torch.Tensor, torch.Tensor | None, WideBits | None]:
        """``(codes, scales, zeros, wide)`` of quantized tokens ``[start, stop)`` (block-aligned; views)."""
        tg = self.spec.token_group
        r0, r1 = start // tg, stop // tg
        codes = PackedCodes(self.codes.live, self.spec.bits, self.spec.layout, self.block_size)
        zeros = self.zeros.live[:, :, r0:r1] if self.zeros.length else None
        wide = None
        if self.wide_channels.length:
            wide = WideBits(self.wide_bits.live, self.wide_channels.live).token_slice(start, stop, self.block_size)
        return codes.token_slice(start, stop), self.scales.live[:, :, r0:r1], zeros, wide

    def decode(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Dequantize tokens ``[start, stop)`` (block-aligned), rotated back: ``[B, H, stop - start, head_dim]``."""
        codes, scales, zeros, wide = self.parts(start, stop)
        if self.spec.rotated:  # (a rotated spec has no wide channels)
            return dequantize_rotated(codes, scales, zeros, self.spec, dtype=dtype)
        return dequantize(codes, scales, zeros, self.spec, dtype=dtype, wide=wide)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` (block-aligned) tokens."""
        rows = n // self.spec.token_group
        self.codes.truncate(n)
        self.scales.truncate(rows)
        self.zeros.truncate(rows if self.zeros.length else 0)
        self.wide_bits.truncate(n if self.wide_bits.length else 0)
        self.wide_channels.truncate(n // self.block_size if self.wide_channels.length else 0)

    def drop_front(self, n: int) -> None:
        """Remove the first ``n`` (block-aligned) tokens: what a sliding-window layer's window has left behind. The
        rest moves to new tensors of exactly its size (:meth:`GrowableBuffer.drop_front`): nothing held before is
        written over, and a layer that drops a block for each it adds holds no unused capacity."""
        rows = n // self.spec.token_group
        self.codes.drop_front(n, release=True)
        self.scales.drop_front(rows, release=True)
        self.zeros.drop_front(rows if self.zeros.length else 0, release=True)
        self.wide_bits.drop_front(n if self.wide_bits.length else 0, release=True)
        self.wide_channels.drop_front(n // self.block_size if self.wide_channels.length else 0, release=True)

    def buffers(self) -> dict[str, GrowableBuffer]:
        """The parts by footprint name (``wide_bits`` and ``wide_channels`` only for a spec with wide channels)."""
        parts = {"codes": self.codes, "scales": self.scales, "zeros": self.zeros}
        if self.spec.wide_fraction:
            parts.update(wide_bits=self.wide_bits, wide_channels=self.wide_channels)
        return parts


class TensorStore:
    """Everything one layer stores of one tensor kind (``kind`` is ``"key"`` or ``"value"``).

    Args:
        kind: names the parts in :meth:`memory_footprint` (``key_codes``, ``sink_keys``, ...).
        spec: how the quantized blocks are stored (block size included).
        growth: how the buffers grow.
        sink_tokens: the size of a left-padded row's exact sink overlay.
    """

    def __init__(self, kind: str, spec: QuantSpec, growth: Growth, sink_tokens: int = 0):
        self.kind, self.growth = kind, growth
        self.sinks, self.window = GrowableBuffer(), GrowableBuffer()
        self.blocks = QuantizedBlocks(spec, growth)
        self.overlay = SinkOverlay(sink_tokens)
        self.head_dim = 0

    @property
    def spec(self) -> QuantSpec:
        """The blocks' spec (its metadata dtype may have widened, see :meth:`QuantizedBlocks.fit`)."""
        return self.blocks.spec

    def check_width(self, head_dim: int) -> None:
        """Fail at the first update, with the shapes at hand, rather than deep inside a reshape."""
        self.spec.groups(head_dim)
        self.spec.packed_dim(head_dim)
        self.head_dim = head_dim

    def respec(self, spec: QuantSpec, growth: Growth) -> None:
        """Store future blocks with ``spec`` and grow with ``growth``; only while no block is stored (the exact sinks
        and window are kept as they are).

        Raises:
            ValueError: blocks are already stored, or ``spec`` does not fit the head_dim seen so far.
        """
        if self.blocks.length:
            raise ValueError(f"cannot change how {self.kind}s are stored: {self.blocks.length} tokens are already "
                             "quantized (change settings before the first block, e.g. right after the prefill).")
        self.blocks, self.growth = QuantizedBlocks(spec, growth), growth
        if self.head_dim:
            self.check_width(self.head_dim)

    def joined(self, new: torch.Tensor) -> torch.Tensor:
        """Window + ``new`` tokens; bounded by ``residual_length + block_size + n`` (never the whole cache)."""
        return new if self.window.length == 0 else torch.cat([self.window.live, new], dim=2)

    def push(self, new: torch.Tensor, n_sink: int, n_flush: int, scale: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, int]:
        """Store ``new`` ``[B, H, n, D]``: the first ``n_sink`` tokens become sinks, the rest join the window,
        and the oldest ``n_flush`` window tokens (a multiple of the block size) are quantized.

        Returns:
            ``(tail, nonfinite)``: the exact tokens after the quantized region as it was before this call (old
            window + new non-sink tokens, ``[B, H, m, D]``), what attention reads exact in this step, the tokens
            quantized now included (it may be a view of the window buffer; :meth:`read` never hands it out as
            is); and the number of non-finite elements quantized.
        """
        if n_sink:
            self.sinks.append(new[:, :, :n_sink])
            new = new[:, :, n_sink:]
        # While nothing is quantized the window grows by exactly what comes in, as a DynamicCache does: a short
        # prompt then holds no more bytes than a DynamicCache (growth slack would make it hold more).
        growth = self.growth if self.blocks.length else None
        if not n_flush:
            self.window.append(new, growth)
            return self.window.live, 0
        tail = self.joined(new)
        self.overlay.capture(tail[:, :, :n_flush], self.sinks.length + self.blocks.length)
        first = not self.blocks.length  # the first flush: drop the tight window's capacity (sized before any block)
        nonfinite = self.blocks.append(tail[:, :, :n_flush], scale)
        self.window.replace_rows(tail[:, :, n_flush:], self.growth, keep_capacity=not first)
        return tail, nonfinite

    def flush(self, n_flush: int, scale: torch.Tensor | None = None) -> int:
        """Quantize the oldest ``n_flush`` window tokens (a multiple of the block size) into blocks.

        Returns:
            the number of non-finite elements quantized.
        """
        if not n_flush:
            return 0
        self.overlay.capture(self.window.live[:, :, :n_flush], self.sinks.length + self.blocks.length)
        first = not self.blocks.length
        nonfinite = self.blocks.append(self.window.live[:, :, :n_flush], scale)
        if first:  # as in push: the window buffer was sized for everything before the first block; keep the rest only
            rest = self.window.live[:, :, n_flush:]
            self.window = GrowableBuffer()
            self.window.append(rest, self.growth)
        else:
            self.window.drop_front(n_flush)
        return nonfinite

    def read(self, n_old: int, tail: torch.Tensor, as_views: bool) -> torch.Tensor | QuantizedKV:
        """What attention gets: sinks + the first ``n_old`` quantized tokens + ``tail``, ``[B, H, seq, D]``.

        Dense (one vectorized decode into a fresh tensor), or with ``as_views`` the stored parts as a
        :class:`~hf_asymkv.core.kv_view.QuantizedKV` for the fused attention. Nothing handed out aliases the
        window buffer, which later updates rewrite in place.
        """
        if n_old == 0:
            if self.sinks.length:
                return torch.cat([self.sinks.live, tail], dim=2)
            return tail.clone() if tail._base is not None else tail
        codes, scales, zeros, wide = self.blocks.parts(0, n_old)
        ns = self.sinks.length
        kv = QuantizedKV(self.sinks.live if ns else None, codes, scales, zeros, self.spec,
                         tail.clone() if as_views and tail._base is not None else tail,
                         self.overlay.view(ns, ns + n_old), wide)
        return kv if as_views else kv.dense()

    def dense(self) -> torch.Tensor | None:
        """Every stored token, ``[B, H, seq, D]``, in a fresh tensor that nothing else references: the sinks and the
        window exact, the blocks decoded (padded rows' sinks written over them). None while nothing is stored."""
        if self.window.data is None and self.sinks.data is None:
            return None
        tail = self.window.live if self.window.data is not None else self.sinks.live[:, :, :0]
        out = self.read(self.blocks.length, tail, as_views=False)
        return out.clone() if out._base is not None else out

    def replace(self, new: torch.Tensor, n_sink: int) -> None:
        """Hold ``new`` ``[B, H, n, D]`` instead of every token held so far (no quantized block may be stored): the
        first ``n_sink`` tokens as sinks, the rest in the window, in buffers of exactly their size (the old ones,
        sized for what was there before, are released).

        Raises:
            ValueError: blocks are stored (their tokens would be quantized a second time).
        """
        if self.blocks.length:
            raise ValueError(f"cannot replace the {self.kind}s of a store that holds {self.blocks.length} quantized "
                             "tokens: they would be quantized a second time.")
        self.sinks, self.window = GrowableBuffer(), GrowableBuffer()
        self.push(new, n_sink, 0)

    def crop(self, keep: int, dtype: torch.dtype) -> int:
        """Keep the first ``keep`` tokens. Whole quantized blocks stay; the kept tokens of a partial block go
        back to the window as their dequantized values (what attention already saw).

        Returns:
            how many tokens went back from a quantized block to the window.
        """
        ns, nq = self.sinks.length, self.blocks.length
        if keep >= ns + nq:
            self.window.truncate(keep - ns - nq)
            return 0
        self.window.truncate(0)
        keep_q = max(keep - ns, 0)
        bs = self.blocks.block_size
        whole, partial = keep_q // bs * bs, keep_q % bs
        if partial:
            block = self.blocks.decode(whole, whole + bs, dtype)
            start = ns + whole
            overlay = self.overlay.view(start, start + bs)
            if overlay is not None:  # padded rows' sinks go back to the window exact
                write_rows(block, 2, overlay.positions - start, overlay.valid, overlay.tokens)
            self.window.replace_rows(block[:, :, :partial], self.growth)
        self.blocks.truncate(whole)
        self.sinks.truncate(min(keep, ns))
        return partial

    def buffers(self) -> dict[str, GrowableBuffer]:
        """Every buffer by its footprint name: ``sink_keys``, ``key_codes``, ..., ``window_keys``."""
        blocks = {f"{self.kind}_{name}": buf for name, buf in self.blocks.buffers().items()}
        return {f"sink_{self.kind}s": self.sinks, **blocks, f"window_{self.kind}s": self.window}

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for buf in self.buffers().values():
            buf.map_batch(fn)
        self.overlay.map_batch(fn)

    def memory_footprint(self) -> Counter:
        out: Counter = Counter()
        for name, buf in self.buffers().items():
            allocated, unused = buf.nbytes()
            out[name] += allocated
            out["unused_capacity"] += unused
        if self.overlay.nbytes():
            out[f"padded_sink_{self.kind}s"] += self.overlay.nbytes()
        return out
