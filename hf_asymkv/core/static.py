"""A preallocated, compile-friendly layer: :class:`StaticAsymKVLayer` (``AsymKVCache(config, max_cache_len=N)``).

It stores what :class:`~hf_asymkv.core.layer.AsymKVLayer` stores, in the same layout and the same bytes per token
(sinks exact, blocks of ``block_size`` tokens quantized once, the newest ``residual_length`` tokens exact), but in
buffers allocated for ``max_cache_len`` tokens at the first update (batch size included, as transformers'
``StaticLayer``) and written in place, so that ``torch.compile`` (and CUDA graphs) can run a decode step as one
graph, with no recompilation per step or per block:

- the filled length and the number of quantized blocks are 0-d tensors, never Python ints: nothing branches on
  them in Python, and a graph reads them as data;
- block slot ``j`` holds tokens ``[sinks + j * block_size, sinks + (j + 1) * block_size)`` (``max_cache_len - sinks
  - residual_length`` tokens of slots, rounded down to blocks: a block is quantized once ``residual_length`` newer
  tokens follow it, so later tokens never reach a slot);
- the exact window is a buffer of ``residual_length + block_size`` tokens starting at the first token not yet
  quantized (the *boundary*). It is aligned there, not a ring: a block to quantize is then always its first
  ``block_size`` tokens, a fixed slice, and after a flush it moves down by one block (one copy of the window, a few
  percent of the read-out). Why that size: the dynamic layer quantizes the oldest block as soon as the window
  reaches ``residual_length + block_size`` tokens, so between updates it holds at most one token less;
- every update quantizes the candidate blocks its tokens could complete (one per decode step: the block at the
  boundary) and writes each into its slot where the window has really aged it out, selected with ``torch.where``:
  shape-stable, and the same blocks, at the same steps, with the same codes as the dynamic layer (the quantization
  functions are the dynamic layer's; :mod:`~hf_asymkv.core.rounding` keeps them exact when compiled);
- the read-out is dense K/V of ``max_cache_len`` tokens, as transformers' ``StaticCache`` returns: sinks, every
  slot decoded, the exact window (and the tokens of this update) written over their positions, left-padded rows'
  exact sinks over theirs; positions at or beyond the filled length hold finite filler that the attention mask
  (``get_mask_sizes``: ``max_cache_len``) hides.

What it does not do, unlike the dynamic layer: defer quantization (``activate_past_recording``,
``keep_latest_exact``: a crop of at most ``residual_length`` tokens is exact anyway, a deeper one raises), widen a
store's metadata to float32 (a value beyond float16's range saturates its group), raise on a calibrated key range's
overflow (``overflow_policy="error"`` is refused: a graph cannot stop on data), change the batch size, or grow.

With ``attn_implementation="asymkv_sdpa"`` the layer hands attention a
:class:`~hf_asymkv.core.static_attention.StaticQuantizedKV` (its stored parts, at fixed shapes) instead of the dense
read-out, and :func:`~hf_asymkv.core.static_attention.static_fused_attention` reads the codes: no dense K/V of
``max_cache_len`` tokens per step.
"""

from __future__ import annotations

from collections import Counter

import torch
from transformers.cache_utils import CacheLayerMixin

from .compat import LayerAPICompat, crop_tokens_to_remove, update_position_ids
from .config import LayerConfig
from .layer import check_layer_config
from .quant import scale_from_absmax
from .rollback import check_usable
from .sinks import row_anchors
from .static_attention import StaticQuantizedKV
from .static_store import StaticTensorStore

__all__ = ["STATIC_COUNTERS", "StaticAsymKVLayer"]

STATIC_COUNTERS = ("flushes", "key_overflow_channels", "key_widened_blocks", "key_clipped_values", "nonfinite_values")
"""The counters a static layer keeps on the device (``stats``), in the order of its ``counts`` tensor."""


