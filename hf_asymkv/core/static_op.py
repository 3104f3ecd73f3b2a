"""The static layer's attention as a ``torch.library`` operator, ``hf_asymkv::static_attention``.

:func:`~hf_asymkv.core.static_attention.static_fused_attention` is plain torch: traced into a compiled step, inductor
fuses it (on a CPU that is the fastest form it has). A kernel, though, must stay one call inside the graph, which
``generate``'s CUDA graphs then replay: hence this operator. It takes the static stores' buffers and their 0-d
filled length and boundary as tensors (a graph reads them as data, nothing is read on the host) and the layouts as
strings (:meth:`~hf_asymkv.core.quant.QuantSpec.to_text`: what a compiled graph can carry, stable across
processes for inductor's cache). Its fake says the output's shape, so ``fullgraph=True`` traces through it.

Implementations: every device runs the torch fused attention (:func:`static_attention_reference`); CUDA tensors run
the Triton decode kernel where it serves the call (:func:`static_attention_triton`, see :mod:`.static_kernel`;
``HF_ASYMKV_ATTENTION_BACKEND`` as for the dynamic cache), the torch implementation otherwise. Which form a step takes:
``HF_ASYMKV_STATIC_ATTENTION`` = ``auto`` (the default: the operator for CUDA tensors, the traced torch code on a
CPU), ``op`` (always the operator: how the CPU tests check the graph through it) or ``inline`` (never).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..kernels import env_choice
from .quant import QuantSpec
from .sinks import SinkOverlay
from .static_attention import StaticQuantizedKV, static_fused_attention
from .static_kernel import kernel_static_attention

__all__ = ["ENV_VAR", "FORMS", "StoredParts", "static_attention", "static_attention_args", "static_attention_reference",
           "static_attention_triton", "store_layout", "use_operator"]

ENV_VAR = "HF_ASYMKV_STATIC_ATTENTION"
FORMS = ("auto", "op", "inline")
_PARTS = ("sinks", "codes", "scales", "zeros", "wide_bits", "wide_channels", "rotation", "anchors", "overlay")


def use_operator(device: torch.device) -> bool:
    """Whether a static step on ``device`` calls the operator (``HF_ASYMKV_STATIC_ATTENTION``, read when traced).

    Raises:
        ValueError: a value outside :data:`FORMS`.
    """
    form = env_choice(ENV_VAR, FORMS, "a static attention form")
    return form == "op" or form == "auto" and device.type == "cuda"


@dataclasses.dataclass
class StoredParts:
    """What :func:`~hf_asymkv.core.static_attention.static_fused_attention` reads of a static store, rebuilt from the
    operator's arguments (the attributes of :class:`~hf_asymkv.core.static_store.StaticTensorStore` it uses)."""

    spec: QuantSpec
    sink_count: int
    head_dim: int
    sinks: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    wide_bits: torch.Tensor | None = None
    wide_channels: torch.Tensor | None = None
    rotation: torch.Tensor | None = None
    overlay: SinkOverlay | None = None


def store_layout(store) -> str:
    """A static store's layout as text: its spec, sinks, head_dim and which parts it has (the buffers the operator
    gets, in :data:`_PARTS` order). Made when the store allocates (inside a graph when the first update is
    compiled: f-strings only)."""
    present = ",".join(name for name, buffer in zip(_PARTS, _buffers(store)) if buffer is not None)
    return f"{store.spec.to_text()}|{store.sink_count}|{store.head_dim}|{present}"


def _buffers(store) -> list[torch.Tensor | None]:
    """A store's buffers in :data:`_PARTS` order (None for the parts it does not have)."""
    return [store.sinks, store.codes, store.scales, store.zeros, store.wide_bits, store.wide_channels, store.rotation,
            store.overlay.anchors, store.overlay.tokens]


@functools.lru_cache(maxsize=64)  # process-wide, immutable values (a race parses a layout twice)
def _parse(layout: str) -> tuple[QuantSpec, int, int, tuple[str, ...]]:
    spec, sink_count, head_dim, parts = layout.split("|")
    return QuantSpec.from_text(spec), int(sink_count), int(head_dim), tuple(parts.split(",")) if parts else ()


