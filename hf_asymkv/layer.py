"""One full-attention layer of the asymmetric KV cache: storage, append, dense read-out.

Token order inside a layer::

    [ sinks (exact) ][ quantized blocks ........ ][ window (exact) ]
      <= sink_tokens   multiple of block_size        >= residual_length once anything is quantized

New tokens enter the window. When the window holds at least ``residual_length + block_size`` tokens, every
whole block of ``block_size`` tokens that has aged out of the newest ``residual_length`` is quantized *once*
and appended to the code buffers; a closed block is never re-quantized.

Code buffers grow geometrically (x ``growth_factor``) but by at most ``max_growth_tokens`` at a time: small
caches get amortized O(1) appends, long ones keep unused capacity to a few percent of real memory. The copy
on growth costs O(n / max_growth_tokens) per token amortized, far below the O(n) per step that reading the
cache back costs anyway.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from transformers.cache_utils import CacheLayerMixin

from .attention import QuantizedKV
from .quant import QuantSpec, compute_scale_zero, dequantize, quantize, scale_from_absmax

__all__ = ["AsymKVLayer", "OVERFLOW_POLICIES"]

OVERFLOW_POLICIES = ("widen", "clip", "error")


class _Buffer:
    """A growable tensor along the token axis (dim 2): ``data[:, :, :length]`` is live, the rest is capacity."""

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None
        self.length = 0

    @property
    def live(self) -> torch.Tensor:
        return self.data[:, :, : self.length]

    def append(self, x: torch.Tensor, growth: float, multiple: int = 1, max_step: int | None = None) -> None:
        """Append ``x`` (``[B, H, n, ...]``).

        When full, capacity grows by ``growth`` x, by at most ``max_step`` rows, rounded up to ``multiple``.
        """
        needed = self.length + x.shape[2]
        if self.data is None or needed > self.data.shape[2]:
            cap = 0 if self.data is None else self.data.shape[2]
            step = math.ceil(cap * (growth - 1))
            new_cap = max(needed, cap + (step if max_step is None else min(step, max_step)))
            new_cap = -(-new_cap // multiple) * multiple
            new = x.new_empty(*x.shape[:2], new_cap, *x.shape[3:])
            if self.length:
                new[:, :, : self.length] = self.live
            self.data = new
        self.data[:, :, self.length : needed] = x
        self.length = needed

    def truncate(self, length: int) -> None:
        self.length = length

    def map_batch(self, fn) -> None:
        if self.data is not None:
            self.data = fn(self.data)

    def nbytes(self) -> tuple[int, int]:
        """``(allocated bytes, bytes of unused capacity)``."""
        if self.data is None:
            return 0, 0
        per_token = self.data[:, :, :1].numel() * self.data.element_size()
        return self.data.numel() * self.data.element_size(), (self.data.shape[2] - self.length) * per_token


class AsymKVLayer(CacheLayerMixin):
    """Cache layer with quantized K/V blocks between an exact sink prefix and an exact recent window.

    Args:
        key_spec: storage of keys (e.g. int8 per-channel).
        value_spec: storage of values (e.g. asymmetric int4 per-token groups).
        block_size: tokens per quantized block; K per-channel scales are per block.
        residual_length: newest tokens always kept exact.
        sink_tokens: first tokens always kept exact.
        growth_factor: capacity multiplier when a buffer is full (> 1).
        max_growth_tokens: the most tokens of capacity one growth adds.
        key_absmax: optional calibrated K range ``[kv_heads, head_dim]`` (post-RoPE absmax). With it, every
            block uses the calibrated scale unless a value exceeds it, then ``overflow_policy`` applies.
        overflow_policy: ``"widen"`` (that block's scale grows to fit, counted), ``"clip"`` (saturate,
            counted) or ``"error"`` (raise ``ValueError``).
        return_views: hand attention :class:`~hf_asymkv.attention.QuantizedKV` instead of dense K/V once
            anything is quantized (for ``attn_implementation="asymkv_sdpa"`` only).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(
        self,
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        *,
        block_size: int = 128,
        residual_length: int = 128,
        sink_tokens: int = 0,
        growth_factor: float = 1.25,
        max_growth_tokens: int = 256,
        key_absmax: torch.Tensor | None = None,
        overflow_policy: str = "widen",
        return_views: bool = False,
    ):
        super().__init__()
        self.return_views = return_views
        self.key_spec, self.value_spec = key_spec, value_spec
        self.block_size, self.residual_length, self.sink_tokens = block_size, residual_length, sink_tokens
        self.growth_factor, self.max_growth_tokens = growth_factor, max_growth_tokens
        self.key_absmax = key_absmax
        self.overflow_policy = overflow_policy
        self.stats: Counter = Counter()
        self._clear()

    def _clear(self) -> None:
        self._sink_k, self._sink_v = _Buffer(), _Buffer()
        self._win_k, self._win_v = _Buffer(), _Buffer()
        # Quantized region: codes per token, scales per (token group, channel group), zeros for asym specs.
        self._kq, self._ks, self._kz = _Buffer(), _Buffer(), _Buffer()
        self._vq, self._vs, self._vz = _Buffer(), _Buffer(), _Buffer()
        self.cumulative_length = 0

    def _buffers(self) -> dict[str, _Buffer]:
        return {
            "sink_keys": self._sink_k, "sink_values": self._sink_v,
            "key_codes": self._kq, "key_scales": self._ks, "key_zeros": self._kz,
            "value_codes": self._vq, "value_scales": self._vs, "value_zeros": self._vz,
            "window_keys": self._win_k, "window_values": self._win_v,
        }  # fmt: skip

    # ------------------------------------------------------------------ transformers layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self._head_dim = head_dim = key_states.shape[-1]
        # V may be narrower than K (e.g. MLA caches a latent as K and the rope part as V).
        self._v_head_dim = v_head_dim = value_states.shape[-1]
        # Fail here, with the shapes at hand, rather than deep inside a reshape.
        self.key_spec.groups(head_dim, self.block_size), self.key_spec.packed_dim(head_dim)
        self.value_spec.groups(v_head_dim, self.block_size), self.value_spec.packed_dim(v_head_dim)
        if self.key_absmax is not None:
            expected = (key_states.shape[1], head_dim)
            if tuple(self.key_absmax.shape) != expected:
                raise ValueError(f"Calibrated key range has shape {tuple(self.key_absmax.shape)}, model layer needs {expected}.")
            self.key_absmax = self.key_absmax.to(self.device, torch.float32)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[B, H, n, D]`` keys/values and return dense ``[B, H, seq_len, D]`` keys/values.

        Tokens quantized during this call are returned exact (they are at hand); older blocks come back
        dequantized in one vectorized op per tensor.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        # 1. Sinks take the very first tokens.
        take = min(n, self.sink_tokens - self._sink_k.length) if self._kq.length + self._win_k.length == 0 else 0
        sink_k, sink_v = key_states[:, :, :take], value_states[:, :, :take]
        key_states, value_states = key_states[:, :, take:], value_states[:, :, take:]
        # 2. The rest joins the window; whole aged-out blocks move to the quantized region. Quantizing comes
        # first: with a calibrated range and overflow_policy="error" it raises, and must leave the layer as it was.
        nq_before = self._kq.length
        total = self._win_k.length + key_states.shape[-2]
        n_flush = max(0, (total - self.residual_length) // self.block_size) * self.block_size
        if n_flush:
            tail_k = self._joined(self._win_k, key_states)
            tail_v = self._joined(self._win_v, value_states)
            self._quantize_append(tail_k[:, :, :n_flush], tail_v[:, :, :n_flush])
        self.cumulative_length += n
        if take > 0:
            self._sink_k.append(sink_k, 1.0)
            self._sink_v.append(sink_v, 1.0)
        if n_flush == 0:
            self._win_k.append(key_states, self.growth_factor)
            self._win_v.append(value_states, self.growth_factor)
            tail_k, tail_v = self._win_k.live, self._win_v.live
        else:
            self._win_k.truncate(0), self._win_v.truncate(0)
            self._win_k.append(tail_k[:, :, n_flush:], self.growth_factor)
            self._win_v.append(tail_v[:, :, n_flush:], self.growth_factor)
        (k_parts, k_spec, _), (v_parts, v_spec, _) = self._quantized_parts()
        return (self._read(self._sink_k, k_parts, k_spec, nq_before, tail_k),
                self._read(self._sink_v, v_parts, v_spec, nq_before, tail_v))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._clear()
        self.stats.clear()
        self.is_initialized = False

    def offload(self) -> None:
        self._map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t.to(self.device, non_blocking=True))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop tokens from the end. Negative: how many to remove; positive (legacy): the length to keep.

        Removing tokens inside a quantized block turns that block's remaining tokens back into window tokens
        (their dequantized values: what attention already saw); they are re-quantized when they age out
        again, which ``stats["requantized_tokens"]`` counts.
        """
        if not self.is_initialized:
            return
        keep = self.cumulative_length + tokens_to_remove if tokens_to_remove <= 0 else tokens_to_remove
        keep = max(0, min(keep, self.cumulative_length))
        ns, nq = self._sink_k.length, self._kq.length
        if keep >= ns + nq:
            self._truncate(self._win_k, self._win_v, keep - ns - nq)
        elif keep >= ns:
            self._uncommit_tail(keep - ns)
        else:
            self._uncommit_tail(0)
            self._truncate(self._sink_k, self._sink_v, keep)
        self.cumulative_length = keep

    # ------------------------------------------------------------------ reporting
    def memory_footprint(self) -> dict[str, int]:
        """Bytes of every tensor this layer holds, unused capacity included, by part."""
        out: Counter = Counter()
        for name, buf in self._buffers().items():
            allocated, unused = buf.nbytes()
            out[name] += allocated
            out["unused_capacity"] += unused
        return dict(out)

    def dense_elements(self) -> int:
        """Elements K and V would hold in full precision: ``B * H * seq_len * (D_k + D_v)`` (``2 * B * H * seq_len
        * D`` in the usual case of equal widths)."""
        for buf in self._buffers().values():
            if buf.data is not None:
                width = self._head_dim + self._v_head_dim
                return buf.data.shape[0] * buf.data.shape[1] * self.cumulative_length * width
        return 0

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _joined(window: _Buffer, new: torch.Tensor) -> torch.Tensor:
        """Window + new tokens; bounded by ``residual_length + block_size + n`` (never the whole cache)."""
        return new if window.length == 0 else torch.cat([window.live, new], dim=2)

    def _quantize_append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize ``[B, H, m, D]`` (m a multiple of ``block_size``) once and append the codes."""
        bs = self.block_size
        k_scale = self._key_scale(k)
        k_zero = None
        if k_scale is None:
            k_scale, k_zero = compute_scale_zero(k, self.key_spec, bs)
        v_scale, v_zero = compute_scale_zero(v, self.value_spec, bs)
        step = max(bs, self.max_growth_tokens // bs * bs)
        self._kq.append(quantize(k, k_scale, k_zero, self.key_spec, bs), self.growth_factor, bs, step)
        self._vq.append(quantize(v, v_scale, v_zero, self.value_spec, bs), self.growth_factor, bs, step)
        for buf, t in ((self._ks, k_scale), (self._kz, k_zero), (self._vs, v_scale), (self._vz, v_zero)):
            if t is not None:  # scale rows per token: 1 / token_group
                buf.append(t, self.growth_factor, 1, max(1, step * t.shape[2] // k.shape[2]))
        self.stats["tokens_quantized"] += k.shape[2]
        self.stats["blocks_quantized"] += k.shape[2] // bs
        self.stats["flushes"] += 1

    def _key_scale(self, k: torch.Tensor) -> torch.Tensor | None:
        """Per-block K scale from the calibrated range, applying the overflow policy; None when uncalibrated.

        Args:
            k: ``[B, H, m, D]`` keys about to be quantized (m a multiple of ``block_size``).

        Returns:
            ``[B, H, m // block_size, D]`` scales in the key spec's scale dtype.
        """
        if self.key_absmax is None:
            return None
        b, h, t, d = k.shape
        grouped = k.float().abs().nan_to_num(posinf=0.0).view(b, h, t // self.block_size, self.block_size, d)
        block_amax = grouped.amax(dim=3)  # [B, H, nblk, D]
        calib = self.key_absmax[None, :, None, :]
        over = block_amax > calib
        n_over = int(over.sum())
        if n_over:
            self.stats["key_overflow_channels"] += n_over
            if self.overflow_policy == "error":
                ratio = float((block_amax / calib).max())
                raise ValueError(
                    f"{n_over} key (block, head, channel) ranges exceed the calibrated absmax (worst x{ratio:.3g}) "
                    "with overflow_policy='error'; use 'widen' (default) or recalibrate on longer samples."
                )
            if self.overflow_policy == "clip":
                self.stats["key_clipped_values"] += int((grouped > calib[:, :, :, None, :]).sum())
            else:
                self.stats["key_widened_blocks"] += int(over.any(dim=-1).sum())
                calib = torch.maximum(block_amax, calib)
        return scale_from_absmax(calib.expand(b, h, t // self.block_size, d), self.key_spec)

    def _read(self, sink: _Buffer, parts: tuple[_Buffer, _Buffer, _Buffer], spec: QuantSpec, n_old: int,
              tail: torch.Tensor) -> torch.Tensor | QuantizedKV:
        """What attention gets: sinks + the first ``n_old`` quantized tokens + ``tail`` (exact), ``[B, H, seq, D]``.

        Dense (one vectorized decode into a fresh tensor), or with ``return_views`` the stored parts as a
        :class:`~hf_asymkv.attention.QuantizedKV` for the fused attention. ``tail`` may be a view of the window
        buffer, which later flushes rewrite in place: what is handed out never aliases it.
        """
        if n_old == 0:
            if sink.length:
                return torch.cat([sink.live, tail], dim=2)
            return tail.clone() if tail._base is not None else tail
        codes, scales, zeros = parts
        rows = n_old // spec.groups(tail.shape[-1], self.block_size)[0]
        kv = QuantizedKV(sink.live if sink.length else None, codes.live[:, :, :n_old], scales.live[:, :, :rows],
                         zeros.live[:, :, :rows] if zeros.length else None, spec, self.block_size,
                         tail.clone() if self.return_views and tail._base is not None else tail)
        return kv if self.return_views else kv.dense()

    @staticmethod
    def _truncate(k_buf: _Buffer, v_buf: _Buffer, length: int) -> None:
        k_buf.truncate(length)
        v_buf.truncate(length)

    def _quantized_parts(self) -> tuple:
        """``((codes, scales, zeros), spec, head_dim)`` of the quantized region, for K then V."""
        return (((self._kq, self._ks, self._kz), self.key_spec, self._head_dim),
                ((self._vq, self._vs, self._vz), self.value_spec, self._v_head_dim))

    def _uncommit_tail(self, keep_q: int) -> None:
        """Keep ``keep_q`` quantized tokens; whole blocks stay, a partial block's tokens go back to the window."""
        bs = self.block_size
        whole = keep_q // bs * bs
        partial = keep_q - whole
        self._truncate(self._win_k, self._win_v, 0)
        if partial:
            last_k, last_v = (self._dense_block(*bufs, spec, whole, dim) for bufs, spec, dim in self._quantized_parts())
            self._win_k.append(last_k[:, :, :partial], self.growth_factor)
            self._win_v.append(last_v[:, :, :partial], self.growth_factor)
            self.stats["requantized_tokens"] += partial
        for (codes, scales, zeros), spec, dim in self._quantized_parts():
            rows = whole // spec.groups(dim, bs)[0]
            codes.truncate(whole)
            scales.truncate(rows)
            zeros.truncate(rows if zeros.length else 0)

    def _dense_block(self, codes: _Buffer, scales: _Buffer, zeros: _Buffer, spec: QuantSpec, start: int,
                     head_dim: int) -> torch.Tensor:
        """Dequantize the block starting at token ``start``: ``[B, H, block_size, head_dim]``."""
        bs = self.block_size
        tg = spec.groups(head_dim, bs)[0]
        r0, r1 = start // tg, (start + bs) // tg
        z = zeros.live[:, :, r0:r1] if zeros.length else None
        return dequantize(codes.live[:, :, start : start + bs], scales.live[:, :, r0:r1], z, spec, bs, dtype=self.dtype)

    def _map_batch(self, fn) -> None:
        for buf in self._buffers().values():
            buf.map_batch(fn)
