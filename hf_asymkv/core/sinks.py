"""Exact sinks for left-padded rows: an overlay of each row's first real tokens over the quantized blocks.

A layer keeps its first ``sink_tokens`` tensor positions exact (the sink prefix). In a left-padded batch those
positions are pads for the padded rows, whose own first tokens (the attention sinks the model leans on) would be
quantized. The layout stays one for every row (prefix, blocks, window: what a kernel or a static cache indexes);
each row gets an *anchor*, the tensor index of its first real token, and :class:`SinkOverlay` keeps an exact copy
of the row's ``sink_tokens`` tokens from there that fall inside the quantized blocks:

- captured when their block is quantized (the exact values are at hand then), so an unpadded batch, or a row
  whose sinks are in the prefix or the window, allocates nothing;
- the dense read writes them back over their positions (:meth:`~hf_asymkv.core.kv_view.QuantizedKV.dense`); the
  fused attention drops those positions from the quantized scores and attends to the exact copies instead.

Anchors come from the ``position_ids`` transformers hands the cache (:func:`row_starts`); where it hands none
(releases before 5.24, :func:`~hf_asymkv.core.compat.update_position_ids`) every row starts at 0, as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .kv_view import SinkOverlayView

__all__ = ["SinkOverlay", "row_starts"]


def row_starts(position_ids: torch.Tensor | None, batch: int, n: int) -> torch.Tensor | None:
    """Tensor index of each row's first real token, from the ``position_ids`` of the first ``n`` tokens of an empty
    layer: ``n - 1 - position of the last token`` (left padding puts a row's first real token at position 0).

    Args:
        position_ids: ``[B, n]`` or ``[1, n]`` (``[3, B, n]`` multimodal rope: the first row), or None.

    Returns:
        ``[B]`` long in ``[0, n)``, or None when every row starts at 0 or the ids do not fit this update.
    """
    if position_ids is None:
        return None
    pos = position_ids[0] if position_ids.dim() == 3 else position_ids
    if pos.dim() != 2 or pos.shape[-1] != n or pos.shape[0] not in (1, batch) or n == 0:
        return None
    starts = (n - 1 - pos[:, -1].long()).clamp(0, n - 1).expand(batch)
    return starts.clone() if bool(starts.any()) else None


class SinkOverlay:
    """Exact copies of each row's first ``count`` real tokens that lie in the quantized region of one store.

    Attributes:
        anchors: ``[B]`` long, each row's first real token (None: every row starts at 0, nothing to overlay).
        tokens: ``[B, H, count, D]`` exact tokens (slot ``j`` holds position ``anchors[b] + j``), allocated at
            the first capture.
    """

    def __init__(self, count: int):
        self.count = count
        self.anchors: torch.Tensor | None = None
        self.tokens: torch.Tensor | None = None

    def set_anchors(self, anchors: torch.Tensor | None) -> None:
        self.anchors, self.tokens = anchors, None

    def positions(self) -> torch.Tensor:
        """``[B, count]`` absolute positions of the slots."""
        return self.anchors[:, None] + torch.arange(self.count, device=self.anchors.device)

    def capture(self, x: torch.Tensor, start: int) -> None:
        """Keep the slots among ``x`` (``[B, H, m, D]`` exact tokens at positions ``[start, start + m)``, about to be
        quantized)."""
        if self.anchors is None or not self.count:
            return
        rel = self.positions() - start
        inside = (rel >= 0) & (rel < x.shape[2])
        if not bool(inside.any()):
            return
        b, h, _, d = x.shape
        if self.tokens is None:
            self.tokens = x.new_zeros(b, h, self.count, d)
        index = rel.clamp(0, x.shape[2] - 1)[:, None, :, None].expand(b, h, self.count, d)
        self.tokens = torch.where(inside[:, None, :, None], x.gather(2, index), self.tokens)

    def view(self, start: int, stop: int) -> SinkOverlayView | None:
        """The slots inside the quantized region ``[start, stop)`` (absolute positions), or None if there are none."""
        if self.tokens is None:
            return None
        positions = self.positions()
        return SinkOverlayView(self.tokens, positions, (positions >= start) & (positions < stop))

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.anchors is not None:
            self.anchors = fn(self.anchors)
        if self.tokens is not None:
            self.tokens = fn(self.tokens)

    def nbytes(self) -> int:
        return 0 if self.tokens is None else self.tokens.numel() * self.tokens.element_size()
