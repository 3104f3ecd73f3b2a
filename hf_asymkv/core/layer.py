"""One full-attention layer of the asymmetric KV cache: storage, append, dense read-out, rollback.

Token order inside a layer::

    [ sinks (exact) ][ quantized blocks ........ ][ window (exact) ]
      <= sink_tokens   multiple of block_size        >= residual_length once anything is quantized

The same for every row of a batch. In a left-padded batch the sink positions of a padded row hold pads; that
row's own first ``sink_tokens`` tokens are kept exact as an overlay over the blocks (:mod:`hf_asymkv.core.sinks`),
anchored at the row's first real token, which the first update's ``position_ids`` give (transformers 5.24+).

New tokens enter the window. When the window holds at least ``residual_length + block_size`` tokens, every
whole block of ``block_size`` tokens that has aged out of the newest ``residual_length`` is quantized *once*
and appended to the code buffers; a closed block is never re-quantized.

Deferral: the tokens of the latest update can be kept *pending*: they do not count towards ageing, so nothing
that makes room for them is quantized until the next update or ``crop`` (then what has aged out is quantized
as usual). The window therefore never exceeds ``residual_length + block_size + n`` tokens, ``n`` the latest
update's. It is on while past recording is (``activate_past_recording()``: transformers' ``generate`` turns it on
for assisted decoding and for returned caches it may roll back, and may leave it on) or while
``keep_latest_exact`` is set (e.g. to keep a prefill exact until the step after it); ``reset()`` ends both.
With ``hold_updates`` (set by :class:`~hf_asymkv.core.cache.AsymKVCache` for each update: on when the attention
module calling it has forward hooks, :mod:`hf_asymkv.core.hooks`) a multi-token update is held pending the same
way, but only until :meth:`AsymKVLayer.settle`, which the cache calls at its next update of any layer: code that
runs between a layer's attention and the next layer's (a kvpress press) reads the update exact, and at most one
layer's update waits. The stored result is the same as without holding, one call later.

``layer.keys`` / ``layer.values`` read the layer as dense tensors and accept pruned K/V
(:mod:`hf_asymkv.core.kv_assign`), the part of transformers' layer API that kvpress presses use.

Rollback (``crop``) first removes tokens, then quantizes what has aged out. A rollback of no more than the
latest update's tokens (plus the window's surplus over ``residual_length``) is therefore exact while deferring:
the newest ``min(length, residual_length)`` tokens are the ones that came in, and no token is quantized twice.
A deeper rollback, or one without deferral, can only return the tokens of a partly removed block to the window
as their dequantized values (what attention saw); they are quantized again when they age out, which
``stats["requantized_tokens"]`` counts.

Buffers grow geometrically (x ``growth.factor``) but by at most ``growth.max_tokens`` at a time, so appending
n tokens copies the stored data O(n / max_tokens) times; unused capacity stays a few percent of real memory for
long caches.
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
from transformers.cache_utils import CacheLayerMixin

from .append import take_counts
from .compat import LayerAPICompat, crop_tokens_to_remove, mask_query_length, update_position_ids
from .config import LayerConfig
from .kv_assign import DECODING_PRESSES_NOTE, DenseKVAttributes
from .kv_view import QuantizedKV
from .quant import scale_from_absmax
from .rollback import restores_on_error
from .sinks import row_starts
from .store import TensorStore

__all__ = ["AsymKVLayer", "check_layer_config"]


class AsymKVLayer(DenseKVAttributes, LayerAPICompat, CacheLayerMixin):
    """Cache layer with quantized K/V blocks between an exact sink prefix and an exact recent window.

    Args:
        config: the layer's settings (:meth:`hf_asymkv.AsymKVConfig.layer_config`): K and V specs with their block
            size (K per-channel scales are per block), window (``residual_length`` newest tokens exact), sinks
            (``sink_tokens`` first tokens exact), overflow policy and buffer growth.
        key_absmax: optional calibrated K range ``[kv_heads, head_dim]`` (post-RoPE absmax). With it, every
            block uses the calibrated scale unless a value exceeds it, then ``config.overflow_policy`` applies:
            ``"widen"`` (that block's scale grows to fit, counted), ``"clip"`` (saturate, counted) or ``"error"``
            (raise ``ValueError``).
        return_views: hand attention :class:`~hf_asymkv.core.kv_view.QuantizedKV` instead of dense K/V once
            anything is quantized (for ``attn_implementation="asymkv_sdpa"`` only; `AsymKVCache` sets it at
            every update from the model's current attention implementation).

    Raises:
        ValueError: a config that is not a :class:`~hf_asymkv.core.config.LayerConfig`, or a calibrated
            ``key_absmax`` with a key spec that is not symmetric per channel (the calibrated range is a symmetric
            per-channel scale of unrotated keys).

    Example::

        layer = AsymKVLayer(AsymKVConfig(key_block_size=32).resolved([64]).layer_config())
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, config: LayerConfig, *, key_absmax: torch.Tensor | None = None, return_views: bool = False):
        super().__init__()
        check_layer_config(config, key_absmax)
        self.config = config
        self.return_views = return_views
        self.record_past = False  # transformers' name: set by activate_past_recording(), cleared by generate
        self.keep_latest_exact = False
        self.hold_updates = False  # AsymKVCache sets it per update: a multi-token update waits for settle()
        self.rollbacks = 0  # crops that removed tokens (the cache's reuse watch reads it)
        self.key_absmax = key_absmax
        self._stats: Counter = Counter()
        self._clear()

    @restores_on_error
    def reconfigure(self, config: LayerConfig) -> None:
        """Switch to ``config`` before anything is quantized: e.g. protection chosen from the prefill, which
        ``keep_latest_exact`` keeps exact until the next update. The exact sinks and window stay as they are.

        Raises:
            ValueError: blocks already stored, another ``sink_tokens`` once tokens are stored, or a config the
                layer's calibrated key range cannot serve.
        """
        self.check_reconfigure(config)
        for store, spec in zip(self.stores, (config.key_spec, config.value_spec)):
            store.respec(spec, config.growth)
        self.config = config

    def check_reconfigure(self, config: LayerConfig) -> None:
        """Raise the ``ValueError`` :meth:`reconfigure` would raise, changing nothing."""
        check_layer_config(config, self.key_absmax)
        if self.key_store.blocks.length:
            raise ValueError(f"cannot reconfigure a layer that holds {self.key_store.blocks.length} quantized tokens "
                             "(change settings before the first block, e.g. right after the prefill).")
        if self.cumulative_length and config.sink_tokens != self.sink_tokens:
            raise ValueError(f"cannot change sink_tokens from {self.sink_tokens} to {config.sink_tokens} once tokens "
                             "are stored.")

    # The settings as attributes (read by the cache, the tests and tools): one source, the config.
    key_spec = property(lambda self: self.config.key_spec)
    value_spec = property(lambda self: self.config.value_spec)
    block_size = property(lambda self: self.config.block_size)
    residual_length = property(lambda self: self.config.residual_length)
    sink_tokens = property(lambda self: self.config.sink_tokens)
    overflow_policy = property(lambda self: self.config.overflow_policy)

    def _clear(self) -> None:
        self.key_store = TensorStore("key", self.key_spec, self.config.growth, self.sink_tokens)
        self.value_store = TensorStore("value", self.value_spec, self.config.growth, self.sink_tokens)
        self.cumulative_length = 0
        self.pending_tokens = 0  # window tokens of the latest update kept out of ageing (see the module docstring)
        self.clear_assignments()

    @property
    def defers(self) -> bool:
        """Whether each update's tokens stay pending until the next update or crop (recording or asked for)."""
        return self.record_past or self.keep_latest_exact

    @property
    def stores(self) -> tuple[TensorStore, TensorStore]:
        """``(keys, values)``: every per-kind operation loops over these."""
        return self.key_store, self.value_store

    # ------------------------------------------------------------------ transformers layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        # V may be narrower than K (e.g. MLA caches a latent as K and the rope part as V).
        self.key_store.check_width(key_states.shape[-1])
        self.value_store.check_width(value_states.shape[-1])
        if self.key_absmax is not None:
            expected = (key_states.shape[1], key_states.shape[-1])
            if tuple(self.key_absmax.shape) != expected:
                raise ValueError(f"Calibrated key range has shape {tuple(self.key_absmax.shape)}, model layer needs {expected}.")
            self.key_absmax = self.key_absmax.to(self.device, torch.float32)
        self.is_initialized = True

    @restores_on_error  # an exception anywhere in a call leaves the layer as it was (hf_asymkv.core.rollback)
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor | QuantizedKV, torch.Tensor | QuantizedKV]:
        """Append ``[B, H, n, D]`` keys/values and return dense ``[B, H, seq_len, D]`` keys/values.

        Tokens quantized during this call are returned exact (they are at hand); older blocks come back
        dequantized in one vectorized op per tensor. The first update into an empty layer anchors each row's sinks
        at its first real token when transformers passes ``position_ids`` (see :mod:`hf_asymkv.core.sinks`).
        """
        self.check_no_half_assignment()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._settle()  # a held update is quantized before anything reads past it (the cache usually did it already)
        n = key_states.shape[-2]
        ks = self.key_store
        if self.cumulative_length == 0 and n and self.sink_tokens:
            anchors = row_starts(update_position_ids(args, kwargs), key_states.shape[0], n)
            for store in self.stores:
                store.overlay.set_anchors(anchors)
        # Sinks take the very first tokens; the rest joins the window, and every whole block that has aged out
        # of the newest residual_length tokens is quantized; while deferring, the new tokens do not age anything
        # (an empty update, a read, keeps the previous update's tokens pending).
        n_sink = min(n, self.sink_tokens - ks.sinks.length) if ks.blocks.length + ks.window.length == 0 else 0
        pending = (n - n_sink if self.defers or (self.hold_updates and n > 1) else 0) if n else self.pending_tokens
        n_flush = self._aged_out(ks.window.length + n - n_sink - pending)
        # The calibrated key scale comes first: with overflow_policy="error" it raises, and must leave the layer
        # as it was.
        key_scale = None
        if n_flush and self.key_absmax is not None:
            key_scale = self._key_scale(ks.joined(key_states[:, :, n_sink:])[:, :, :n_flush])
        n_old = ks.blocks.length
        pushed = (ks.push(key_states, n_sink, n_flush, key_scale), self.value_store.push(value_states, n_sink, n_flush))
        self.cumulative_length += n
        self.pending_tokens = pending
        self.clear_assignments()
        if n_flush:
            self._count_flush(n_flush, sum(nonfinite for _, nonfinite in pushed))
        return tuple(store.read(n_old, tail, self.return_views) for store, (tail, _) in zip(self.stores, pushed))

    @property
    def stats(self) -> Counter:
        """The layer's counters (``tokens_quantized``, ``blocks_quantized``, ``flushes``, ``nonfinite_values``, ...;
        ``AsymKVCache.stats()`` sums them). What the append kernel counts on the device (:mod:`hf_asymkv.core.append`)
        is read here, not in the step: a host sync when the kernel ran."""
        for store in self.stores:
            for name, n in take_counts(store.blocks).items():
                if name == "nonfinite_values":
                    self._count_nonfinite(n)
                else:
                    self._stats[name] += n
        return self._stats

    first_held = 0
    """Position of the oldest token held (a sliding-window layer drops what its window has left behind)."""

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length - self.first_held + mask_query_length(query_length), self.first_held

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Empty the layer and end any deferral (past recording, ``keep_latest_exact``); ``hold_updates`` stays."""
        self._clear()
        self._stats.clear()
        self.is_initialized = False
        self.record_past = self.keep_latest_exact = False

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

    def activate_past_recording(self, **kwargs) -> None:
        """Keep each update's tokens pending until the next update or ``crop``, so that a rollback of the latest
        update's tokens is exact (see the module docstring); quantization still runs, one update late.

        transformers' ``generate`` calls this (through the cache) before assisted decoding, and may leave it on;
        ``record_past = False`` or ``reset()`` turns it off. Keyword arguments (``recurrent_states_to_keep``, passed
        from transformers 5.25 for recurrent layers) do not concern attention layers and are ignored.
        """
        self.record_past = True

    @restores_on_error
    def crop(self, tokens_to_remove: int) -> None:
        """Remove ``-tokens_to_remove`` tokens from the end (0 keeps all), then quantize what has aged out.

        (transformers < 5.14 passes the length to keep instead: :func:`~hf_asymkv.core.compat.crop_tokens_to_remove`.)

        Raises:
            ValueError: a positive argument (transformers' layers refuse the old "keep this length" meaning too).
        """
        tokens_to_remove = crop_tokens_to_remove(tokens_to_remove, self.cumulative_length)
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove (or 0), got {tokens_to_remove}; "
                             "the positive 'length to keep' form is not supported.")
        if not self.is_initialized:
            return
        keep = max(0, self.cumulative_length + tokens_to_remove)
        moved = [store.crop(keep - self.first_held, self.dtype) for store in self.stores]
        self._stats["requantized_tokens"] += moved[0]
        self.rollbacks += keep < self.cumulative_length
        self.cumulative_length = keep
        self.clear_assignments()
        self.pending_tokens = 0  # a crop ends the deferral: what has aged out is quantized now
        self._flush_window()

    @restores_on_error
    def settle(self) -> None:
        """End the holding of the latest update (``hold_updates``): quantize what its tokens pushed out of the window,
        as the layer's next update would. Nothing to do while the layer defers (past recording,
        ``keep_latest_exact``: its tokens then stay pending until its next update or crop) or holds nothing."""
        self._settle()

    def _settle(self) -> None:
        if self.pending_tokens and not self.defers:
            self.pending_tokens = 0
            self._flush_window()

    @restores_on_error
    def replace_tokens(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold ``keys``/``values`` ``[B, H, n, D]`` instead of every token held so far (what a kvpress press
        assigns: the tokens it keeps of an exact prefill). They are stored like one update into an empty layer,
        pending (exact) until the next update, crop or :meth:`settle`, and quantized once when they age out.

        Raises:
            ValueError: keys and values of different lengths, a layer that already holds quantized blocks (their
                tokens would be quantized a second time), or a left-padded batch whose rows' sinks are anchored
                (the kept tokens no longer say where each row starts).
        """
        if keys.shape[2] != values.shape[2]:
            raise ValueError(f"replace_tokens takes keys and values of the same length, got {keys.shape[2]} and "
                             f"{values.shape[2]}.")
        if self.key_store.blocks.length:
            raise ValueError(f"new K/V ({keys.shape[2]} tokens) assigned to a layer that holds "
                             f"{self.key_store.blocks.length} quantized tokens: storing them would quantize those "
                             f"tokens a second time. {DECODING_PRESSES_NOTE}.")
        if self.key_store.overlay.anchors is not None:
            raise ValueError("new K/V assigned to a left-padded batch whose rows' sinks are anchored at their first "
                             "real token: the kept tokens no longer say where each row starts (run presses on "
                             "unpadded prompts, one row or rows of equal length).")
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        n = keys.shape[2]
        n_sink = min(n, self.sink_tokens)
        for store, new in zip(self.stores, (keys, values)):
            store.replace(new, n_sink)
        self.cumulative_length = n
        self.pending_tokens = n - n_sink
        self.clear_assignments()

    # ------------------------------------------------------------------ reporting
    def buffers(self) -> dict:
        """Every buffer of both stores by its footprint name (``sink_keys``, ``key_codes``, ...)."""
        return {**self.key_store.buffers(), **self.value_store.buffers()}

    def memory_footprint(self) -> dict[str, int]:
        """Bytes of every tensor this layer holds, unused capacity included, by part. Window tokens that wait exact
        (a held or deferred update) but that the next update or :meth:`settle` quantizes are their own part,
        ``pending_keys``/``pending_values``, taken out of ``window_*``: the layer is counted as it is, not settled."""
        out: Counter = Counter()
        for store in self.stores:
            out.update(store.memory_footprint())
        waiting = self._aged_out(self.key_store.window.length) if self.pending_tokens else 0
        for store in self.stores if waiting else ():
            window = store.window.data
            moved = waiting * window[:, :, :1].numel() * window.element_size()
            out[f"window_{store.kind}s"] -= moved
            out[f"pending_{store.kind}s"] += moved
        return dict(out)

    def dense_tokens(self) -> int:
        """Tokens transformers' own layer of this kind would hold in full precision: every token seen."""
        return self.cumulative_length

    def dense_elements(self) -> int:
        """Elements K and V would hold in full precision: ``B * H * dense_tokens() * (D_k + D_v)`` (``2 * B * H *
        seq_len * D`` in the usual case of equal widths)."""
        for buf in self.key_store.buffers().values():
            if buf.data is not None:
                width = self.key_store.head_dim + self.value_store.head_dim
                return buf.data.shape[0] * buf.data.shape[1] * self.dense_tokens() * width
        return 0

    # ------------------------------------------------------------------ internals
    def _aged_out(self, window_length: int) -> int:
        """Tokens to quantize for a window of ``window_length``: every whole block older than the newest
        ``residual_length`` tokens."""
        return max(0, (window_length - self.residual_length) // self.block_size) * self.block_size

    def _flush_window(self) -> None:
        """Quantize the aged-out blocks already in the window (after a rollback)."""
        n_flush = self._aged_out(self.key_store.window.length)
        if not n_flush:
            return
        key_scale = None
        if self.key_absmax is not None:
            key_scale = self._key_scale(self.key_store.window.live[:, :, :n_flush])
        nonfinite = sum(store.flush(n_flush, scale) for store, scale in zip(self.stores, (key_scale, None)))
        self._count_flush(n_flush, nonfinite)

    def _count_flush(self, n_flush: int, nonfinite: int) -> None:
        self._stats["tokens_quantized"] += n_flush
        self._stats["blocks_quantized"] += n_flush // self.block_size
        self._stats["flushes"] += 1
        self._count_nonfinite(nonfinite)

    def _count_nonfinite(self, nonfinite: int) -> None:
        if nonfinite:
            if not self._stats["nonfinite_values"]:
                warnings.warn(f"quantized K/V hold {nonfinite} NaN/inf values: they are stored as 0 (NaN) and as the "
                              "group's extreme value (+-inf), see hf_asymkv.core.quant.quantize; the model produced "
                              "non-finite keys or values (counted in cache.stats()['nonfinite_values']).",
                              RuntimeWarning, stacklevel=5)
            self._stats["nonfinite_values"] += nonfinite

    def _key_scale(self, k: torch.Tensor) -> torch.Tensor | None:
        """Per-block K scale from the calibrated range, applying the overflow policy.

        Args:
            k: ``[B, H, m, D]`` keys about to be quantized (m a multiple of ``block_size``).

        Returns:
            ``[B, H, m // block_size, D]`` scales in the key spec's scale dtype.
        """
        b, h, t, d = k.shape
        grouped = k.float().abs().nan_to_num(posinf=0.0).view(b, h, t // self.block_size, self.block_size, d)
        block_amax = grouped.amax(dim=3)  # [B, H, nblk, D]
        calib = self.key_absmax[None, :, None, :]
        over = block_amax > calib
        n_over = int(over.sum())
        if n_over:
            if self.overflow_policy == "error":  # before any counter moves: a raise leaves the layer as it was
                ratio = float((block_amax / calib).max())
                raise ValueError(
                    f"{n_over} key (block, head, channel) ranges exceed the calibrated absmax (worst x{ratio:.3g}) "
                    "with overflow_policy='error'; use 'widen' (default) or recalibrate on longer samples."
                )
            self._stats["key_overflow_channels"] += n_over
            if self.overflow_policy == "clip":
                self._stats["key_clipped_values"] += int((grouped > calib[:, :, :, None, :]).sum())
            else:
                self._stats["key_widened_blocks"] += int(over.any(dim=-1).sum())
                calib = torch.maximum(block_amax, calib)
        spec = self.key_store.blocks.fit(k)
        return scale_from_absmax(calib.expand(b, h, t // self.block_size, d), spec)

    @restores_on_error
    def _map_batch(self, fn) -> None:
        for store in self.stores:
            store.map_batch(fn)
        self.clear_assignments()


def check_layer_config(config: LayerConfig, key_absmax: torch.Tensor | None) -> None:
    """A :class:`LayerConfig`, whose key spec can use a calibrated range if one is given (``ValueError`` otherwise)."""
    if not isinstance(config, LayerConfig):
        raise ValueError(f"AsymKVLayer takes a LayerConfig (AsymKVConfig(...).layer_config()), got "
                         f"{type(config).__name__}.")
    key_spec = config.key_spec
    if key_absmax is not None and (key_spec.granularity != "channel" or not key_spec.symmetric):
        raise ValueError("a calibrated key range (key_absmax) is a symmetric per-channel scale: it needs a key spec "
                         f"with granularity='channel' and symmetric=True, got {key_spec.granularity!r} and "
                         f"symmetric={key_spec.symmetric}.")
    if key_absmax is not None and key_spec.rotated:
        raise ValueError("a calibrated key range (key_absmax) holds ranges of unrotated key channels: it needs a key "
                         "spec with rotated=False (key_rotation=False), got rotated=True.")