class StaticAsymKVLayer(LayerAPICompat, CacheLayerMixin):
    """Cache layer with preallocated quantized K/V blocks between exact sinks and an exact window (see the module
    docstring).

    Args:
        config: the layer's settings (:meth:`hf_asymkv.AsymKVConfig.layer_configs`), as for
            :class:`~hf_asymkv.core.layer.AsymKVLayer`.
        max_cache_len: tokens the layer can hold (prompt and generated tokens).
        key_absmax: optional calibrated K range ``[kv_heads, head_dim]``; ``config.overflow_policy`` must be
            ``"widen"`` or ``"clip"``.

    Raises:
        ValueError: a ``max_cache_len`` that is not a positive int, ``overflow_policy="error"`` with a calibrated
            range, or what :class:`~hf_asymkv.core.layer.AsymKVLayer` refuses.
    """

    is_sliding = False
    is_compileable = True
    is_croppable = True

    def __init__(self, config: LayerConfig, max_cache_len: int, *, key_absmax: torch.Tensor | None = None):
        super().__init__()
        check_layer_config(config, key_absmax)
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be an int >= 1, got {max_cache_len!r}.")
        if key_absmax is not None and config.overflow_policy == "error":
            raise ValueError("a static cache cannot raise on a key beyond its calibrated range (a compiled step cannot "
                             "stop on data): use overflow_policy 'widen' or 'clip', got 'error'.")
        self.config, self.max_cache_len, self.key_absmax = config, max_cache_len, key_absmax
        self.sink_count = min(config.sink_tokens, max_cache_len)
        rest = max_cache_len - self.sink_count
        self.n_blocks = max(0, (rest - config.residual_length) // config.block_size)
        self.window_tokens = min(config.residual_length + config.block_size, rest)
        self.stores = (StaticTensorStore("key", config.key_spec, self.sink_count),
                       StaticTensorStore("value", config.value_spec, self.sink_count))
        self.return_views = False  # set by AsymKVCache: hand the fused attention StaticQuantizedKV, not dense K/V
        self.record_past = False  # transformers' name; nothing is deferred here (see the module docstring)
        self.batch_size = 0
        self.interrupted: str | None = None  # the call an exception cut short mid-write (hf_asymkv.core.rollback)

    key_spec = property(lambda self: self.config.key_spec)
    value_spec = property(lambda self: self.config.value_spec)
    block_size = property(lambda self: self.config.block_size)
    residual_length = property(lambda self: self.config.residual_length)
    sink_tokens = property(lambda self: self.config.sink_tokens)

    # ------------------------------------------------------------------ transformers layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate every buffer for ``max_cache_len`` tokens and the batch of ``key_states`` (``[B, H, n, D]``)."""
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size, heads = key_states.shape[:2]
        for store, states in zip(self.stores, (key_states, value_states)):
            store.allocate(states, self.n_blocks, self.window_tokens)
        if self.key_absmax is not None:
            expected = (heads, key_states.shape[-1])
            if tuple(self.key_absmax.shape) != expected:
                raise ValueError(f"Calibrated key range has shape {tuple(self.key_absmax.shape)}, model layer needs "
                                 f"{expected}.")
            self.key_absmax = self.key_absmax.to(self.device, torch.float32)
        self.length = torch.zeros((), dtype=torch.long, device=self.device)
        self.blocks_stored = torch.zeros((), dtype=torch.long, device=self.device)
        self.counts = torch.zeros(len(STATIC_COUNTERS), dtype=torch.long, device=self.device)
        if not torch.compiler.is_compiling():  # fixed addresses: what CUDA graphs need (transformers' StaticLayer too)
            for t in self.tensors():
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, n, D]`` keys/values at the filled length and return dense ``[B, H, max_cache_len, D]``
        keys/values (positions from the filled length on are masked by the attention mask).

        Raises:
            ValueError: a batch of another size than the first update's.
        """
        check_usable(self)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch_size:
            raise ValueError(f"this static cache holds a batch of {self.batch_size} rows, got {key_states.shape[0]}; "
                             "build a cache for that batch (reset() keeps the allocation for the same batch).")
        n = key_states.shape[-2]
        start = self.length
        boundary = self.sink_count + self.blocks_stored * self.block_size
        self._anchor(update_position_ids(args, kwargs), n)
        joined = []
        for store, new in zip(self.stores, (key_states, value_states)):
            store.write_sinks(new, start)
            joined.append(store.joined(new, start - boundary))
        if self.return_views:  # the fused attention reads the stored parts (the block flushed below lies at or past
            # the boundary, where the view takes the exact tokens)
            out = tuple(StaticQuantizedKV(store, tokens, boundary, start.clone(), self.max_cache_len)
                        for store, tokens in zip(self.stores, joined))
        else:  # read before the flush: what it stores lies at or after the boundary, where the read takes the exact
            # tokens anyway (a compiled graph would otherwise decode every slot through the scatter that writes one)
            out = tuple(store.read(tokens, boundary, self.max_cache_len) for store, tokens in zip(self.stores, joined))
        filled = (start + n - boundary).clamp(min=0)  # window tokens, this update's included, before a flush
        flushed = (filled - self.residual_length).div(self.block_size, rounding_mode="floor").clamp(min=0)
        candidates = min(self.n_blocks, (self.window_tokens + n - self.residual_length) // self.block_size)
        # a step that stores no block (one decode step in block_size stores one) changes nothing by flushing: eagerly
        # on a CPU it is skipped; a graph, and other devices (a host sync per step), flush at every step.
        # (torch.cond here made generate's compiled step recompile once with the `kernels` package installed.)
        # Until here only filler was written (sink slots from the filled length on; anchors of an empty layer): an
        # exception left the layer as it was. From here on live buffers change in place, so one marks it
        # (hf_asymkv.core.rollback); a graph does not branch on the mark.
        eager = not torch.compiler.is_compiling()
        if eager:
            self.interrupted = "update"
        if candidates > 0 and (torch.compiler.is_compiling() or self.device.type != "cpu" or bool(flushed)):
            self._flush(joined, candidates, flushed, boundary)
        for store, tokens in zip(self.stores, joined):
            store.keep_window(tokens, flushed * self.block_size)
        self.length.add_(n)
        self.blocks_stored.add_(flushed)
        if eager:
            self.interrupted = None
        return out

    def check_room(self, n: int) -> None:
        """Raise ``ValueError`` when ``n`` more tokens do not fit (reads the filled length on the host: eager only)."""
        check_usable(self)
        held = int(self.get_seq_length())
        if held + n > self.max_cache_len:
            raise ValueError(f"this static cache holds at most max_cache_len={self.max_cache_len} tokens: {held} are "
                             f"held, {n} more do not fit (build it with a larger max_cache_len).")

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self) -> torch.Tensor | int:
        """The filled length as a 0-d tensor (0 before the first update), as transformers' ``StaticLayer``."""
        check_usable(self)
        return self.length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        """Empty the layer, keeping the allocation (every buffer zeroed in place); a layer marked interrupted is usable
        again once it returns."""
        self.interrupted = "reset"
        if self.is_initialized:
            for t in self.tensors():
                t.zero_()
        self.record_past = False
        self.interrupted = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch rows (beam search), in place."""
        check_usable(self)
        if self.is_initialized:
            self.interrupted = "reorder_cache"
            for t in self.tensors(batched=True):
                t.copy_(t.index_select(0, beam_idx.to(t.device)))
            self.interrupted = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError(f"a static cache keeps its batch of {self.batch_size} rows; build it for the expanded batch "
                         f"(got a request to repeat rows {repeats} times).")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ValueError(f"a static cache keeps its batch of {self.batch_size} rows; it cannot select rows.")

    def activate_past_recording(self, **kwargs) -> None:
        """Recorded for transformers' ``is_recording_past``; nothing is deferred: a crop of up to ``residual_length``
        tokens is exact without it, a deeper one raises."""
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Remove ``-tokens_to_remove`` tokens from the end (0 keeps all). The kept ones stay where they are.

        Raises:
            ValueError: a positive argument, or a crop into quantized blocks (their exact tokens are gone).
        """
        held = int(self.get_seq_length())  # (raises for a layer marked interrupted)
        tokens_to_remove = crop_tokens_to_remove(tokens_to_remove, held)
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove (or 0), got {tokens_to_remove}; "
                             "the positive 'length to keep' form is not supported.")
        if not self.is_initialized:
            return
        keep = max(0, held + tokens_to_remove)
        quantized = int(self.blocks_stored) * self.block_size
        if quantized and keep < self.sink_count + quantized:
            raise ValueError(f"cannot crop a static cache to {keep} tokens: tokens {self.sink_count} to "
                             f"{self.sink_count + quantized - 1} are quantized (a static cache crops within its exact "
                             f"window only: at most {held - self.sink_count - quantized} tokens now).")
        self.length.fill_(keep)

    # ------------------------------------------------------------------ reporting
    def tensors(self, batched: bool = False) -> list[torch.Tensor]:
        """Every preallocated tensor (with ``batched``, those with a batch axis: what a beam reorder moves)."""
        out = [t for store in self.stores for t in store.tensors()]
        return out if batched else out + [self.length, self.blocks_stored, self.counts]

    def memory_footprint(self) -> dict[str, int]:
        """Allocated bytes by part, and ``unused_capacity``: the allocated bytes no token fills yet; ``bookkeeping``:
        the filled length, block count and counters (0-d and small tensors a graph reads), the rows' sink anchors and
        the stores' rotation matrices."""
        check_usable(self)
        if not self.is_initialized:
            return {}
        held = int(self.length)
        out: Counter = Counter()
        for store in self.stores:
            out.update(store.memory_footprint(held, int(self.blocks_stored)))
        small = [self.length, self.blocks_stored, self.counts]
        small += [t for store in self.stores for t in (store.overlay.anchors, store.rotation) if t is not None]
        out["bookkeeping"] += sum(t.numel() * t.element_size() for t in small)
        return dict(out)

    def dense_tokens(self) -> int:
        """Tokens transformers' own layer would hold in full precision: the filled length."""
        return int(self.get_seq_length())

    def dense_elements(self) -> int:
        """Elements K and V would hold in full precision for the filled length."""
        check_usable(self)
        if not self.is_initialized:
            return 0
        key, value = self.stores
        return self.batch_size * key.heads * self.dense_tokens() * (key.head_dim + value.head_dim)

    @property
    def stats(self) -> Counter:
        """The dynamic layer's counters (``tokens_quantized``, ``blocks_quantized``, ``flushes``, ...), read from the
        device."""
        check_usable(self)
        if not self.is_initialized:
            return Counter()
        blocks = int(self.blocks_stored)
        counts = dict(zip(STATIC_COUNTERS, self.counts.tolist()))
        return Counter({"tokens_quantized": blocks * self.block_size, "blocks_quantized": blocks, **counts})

    # ------------------------------------------------------------------ internals
    def _anchor(self, position_ids: torch.Tensor | None, n: int) -> None:
        """Anchor each row's sinks at its first real token when this update starts an empty layer (no host sync)."""
        if not self.sink_count:
            return
        starts = row_anchors(position_ids, self.batch_size, n)
        if starts is None:
            return
        for store in self.stores:
            anchors = store.overlay.anchors
            anchors.copy_(torch.where(self.length == 0, starts, anchors))

    def _flush(self, joined: list[torch.Tensor], candidates: int, flushed: torch.Tensor, boundary: torch.Tensor
               ) -> None:
        """Quantize the first ``candidates`` blocks of the window + new tokens; store the first ``flushed`` of them
        (slots ``blocks_stored ...``); the others' slots keep what they hold."""
        index = torch.arange(candidates, device=self.device)
        valid = index < flushed
        targets = (self.blocks_stored + index) % self.n_blocks  # distinct slots, the valid ones first
        key_scale = None
        if self.key_absmax is not None:
            key_scale = self._key_scale(joined[0][:, :, : candidates * self.block_size], valid)
        nonfinite = sum(store.store_blocks(tokens, candidates, targets, valid, boundary, flushed * self.block_size,
                                           scale)
                        for store, tokens, scale in zip(self.stores, joined, (key_scale, None)))
        self.counts[0].add_((flushed > 0).long())
        self.counts[4].add_(nonfinite)

    def _key_scale(self, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Per-block K scale from the calibrated range, widened or clipped as the policy says, counted for the blocks
        that are really stored (``valid`` ``[F]``): ``[B, H, F, D]``."""
        b, h, t, d = keys.shape
        grouped = keys.float().abs().nan_to_num(posinf=0.0).view(b, h, t // self.block_size, self.block_size, d)
        block_amax = grouped.amax(dim=3)  # [B, H, F, D]
        calib = self.key_absmax[None, :, None, :]
        over = (block_amax > calib) & valid[None, None, :, None]
        self.counts[1].add_(over.sum())
        if self.config.overflow_policy == "clip":
            clipped = (grouped > calib[:, :, :, None, :]) & valid[None, None, :, None, None]
            self.counts[3].add_(clipped.sum())
        else:
            self.counts[2].add_(over.any(dim=-1).sum())
            calib = torch.maximum(block_amax, calib)
        return scale_from_absmax(calib.expand(b, h, t // self.block_size, d), self.key_spec)