def _parts(layout: str, buffers: list[torch.Tensor]) -> StoredParts:
    spec, sink_count, head_dim, names = _parse(layout)
    given = dict(zip(names, buffers))
    overlay = SinkOverlay(sink_count)
    overlay.anchors, overlay.tokens = given.pop("anchors", None), given.pop("overlay", None)
    return StoredParts(spec, sink_count, head_dim, overlay=overlay, **given)


@torch.library.custom_op("hf_asymkv::static_attention", mutates_args=())
def static_attention(query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float, boundary: torch.Tensor,
                     start: torch.Tensor, max_len: int, key_tokens: torch.Tensor, value_tokens: torch.Tensor,
                     key_buffers: list[torch.Tensor], value_buffers: list[torch.Tensor], key_layout: str,
                     value_layout: str) -> torch.Tensor:
    """Softmax attention of ``query`` ``[B, Hq, q, D]`` over one static layer's stored K/V: ``[B, q, Hq, D_v]``.

    Args:
        attention_mask: as :func:`~hf_asymkv.core.static_attention.static_fused_attention` takes it (or None).
        boundary, start: 0-d long, the first position no stored block holds, and the filled length before this step.
        max_len: the layer's ``max_cache_len``.
        key_tokens, value_tokens: ``[B, H, W + q, D]``, the exact window followed by this step's tokens.
        key_buffers, value_buffers, key_layout, value_layout: each store's buffers and their layout
            (:func:`static_attention_args` builds them).
    """
    return static_attention_reference(query, attention_mask, scaling, boundary, start, max_len, key_tokens,
                                      value_tokens, key_buffers, value_buffers, key_layout, value_layout)


def static_attention_reference(query, attention_mask, scaling, boundary, start, max_len, key_tokens, value_tokens,
                               key_buffers, value_buffers, key_layout, value_layout) -> torch.Tensor:
    """The operator's torch implementation: :func:`~hf_asymkv.core.static_attention.static_fused_attention` over the
    parts rebuilt from the arguments."""
    key = StaticQuantizedKV(_parts(key_layout, key_buffers), key_tokens, boundary, start, max_len)
    value = StaticQuantizedKV(_parts(value_layout, value_buffers), value_tokens, boundary, start, max_len)
    return static_fused_attention(query, key, value, attention_mask, scaling)


@static_attention.register_kernel("cuda")
def static_attention_triton(query, attention_mask, scaling, boundary, start, max_len, key_tokens, value_tokens,
                            key_buffers, value_buffers, key_layout, value_layout) -> torch.Tensor:
    """The operator's CUDA implementation: the Triton decode kernel (:func:`~.static_kernel.kernel_static_attention`)
    where it serves the call, else the torch implementation. Called directly, it runs on CPU tensors under Triton's
    interpreter (``TRITON_INTERPRET=1``, ``HF_ASYMKV_ATTENTION_BACKEND=triton``): how the tests check it."""
    out = kernel_static_attention(query, attention_mask, scaling, boundary, start, max_len, key_tokens, value_tokens,
                                  _parts(key_layout, key_buffers), _parts(value_layout, value_buffers))
    if out is not None:
        return out
    return static_attention_reference(query, attention_mask, scaling, boundary, start, max_len, key_tokens,
                                      value_tokens, key_buffers, value_buffers, key_layout, value_layout)


@static_attention.register_fake
def _static_attention_fake(query, attention_mask, scaling, boundary, start, max_len, key_tokens, value_tokens,
                           key_buffers, value_buffers, key_layout, value_layout) -> torch.Tensor:
    b, hq, q_len, _ = query.shape
    return query.new_empty(b, q_len, hq, value_tokens.shape[-1])


def static_attention_args(query: torch.Tensor, key: StaticQuantizedKV, value: StaticQuantizedKV,
                          attention_mask: torch.Tensor | None, scaling: float) -> tuple:
    """The operator's arguments for one static layer's step."""
    key_buffers, value_buffers = ([b for b in _buffers(kv.store) if b is not None] for kv in (key, value))
    return (query, attention_mask, float(scaling), key.boundary, key.start, key.max_len, key.tokens, value.tokens,
            key_buffers, value_buffers, key.store.layout, value.store.layout)
