"""Storage of one tensor kind (keys or values) of a static layer: preallocated, written in place, read densely.

:class:`StaticTensorStore` is the static counterpart of :class:`~hf_asymkv.core.store.TensorStore`: the same parts
(sinks, codes, scales, zeros, window, left-padded rows' sink overlay), in buffers sized once for ``max_cache_len``
tokens. :class:`~hf_asymkv.core.static.StaticAsymKVLayer` decides where tokens go with tensor arithmetic (the
filled length and the quantized blocks are 0-d tensors); the store's operations take those tensors and never read
them on the host, so a compiled step has no graph break and one shape whatever the length.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

from .append import store_slots, uses_kernel
from .kv_view import write_rows
from .packing import PackedCodes
from .quant import QuantSpec, dequantize
from .rotation import dequantize_rotated, hadamard
from .sinks import SinkOverlay
from .static_op import store_layout
from .store import encode_blocks, stored_form
from .wide import WideBits

__all__ = ["StaticTensorStore"]


class StaticTensorStore:
    """Everything a static layer stores of one tensor kind (``kind`` is ``"key"`` or ``"value"``).

    Shapes, once allocated (``S`` sink slots, ``NB`` block slots of ``bs = spec.block_size`` tokens, ``W`` window
    slots): sinks ``[B, H, S, D]``, codes ``[B, H, NB * bs, spec.packed_dim(D)]`` (the dynamic store's layout),
    scales and zeros ``[B, H, NB * bs // tg, D // cg]`` with ``(tg, cg) = spec.groups(D)`` (no zeros for symmetric
    specs), window ``[B, H, W, D]`` (window slot ``i`` holds the token at the layer's boundary + ``i``); with
    ``R = spec.wide_count(D)`` the wide channels' high bits ``[B, H, NB * bs, ceil(R / 8)]`` and indices ``[B, H, NB, R]``
    (:class:`~hf_asymkv.core.wide.WideBits`).

    Args:
        kind: names the parts in :meth:`memory_footprint`.
        spec: how blocks are stored (block size included).
        sink_count: exact sink slots.
    """

    def __init__(self, kind: str, spec: QuantSpec, sink_count: int):
        self.kind, self.spec, self.sink_count = kind, spec, sink_count
        self.overlay = SinkOverlay(sink_count)
        self.sinks = self.codes = self.scales = self.zeros = self.window = self.rotation = None
        self.wide_bits = self.wide_channels = None
        self.heads = self.head_dim = 0
        self.layout = ""

    def allocate(self, like: torch.Tensor, n_blocks: int, window_tokens: int) -> None:
        """Allocate for ``n_blocks`` blocks and ``window_tokens`` window slots, rows of ``like`` (``[B, H, n, D]``:
        batch, heads, width, dtype and device).

        Raises:
            ValueError: ``spec`` cannot store rows of this head_dim (a group size or packing that does not divide it).
        """
        b, h, _, d = like.shape
        tg, cg = self.spec.groups(d)
        width = self.spec.packed_dim(d)
        self.heads, self.head_dim = h, d
        slots = n_blocks * self.spec.block_size
        self.sinks = like.new_zeros(b, h, self.sink_count, d)
        self.codes = torch.zeros(b, h, slots, width, dtype=self.spec.code_dtype, device=like.device)
        meta = dict(dtype=self.spec.scale_dtype, device=like.device)
        self.scales = torch.zeros(b, h, slots // tg, d // cg, **meta)
        self.zeros = None if self.spec.symmetric else torch.zeros(b, h, slots // tg, d // cg, **meta)
        self.window = like.new_zeros(b, h, window_tokens, d)
        if self.spec.wide_fraction:
            r = self.spec.wide_count(d)
            self.wide_bits = torch.zeros(b, h, slots, -(-r // 8), dtype=torch.uint8, device=like.device)
            self.wide_channels = torch.zeros(b, h, n_blocks, r, dtype=torch.uint8, device=like.device)
        # the rotation as a tensor of the store (a graph reads it instead of calling the cached constructor), a copy of
        # its own: the store's footprint counts it
        self.rotation = hadamard(d, torch.float32, like.device).clone() if self.spec.rotated else None
        if self.sink_count:
            self.overlay.preallocate(b, h, d, like.dtype, like.device)
        self.layout = store_layout(self)  # what the attention operator is told of these buffers (static_op)

    @property
    def n_blocks(self) -> int:
        return self.codes.shape[2] // self.spec.block_size

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer (all of them have the batch axis first)."""
        parts = [self.sinks, self.codes, self.scales, self.zeros, self.window, self.overlay.anchors, self.overlay.tokens,
                 self.wide_bits, self.wide_channels]
        return [t for t in parts if t is not None]

    # ------------------------------------------------------------------ one update
    def write_sinks(self, new: torch.Tensor, start: torch.Tensor) -> None:
        """Sink slot ``s`` takes new token ``s - start`` where that is one of ``new``'s ``[B, H, n, D]``."""
        n = new.shape[2]
        if not self.sink_count or not n:
            return
        source = torch.arange(self.sink_count, device=new.device) - start
        inside = (source >= 0) & (source < n)
        taken = new.index_select(2, source.clamp(0, n - 1))
        self.sinks.copy_(torch.where(inside[None, None, :, None], taken, self.sinks))

    def joined(self, new: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """The window followed by ``new``'s non-sink tokens: ``[B, H, W + n, D]``, slot ``i`` the token at the boundary
        + ``i`` (slots past the filled length hold finite filler).

        ``offset`` (0-d) is the window slot of ``new``'s first token: the window's length, negative while sinks fill
        (the sink tokens are in the sinks; here their slots would precede slot 0, so they are left out).

        Written as a selection per slot, not as ``cat`` then ``index_copy_(new)``: inductor (torch 2.13) computes
        ``new`` straight into the concatenation's last ``n`` slots and then scatters from there into the same buffer,
        so a scatter that moves tokens within those slots read tokens it had just overwritten (issue 38: a compiled
        prefill with sinks was wrong). Nor is the base a ``cat``: inductor writes a concatenation's parts into one
        buffer, and the window's part, which needs nothing the graph computes, is written in the graph's first kernel
        for every layer at once, so that each layer's ``[B, H, W + n, D]`` buffer lived from the start of a compiled
        prefill to its layer (about 6 MiB per layer at 4k tokens on the default model).
        """
        n, w = new.shape[2], self.window.shape[2]
        slot = torch.arange(w + n, device=new.device)
        base = new.index_select(2, (slot - w).clamp(min=0))  # slots no token of ``new`` reaches: the window or filler
        if w:
            base = torch.where((slot < w)[:, None], self.window.index_select(2, slot.clamp(max=w - 1)), base)
        source = slot - offset  # the token of ``new`` for each slot
        taken = new.index_select(2, source.clamp(0, n - 1))
        return torch.where(((source >= 0) & (source < n))[:, None], taken, base)

    def store_blocks(self, tokens: torch.Tensor, candidates: int, targets: torch.Tensor, valid: torch.Tensor,
                     boundary: torch.Tensor, flushed_tokens: torch.Tensor, scale: torch.Tensor | None
                     ) -> torch.Tensor:
        """Quantize the first ``candidates`` blocks of ``tokens`` and write block ``f`` into slot ``targets[f]`` where
        ``valid[f]`` (the others rewrite what their slot holds); capture padded rows' sinks among the stored tokens.

        Returns:
            the number of non-finite elements stored (0-d).
        """
        bs = self.spec.block_size
        x = tokens[:, :, : candidates * bs]
        self.overlay.capture(x, boundary, flushed_tokens)
        if uses_kernel(x, self.spec):  # one launch writes the valid blocks' slots
            return store_slots(self, x, targets, valid, scale)
        codes, scale, zero, wide = encode_blocks(stored_form(x, self.spec, True), self.spec, scale)
        rows = bs // self.spec.token_group
        parts = [(self.codes, codes.data, bs), (self.scales, scale, rows), (self.zeros, zero, rows)]
        if wide is not None:
            parts += [(self.wide_bits, wide.bits, bs), (self.wide_channels, wide.channels, 1)]
        for buf, new, per_slot in parts:
            if buf is not None:
                _write_slots(buf, new, targets, valid, per_slot)
        b, h = x.shape[:2]
        nonfinite = (~torch.isfinite(x)).view(b, h, candidates, -1).sum(dim=(0, 1, 3))
        return (nonfinite * valid).sum()

    def read(self, tokens: torch.Tensor, boundary: torch.Tensor, max_len: int) -> torch.Tensor:
        """Dense ``[B, H, max_len, D]``: sinks, every block slot decoded, then ``tokens`` (:meth:`joined`) over the
        positions from ``boundary`` on and padded rows' exact sinks over theirs. The tail after the last slot starts
        at 0 (finite filler for positions no token fills)."""
        if torch.compiler.is_compiling():
            return self._compose(tokens, boundary, max_len)
        b, h, _, d = self.window.shape
        out = self.window.new_empty(b, h, max_len, d)
        ns, slots = self.sink_count, self.codes.shape[2]
        out[:, :, :ns] = self.sinks
        if slots:
            self._decode(out.dtype, out=out[:, :, ns : ns + slots])
        out[:, :, ns + slots :] = 0
        # positions past max_len clamp onto its last one; the value written is chosen by the position (exact from
        # the boundary on, as decoded before it), so every writer of a position writes the same value
        target = (boundary + torch.arange(tokens.shape[2], device=out.device)).clamp(max=max_len - 1)
        source = target - boundary
        exact = tokens.index_select(2, source.clamp(min=0))
        out.index_copy_(2, target, torch.where((source >= 0)[None, None, :, None], exact, out.index_select(2, target)))
        overlay = self.overlay.view(ns, boundary)
        if overlay is not None:
            write_rows(out, 2, overlay.positions, overlay.valid, overlay.tokens)
        return out

    def _compose(self, tokens: torch.Tensor, boundary: torch.Tensor, max_len: int) -> torch.Tensor:
        """:meth:`read` as one selection per position, for a compiled graph: the same values, but no in-place write
        into the output (a graph would copy the whole output for each of those), and no ``cat`` of sinks, decoded
        blocks and filler: inductor writes a concatenation's parts into one buffer, the sinks and the filler (which
        need nothing the graph computes) in its first kernel for every layer at once, so that each layer's
        ``[B, H, max_len, D]`` read-out lived from the start of a compiled prefill to its layer's attention (issue 38).
        Padded to ``max_len`` instead, each part is a masked read that fuses into the selection below."""
        b, h, w, d = tokens.shape
        ns, slots = self.sink_count, self.codes.shape[2]
        position = torch.arange(max_len, device=tokens.device)
        # the decoded blocks at their positions, 0 (filler) elsewhere
        out = F.pad(self._decode(tokens.dtype), (0, 0, ns, max_len - ns - slots)) if slots else \
            tokens.new_zeros(b, h, max_len, d)
        if ns:
            out = torch.where((position < ns)[:, None], F.pad(self.sinks, (0, 0, 0, max_len - ns)), out)
        source = position - boundary
        exact = tokens.index_select(2, source.clamp(0, w - 1))
        out = torch.where(((source >= 0) & (source < w))[:, None], exact, out)
        overlay = self.overlay
        if ns and overlay.tokens is not None:  # rows' sinks inside the quantized region [ns, boundary)
            slot = position[None, :] - overlay.anchors[:, None]  # [B, max_len]
            inside = (slot >= 0) & (slot < overlay.count) & (position >= ns) & (position < boundary)
            index = slot.clamp(0, overlay.count - 1)[:, None, :, None].expand(b, h, max_len, d)
            out = torch.where(inside[:, None, :, None], overlay.tokens.gather(2, index), out)
        return out

    def _decode(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every block slot decoded: ``[B, H, NB * bs, D]`` in ``dtype`` (into ``out`` when given)."""
        codes = PackedCodes(self.codes, self.spec.bits, self.spec.layout, self.spec.block_size)
        if self.spec.rotated:  # (a rotated spec has no wide channels)
            return dequantize_rotated(codes, self.scales, self.zeros, self.spec, dtype=dtype, out=out)
        wide = None if self.wide_bits is None else WideBits(self.wide_bits, self.wide_channels)
        return dequantize(codes, self.scales, self.zeros, self.spec, dtype=dtype, out=out, wide=wide)

    def keep_window(self, tokens: torch.Tensor, shift: torch.Tensor) -> None:
        """The window after this update: ``tokens`` (:meth:`joined`) from slot ``shift`` (the tokens just quantized
        leave it)."""
        window = self.window.shape[2]
        index = (shift + torch.arange(window, device=tokens.device)).clamp(max=tokens.shape[2] - 1)
        self.window.copy_(tokens.index_select(2, index))

    # ------------------------------------------------------------------ reporting
    def memory_footprint(self, held: int, blocks: int) -> Counter:
        """Allocated bytes by part (the dynamic store's names) and ``unused_capacity``: the share of each part that no
        token fills, for a layer holding ``held`` tokens of which ``blocks`` blocks are quantized."""
        quantized = blocks * self.spec.block_size
        window = max(0, held - self.sink_count - quantized)
        parts = {f"sink_{self.kind}s": (self.sinks, min(held, self.sink_count), self.sink_count),
                 f"{self.kind}_codes": (self.codes, quantized, self.codes.shape[2]),
                 f"{self.kind}_scales": (self.scales, quantized, self.codes.shape[2]),
                 f"{self.kind}_zeros": (self.zeros, quantized, self.codes.shape[2]),
                 f"window_{self.kind}s": (self.window, window, self.window.shape[2])}
        if self.wide_bits is not None:
            parts[f"{self.kind}_wide_bits"] = (self.wide_bits, quantized, self.codes.shape[2])
            parts[f"{self.kind}_wide_channels"] = (self.wide_channels, quantized, self.codes.shape[2])
        out: Counter = Counter()
        for name, (buf, live, capacity) in parts.items():
            nbytes = 0 if buf is None else buf.numel() * buf.element_size()
            out[name] += nbytes
            out["unused_capacity"] += nbytes - nbytes * live // capacity if capacity else 0
        if self.overlay.tokens is not None:  # preallocated for left-padded rows: unused while no row is padded
            nbytes = self.overlay.tokens.numel() * self.overlay.tokens.element_size()
            out[f"padded_sink_{self.kind}s"] += nbytes
            out["unused_capacity"] += 0 if bool(self.overlay.anchors.any()) else nbytes
        return out


def _write_slots(buf: torch.Tensor, new: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, rows: int) -> None:
    """Write ``new`` ``[B, H, F * rows, ...]`` into slots ``targets`` ``[F]`` of ``buf`` ``[B, H, NB * rows, ...]`` where
    ``valid`` ``[F]``; the other targeted slots are rewritten with what they hold (the targets are distinct)."""
    if buf.dtype.itemsize == 1 and buf.dtype.is_floating_point:  # fp8 codes: CPU index_copy_ has no float8 kernel,
        buf, new = buf.view(torch.uint8), new.view(torch.uint8)  # their bytes move the same
    b, h = buf.shape[:2]
    slots = buf.view(b, h, -1, rows, *buf.shape[3:])
    new = new.reshape(b, h, -1, rows, *new.shape[3:])
    keep = valid.view(1, 1, -1, *([1] * (slots.dim() - 3)))
    slots.index_copy_(2, targets, torch.where(keep, new, slots.index_select(2, targets)))
