"""A sliding-window attention layer stored as :class:`~hf_asymkv.core.layer.AsymKVLayer` stores a full one.

``AsymKVConfig(quantize_sliding=True)`` gives every ``sliding_attention`` layer (Gemma-3's 5 of 6, Mistral's,
gpt-oss's half) a :class:`SlidingAsymKVLayer` instead of transformers' exact ``DynamicSlidingWindowLayer``. Tokens
take the same path (an exact window of the newest ``residual_length``, whole blocks quantized once as they age out);
what differs is the other end: a query at position ``q`` attends positions ``q - sliding_window + 1 .. q`` only, so
once every token of the oldest block lies before the next query's first visible position, the block is dropped
(its codes, scales, zeros and wide bits move to new tensors without it, :meth:`QuantizedBlocks.drop_front`). A layer
therefore holds at most ``sliding_window - 1 + block_size - 1 + residual_length + block_size`` tokens, whatever the
context, like transformers' layer with its ``sliding_window - 1``, at the quantized formats' bytes.

The attention sees the held tokens with the mask transformers builds from :meth:`get_mask_sizes`: their count and
the position of the first (``kv_offset``), so tokens held beyond the window are masked out as positions, exactly as
in a layer that had dropped them (``tests/core/test_sliding_layer.py`` checks the logits against such a layer).

No sinks: the window leaves the first tokens behind, which is what a sliding layer is for. While past recording is on
(assisted decoding) nothing is dropped until ``crop``, as transformers' layer keeps its states until then. A ``crop``
is refused only where it would need a dropped token back (the next query would attend it); transformers' layer
refuses every crop past the window without past recording. Static caches keep transformers' static sliding layers.
"""

from __future__ import annotations

import torch

from .compat import crop_tokens_to_remove
from .config import LayerConfig
from .layer import AsymKVLayer
from .rollback import restores_on_error

__all__ = ["SlidingAsymKVLayer"]


class SlidingAsymKVLayer(AsymKVLayer):
    """A quantized sliding-window layer (see the module docstring).

    Args:
        config: the layer's settings, ``sink_tokens=0``.
        sliding_window: the model's window (a query attends itself and the ``sliding_window - 1`` tokens before it).
        key_absmax: a calibrated K range, as for :class:`~hf_asymkv.core.layer.AsymKVLayer`.

    Raises:
        ValueError: ``sink_tokens`` other than 0, or a window that is not a positive integer.
    """

    is_sliding = True

    def __init__(self, config: LayerConfig, sliding_window: int, *, key_absmax: torch.Tensor | None = None):
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive integer, got {sliding_window!r}.")
        if isinstance(config, LayerConfig) and config.sink_tokens:
            raise ValueError(f"a sliding-window layer keeps no sinks (its window leaves them behind): sink_tokens must "
                             f"be 0, got {config.sink_tokens}.")
        self.sliding_window = sliding_window
        super().__init__(config, key_absmax=key_absmax)

    # The fused attention reads full-attention layers' codes; a sliding layer hands it dense K/V (a window's worth).
    return_views = property(lambda self: False, lambda self, value: None)

    @property
    def first_held(self) -> int:
        return self.dropped

    def _clear(self) -> None:
        super()._clear()
        self.dropped = 0  # tokens dropped from the front: the position of the oldest token held

    @restores_on_error
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """:meth:`AsymKVLayer.update`, then drop the blocks no later query attends (not while deferring)."""
        out = super().update(key_states, value_states, *args, **kwargs)
        if not self.defers:
            self._drop_left_behind()
        return out

    @restores_on_error
    def crop(self, tokens_to_remove: int) -> None:
        """:meth:`AsymKVLayer.crop`, then drop what the window has left behind (as transformers' layer restricts itself
        to its window in ``crop``).

        Raises:
            ValueError: as :meth:`AsymKVLayer.crop`, or a crop so deep that the next query would attend a token this
                layer has dropped.
        """
        tokens_to_remove = crop_tokens_to_remove(tokens_to_remove, self.cumulative_length)
        keep = self.cumulative_length + min(tokens_to_remove, 0)
        if self.dropped and keep - self.sliding_window + 1 < self.dropped:
            raise ValueError(f"cannot crop this sliding-window layer to {keep} tokens: a query at position {keep} "
                             f"attends from position {max(0, keep - self.sliding_window + 1)}, and the tokens before "
                             f"{self.dropped} have been dropped (activate_past_recording() before the tokens to roll "
                             "back, as for transformers' sliding layers).")
        super().crop(tokens_to_remove)
        if self.is_initialized:
            self._drop_left_behind()

    @restores_on_error
    def replace_tokens(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Refused: a press that prunes tokens does not say which positions the kept ones had, which the sliding
        mask needs."""
        raise ValueError("a quantized sliding-window layer cannot take pruned K/V (the kept tokens' positions are "
                         "not known to its mask): use quantize_sliding=False with kvpress presses.")

    def start_at(self, position: int) -> None:
        """Make this empty layer continue at ``position`` (a multiple of the block size), as one whose first
        ``position`` tokens its window has already dropped: the next update's first token is at ``position``. What
        :func:`~hf_asymkv.evals.evaluate.cache_from_prefix` builds a prefilled layer from (a sliding layer's prefix
        state holds only its last tokens).

        Raises:
            ValueError: a layer that holds tokens, or a position that is not a non-negative block multiple.
        """
        if self.cumulative_length:
            raise ValueError(f"start_at needs an empty layer, this one holds {self.cumulative_length} tokens.")
        if isinstance(position, bool) or not isinstance(position, int) or position < 0 or position % self.block_size:
            raise ValueError(f"start_at takes a non-negative multiple of the block size {self.block_size}, got "
                             f"{position!r}.")
        self.cumulative_length = self.dropped = position

    def get_max_length(self) -> int:
        return self.sliding_window

    def dense_tokens(self) -> int:
        """Tokens transformers' sliding layer would hold in full precision: its last ``sliding_window - 1``."""
        return min(self.cumulative_length, self.sliding_window - 1)

    def kept_from(self, length: int) -> int:
        """The position of the oldest token this layer keeps once it has seen ``length`` tokens: the start of the
        block that holds the next query's first visible position (``length - sliding_window + 1``)."""
        return max(0, length - self.sliding_window + 1) // self.block_size * self.block_size

    def _drop_left_behind(self) -> None:
        """Drop the whole blocks before :meth:`kept_from` the layer's length (only quantized blocks go)."""
        n = min(self.kept_from(self.cumulative_length) - self.dropped, self.key_store.blocks.length)
        if n > 0:
            for store in self.stores:
                store.blocks.drop_front(n)
            self.dropped += n
