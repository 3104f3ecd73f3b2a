"""``layer.keys`` / ``layer.values`` of :class:`~hf_asymkv.core.layer.AsymKVLayer`: dense K/V to read and to assign.

transformers' ``DynamicLayer`` keeps its K/V as two tensor attributes, and code built on it reads and writes them.
NVIDIA kvpress (0.5.x) does both: a press, a forward hook on each attention module, reads the layer's K/V right
after that layer's attention in the prefill, picks the tokens to keep and assigns the pruned tensors
(``layer.keys = keys; layer.values = values``); its pipeline's multi-question loop slices every layer back to the
context length after each answer (``layer.keys = layer.keys[:, :, :L]``). Our layer stores codes, so the two
attributes are properties of :class:`DenseKVAttributes`:

- **reading** gives the layer's tokens as one dense ``[B, H, seq, D]`` tensor in a fresh buffer (the sinks, the
  window and pending tokens exact, the blocks decoded). The layer keeps no reference to it (only a weak one, to
  recognise a slice of it when it comes back).
- **assigning** stages the tensor; once keys and values are both assigned (in either order) they are applied
  together, checked against each other and against the layer:

  - a token-prefix slice of the tensor the latest read returned (``layer.keys[:, :, :L]``, nothing changed in the
    layer since) is a rollback to ``L`` tokens: :meth:`AsymKVLayer.crop`, which keeps the quantized blocks as
    they are (no token is quantized again unless the cut falls inside a block, as for any crop);
  - any other pair replaces the layer's tokens (:meth:`AsymKVLayer.replace_tokens`): accepted while nothing is
    quantized, refused once blocks are stored (their tokens would be quantized a second time).

Why a press sees exact K/V: :class:`~hf_asymkv.core.cache.AsymKVCache` keeps each multi-token update of a layer
pending (exact, in the window) until the cache's next update of any layer, and a press hook runs between the two.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["DECODING_PRESSES_NOTE", "DenseKVAttributes"]

DECODING_PRESSES_NOTE = (
    "AsymKVCache takes presses that compress the prefill, in the hook that follows each layer's attention (kvpress's "
    "ScorerPress family: KnormPress, SnapKVPress, ExpectedAttentionPress, StreamingLLMPress, ...); presses that "
    "compress during decoding (DecodingPress, PrefillDecodingPress, DMSPress with decoding) or rewrite layers after "
    "the whole prefill (KVzipPress, FastKVzipPress, KVComposePress, KVgradPress) are not supported on it")
"""Which kvpress presses compose with our layers, quoted by the errors that refuse the others."""

KINDS = ("key", "value")


class DenseKVAttributes:
    """Mixin for :class:`~hf_asymkv.core.layer.AsymKVLayer` (listed before ``CacheLayerMixin``): the ``keys`` and
    ``values`` attributes of transformers' layer API, as described in the module docstring.

    The layer provides ``stores`` (key and value :class:`~hf_asymkv.core.store.TensorStore`), ``is_initialized``,
    ``cumulative_length``, ``crop`` and ``replace_tokens``.
    """

    @property
    def keys(self) -> torch.Tensor | None:
        """``[B, H, seq, D]`` dense keys in a fresh tensor (None before the first update)."""
        return self._read("key")

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._stage("key", tensor)

    @property
    def values(self) -> torch.Tensor | None:
        """``[B, H, seq, D]`` dense values in a fresh tensor (None before the first update)."""
        return self._read("value")

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._stage("value", tensor)

    def clear_assignments(self) -> None:
        """Forget staged tensors and earlier reads (the layer's contents are about to change)."""
        self.__dict__["_staged"] = {}
        self.__dict__["_reads"] = {}
        self.__dict__["_version"] = self.__dict__.get("_version", 0) + 1

    def check_no_half_assignment(self) -> None:
        """Raise ``ValueError`` when one of keys/values was assigned and the other not (then the layer is used)."""
        staged = self.__dict__.get("_staged")
        if staged:
            (kind,) = staged
            other = "values" if kind == "key" else "keys"
            raise ValueError(f"layer.{kind}s was assigned but layer.{other} was not: assign both (in either order) "
                             "before the layer is updated again.")

    def _read(self, kind: str) -> torch.Tensor | None:
        staged = self.__dict__.get("_staged", {})
        if kind in staged:
            return staged[kind]
        if not self.is_initialized:
            return None
        store = self.stores[KINDS.index(kind)]
        out = store.dense()
        if out is None:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        self._reads[kind] = (weakref.ref(out), self._version)
        return out

    def _stage(self, kind: str, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            if not getattr(self, "is_initialized", False):  # CacheLayerMixin.__init__ sets keys = values = None
                return
            raise ValueError(f"layer.{kind}s takes a [batch, kv_heads, seq, head_dim] tensor, got None (use reset() "
                             "to empty a layer).")
        self._check_tensor(kind, tensor)
        self._staged[kind] = tensor
        if len(self._staged) == len(KINDS):
            keys, values = self._staged["key"], self._staged["value"]
            self._staged = {}
            self._apply(keys, values)

    def _check_tensor(self, kind: str, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4 or not tensor.is_floating_point():
            what = (f"a {tensor.dim()}-d {tensor.dtype} tensor" if isinstance(tensor, torch.Tensor)
                    else type(tensor).__name__)
            raise ValueError(f"layer.{kind}s takes a floating-point [batch, kv_heads, seq, head_dim] tensor, got {what}.")
        if not self.is_initialized:
            return
        held = self._held_shape(kind)
        if held is not None and (tensor.shape[:2] != held[:2] or tensor.shape[3] != held[3]):
            raise ValueError(f"layer.{kind}s of shape {tuple(tensor.shape)} does not fit a layer holding "
                             f"[batch, kv_heads, seq, head_dim] = {list(held)}: only the seq axis may change.")
        if tensor.dtype != self.dtype or tensor.device != self.device:
            raise ValueError(f"layer.{kind}s is {tensor.dtype} on {tensor.device}; the layer holds {self.dtype} on "
                             f"{self.device}.")

    def _held_shape(self, kind: str) -> tuple[int, int, int, int] | None:
        """``(B, H, seq, D)`` of what the layer holds, from any non-empty buffer (None while there is none)."""
        store = self.stores[KINDS.index(kind)]
        for buf in (store.window, store.sinks):
            if buf.data is not None:
                b, h = buf.data.shape[:2]
                return b, h, self.cumulative_length, store.head_dim
        return None

    def _is_prefix_of_read(self, kind: str, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the latest read of ``kind`` or a slice of its first tokens, nothing changed since."""
        ref, version = self._reads.get(kind, (None, None))
        base = ref() if ref is not None else None
        if base is None or version != self._version:
            return False
        if tensor is base:
            return True
        return (tensor._base is base and tensor.data_ptr() == base.data_ptr() and tensor.stride() == base.stride()
                and tensor.shape[:2] == base.shape[:2] and tensor.shape[3] == base.shape[3])

    def _apply(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if keys.shape[2] != values.shape[2]:
            raise ValueError(f"layer.keys holds {keys.shape[2]} tokens and layer.values {values.shape[2]}: a layer's "
                             "keys and values must hold the same tokens.")
        n = keys.shape[2]
        if self.is_initialized and all(self._is_prefix_of_read(kind, t) for kind, t in zip(KINDS, (keys, values))):
            if n < self.cumulative_length:
                self.crop(n - self.cumulative_length)
            return
        self.replace_tokens(keys, values)
