"""Peer KV-cache formats, emulated honestly: the same numbers the peer's engine would attend over, and its bytes.

Each :class:`PeerFormat` quantize-dequantizes K/V exactly the way one peer stores them (group sizes, scale dtype,
symmetric or not, rotation, exact window: see each ``source``), inside a transformers ``Cache``
(:class:`PeerCache`), so every evaluation runs them through the same model, prompts and code path as ours.
Accuracy comes from the emulation; bytes come from :meth:`PeerFormat.engine_nbytes`, which counts what the
peer's engine allocates for the tokens it holds (codes + scales + zeros + exact tokens + full-precision
layers), with an exact-precision element costing 2 bytes (a bf16/fp16 model). Engine paging or context padding
(vLLM's 16-token pages, llama.cpp's preallocated context) is *not* counted: that favours the peers slightly.

A rotation (llama.cpp's Hadamard, vLLM's randomized Hadamard) is orthonormal, so attending over rotated keys
with a rotated query, and rotating the output back, equals attending over ``dequant(quant(kH)) Hᵀ``: the
emulation stores the rotated-back tensors and the model's own attention reads them unchanged.

Only models whose layers are all full attention are supported (like transformers' ``QuantizedCache``); others
raise ``ValueError`` and the evaluations list the scheme as skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, DynamicLayer

from ..core.shapes import layer_shapes
from . import peer_formats as pf
from .peer_names import PEER_SCHEMES

__all__ = ["PEERS", "KiviLayer", "PeerCache", "PeerFormat", "PeerLayer", "make_peer_cache"]

EXACT_BYTES = 2  # bytes per exact element in the engine (bf16/fp16 model)


@dataclass(frozen=True)
class PeerFormat:
    """One peer's KV format.

    Args:
        name: scheme name, one of :data:`hf_asymkv.bench.peer_names.PEER_SCHEMES` (the torch-free list of names).
        description: one line for tables.
        source: where the format is defined (repository file or paper section).
        quantize: ``(layer, keys, values) -> (keys, values)``, ``[B, kv_heads, T, head_dim]`` each,
            quantize-dequantized in the input dtype (``None`` for :class:`KiviLayer` formats).
        token_bytes: ``(kv_heads, head_dim) -> bytes`` one token costs in one quantized layer, K and V together.
        layer_bytes: fixed bytes per quantized layer (per-tensor scales).
        boundary_layers: first and last layers kept exact (vLLM TurboQuant's boundary protection).
        kivi_bits: KIVI's code width (KIVI formats only; group 32 tokens/channels, window 128).
    """

    name: str
    description: str
    source: str
    quantize: Callable | None
    token_bytes: Callable[[int, int], int]
    layer_bytes: int = 0
    boundary_layers: int = 0
    kivi_bits: int = 0

    def __post_init__(self) -> None:
        if self.name not in PEER_SCHEMES:
            raise ValueError(f"peer format {self.name!r} has no scheme name; add it to PEER_SCHEMES "
                             f"({list(PEER_SCHEMES)}).")

    def is_exact_layer(self, layer_idx: int, num_layers: int) -> bool:
        n = min(self.boundary_layers, num_layers // 2)
        return layer_idx < n or layer_idx >= num_layers - n

    def layer_nbytes(self, num_tokens: int, kv_heads: int, head_dim: int, exact: bool = False) -> int:
        """Bytes one layer holds for ``num_tokens`` tokens (batch 1), as the engine stores them."""
        if exact:
            return 2 * num_tokens * kv_heads * head_dim * EXACT_BYTES
        if self.kivi_bits:
            return kivi_nbytes(num_tokens, kv_heads, head_dim, self.kivi_bits)
        return num_tokens * self.token_bytes(kv_heads, head_dim) + self.layer_bytes

    def engine_nbytes(self, num_tokens: int, layers: int, kv_heads: int, head_dim: int, batch: int = 1) -> int:
        """Bytes the peer's engine stores for ``num_tokens`` tokens of ``batch`` sequences over ``layers`` layers.

        For KIVI, the state a prefill of ``num_tokens`` leaves once KIVI has moved its windows.
        """
        return batch * sum(self.layer_nbytes(num_tokens, kv_heads, head_dim, self.is_exact_layer(i, layers))
                           for i in range(layers))


# ---------------------------------------------------------------------------------------------- quantizers
def _per_row(codes_fn, dequant_fn, rows_of_heads: bool):
    """Apply a row quantizer to ``[B, H, T, D]``: rows are ``D`` (per head) or ``H * D`` (llama.cpp rows)."""

    def fake(x: torch.Tensor) -> torch.Tensor:
        b, h, t, d = x.shape
        rows = x.transpose(1, 2).reshape(b, t, h * d) if rows_of_heads else x
        out = dequant_fn(*codes_fn(rows), rows.shape)
        out = out.reshape(b, t, h, d).transpose(1, 2) if rows_of_heads else out
        return out.to(x.dtype)

    return fake


def _rotated(fake, signs: bool = False):
    """``fake`` applied in a rotated basis along head_dim: ``fake(x R) Rᵀ`` with R = H or H·diag(s)."""

    def rotated(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        rot = pf.hadamard(d)
        if signs:
            rot = pf.random_signs(d)[:, None] * rot  # diag(s) @ H: x -> (x * s) @ H
        rot = rot.to(torch.float32)
        y = fake((x.float() @ rot).to(x.dtype))
        return (y.float() @ rot.T).to(x.dtype)

    return rotated


def _both(fake_k, fake_v=None):
    fake_v = fake_v or fake_k
    return lambda layer, k, v: (fake_k(k), fake_v(v))


_q8_0 = _per_row(pf.q8_0_codes, pf.dequantize_q8_0, rows_of_heads=True)
_q4_0 = _per_row(pf.q4_0_codes, pf.dequantize_q4_0, rows_of_heads=True)
_int8_pth = _per_row(pf.int8_per_token_head_codes, lambda c, s, shape: c.float() * s[..., None], False)
_int4_pth = _rotated(_per_row(pf.int4_per_token_head_codes, lambda c, s, shape: pf.dequantize_int4_per_token_head(c, s),
                              False), signs=True)


def _tq_values(v: torch.Tensor) -> torch.Tensor:
    """TurboQuant values: 4-bit min-max per (token, head), round half up, scale and min stored as fp16."""
    codes, scale, lo = pf.asym_uniform_codes(v, 4, -1, half_up=True, eps=1e-8)
    return pf.dequantize_asym_uniform(codes, scale.half().float(), lo.half().float()).to(v.dtype)


def _tq_k8v4(layer, k, v):
    return k.to(torch.float8_e4m3fn).to(k.dtype), _tq_values(v)


def _fp8_calibrated(layer, k, v):
    """Per-tensor FP8 with scales ``amax / 448`` computed from this layer's first update, then frozen."""
    if getattr(layer, "fp8_scales", None) is None:
        layer.fp8_scales = tuple(max(float(x.abs().amax()) / pf.FP8_E4M3_MAX, 1e-12) for x in (k, v))
    ks, vs = layer.fp8_scales
    return pf.fp8_per_tensor(k, ks).to(k.dtype), pf.fp8_per_tensor(v, vs).to(v.dtype)


def _llama_row_bytes(block_bytes: int):
    return lambda h, d: 2 * (h * d // pf.LLAMA_BLOCK) * block_bytes


def _tq_slot(h: int, d: int) -> int:
    slot = d + d // 2 + 4  # fp8 key | 4-bit value nibbles + fp16 scale + fp16 zero
    return h * (slot + slot % 2)  # TurboQuantConfig.slot_size_aligned: rounded up to even


# ---------------------------------------------------------------------------------------------- KIVI
KIVI_GROUP = 32
KIVI_RESIDUAL = 128


def kivi_split(num_tokens: int, residual: int = KIVI_RESIDUAL) -> tuple[int, int]:
    """``(keys quantized, values quantized)`` after KIVI has settled ``num_tokens`` tokens.

    Keys move to the quantized store ``residual`` tokens at a time (whole multiples of the window); values
    one token at a time, keeping the newest ``residual`` exact (``models/llama_kivi.py``).
    """
    return num_tokens // residual * residual, max(num_tokens - residual, 0)


def kivi_nbytes(num_tokens: int, kv_heads: int, head_dim: int, bits: int, group: int = KIVI_GROUP) -> int:
    """One layer's KIVI bytes: packed codes, scale + min (fp16) per K (channel, 32-token group) and per V
    (token, 32-channel group), exact tokens in fp16."""
    kq, vq = kivi_split(num_tokens)
    vgroup = min(group, head_dim)
    codes = (kq + vq) * head_dim * bits // 8
    k_meta = kq // group * head_dim * 2 * EXACT_BYTES
    v_meta = vq * (head_dim // vgroup) * 2 * EXACT_BYTES
    exact = (2 * num_tokens - kq - vq) * head_dim * EXACT_BYTES
    return kv_heads * (codes + k_meta + v_meta + exact)


class KiviLayer(DynamicLayer):
    """KIVI's storage: K per channel in groups of 32 tokens, V per token in groups of 32 channels, both
    asymmetric min-max at ``bits``; the windows move *after* the step that filled them (KIVI quantizes once the
    step's attention is done), so an update first settles what the previous steps left, then appends exact.
    ``keys``/``values`` hold the dequantized store followed by the exact tokens ``[B, kv_heads, T, head_dim]``.
    """

    def __init__(self, bits: int):
        super().__init__()
        self.bits = bits
        self.keys_done = self.values_done = 0

    def _settle(self) -> None:
        kq, vq = kivi_split(self.keys.shape[-2])
        if kq > self.keys_done:
            seg = self.keys[..., self.keys_done : kq, :]
            b, h, t, d = seg.shape
            grouped = seg.reshape(b, h, t // KIVI_GROUP, KIVI_GROUP, d)  # per channel, over 32 tokens
            codes, scale, lo = pf.asym_uniform_codes(grouped, self.bits, dim=3)
            deq = pf.dequantize_asym_uniform(codes, scale.half().float(), lo.half().float())
            self.keys[..., self.keys_done : kq, :] = deq.reshape(seg.shape).to(seg.dtype)
            self.keys_done = kq
        if vq > self.values_done:
            seg = self.values[..., self.values_done : vq, :]
            group = min(KIVI_GROUP, seg.shape[-1])
            grouped = seg.reshape(*seg.shape[:-1], seg.shape[-1] // group, group)  # per token, 32 channels
            codes, scale, lo = pf.asym_uniform_codes(grouped, self.bits, dim=-1)
            deq = pf.dequantize_asym_uniform(codes, scale.half().float(), lo.half().float())
            self.values[..., self.values_done : vq, :] = deq.reshape(seg.shape).to(seg.dtype)
            self.values_done = vq

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.is_initialized and self.keys.numel():
            self._settle()
        return super().update(key_states, value_states)


class PeerLayer(DynamicLayer):
    """A ``DynamicLayer`` that stores every new token as the peer's format would return it (per-token formats:
    each token's codes depend only on that token, and on the layer's frozen scales for per-tensor FP8)."""

    def __init__(self, fmt: PeerFormat):
        super().__init__()
        self.fmt = fmt
        self.fp8_scales = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self.fmt.quantize(self, key_states, value_states)
        return super().update(keys, values)


class PeerCache(Cache):
    """A transformers ``Cache`` storing every layer in one :class:`PeerFormat` (boundary layers exact)."""

    def __init__(self, fmt: PeerFormat, config: PreTrainedConfig):
        from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

        text = config.get_text_config(decoder=True)
        # Full-attention layers take the peer's format; sliding-window layers stay transformers' own bounded
        # full-precision layers, as AsymKVCache keeps them, so that both sides treat them alike (an engine such as
        # vLLM would quantize them too: the comparison is of the full-attention layers' formats).
        base = DynamicCache(config=config).layers
        if len(base) != text.num_hidden_layers or any(
                type(layer) is not DynamicLayer and not isinstance(layer, DynamicSlidingWindowLayer) for layer in base):
            raise ValueError(f"peer scheme {fmt.name!r} emulates models of full-attention and sliding-window layers "
                             f"only; this model's cache layers are {sorted({type(x).__name__ for x in base})}")
        full = [i for i, layer in enumerate(base) if type(layer) is DynamicLayer]
        n = len(full)
        layers = list(base)
        for rank, i in enumerate(full):  # boundary layers (TurboQuant) counted among the full-attention layers
            layers[i] = (DynamicLayer() if fmt.is_exact_layer(rank, n) else KiviLayer(fmt.kivi_bits)
                         if fmt.kivi_bits else PeerLayer(fmt))
        super().__init__(layers=layers)
        self.fmt = fmt
        self.shapes = layer_shapes(config)

    def engine_nbytes(self) -> int:
        """Engine bytes for the tokens this cache holds now (per layer, batch included)."""
        total = 0
        for layer, shape in zip(self.layers, self.shapes):
            if not layer.is_initialized or layer.keys.numel() == 0:
                continue
            tokens, batch = layer.keys.shape[-2], layer.keys.shape[0]
            total += batch * self.fmt.layer_nbytes(tokens, shape.kv_heads, shape.head_dim,
                                                   exact=not isinstance(layer, (PeerLayer, KiviLayer)))
        return total


_VLLM = "github.com/vllm-project/vllm"
_LLAMA = "github.com/ggml-org/llama.cpp"

PEERS: dict[str, PeerFormat] = {p.name: p for p in [
    PeerFormat("vllm-int8-pth", "vLLM int8_per_token_head: symmetric int8, fp32 scale per (token, head)",
               f"{_VLLM}: vllm/v1/attention/ops/triton_reshape_and_cache_flash.py (per-token-head store), "
               "tests/quantization/test_per_token_kv_cache.py (INT8_CONFIG)",
               _both(_int8_pth), lambda h, d: 2 * h * (d + 4)),
    PeerFormat("vllm-int4-pth", "vLLM int4_per_token_head: randomized Hadamard, asymmetric int4 per (token, head), "
               "fp32 scale carrying the zero point", f"{_VLLM}: vllm/v1/attention/ops/int4_per_token_head.py "
               "(_reshape_cache_int4_kernel, single_rht)", _both(_int4_pth), lambda h, d: 2 * h * (d // 2 + 4)),
    PeerFormat("vllm-tq-k8v4", "vLLM turboquant_k8v4: K cast to fp8-e4m3 (no scale), V 4-bit min-max per (token, "
               "head) with fp16 scale+zero, first/last 2 layers exact",
               f"{_VLLM}: vllm/model_executor/layers/quantization/turboquant/config.py (TQ_PRESETS, slot sizes, "
               "get_boundary_skip_layers), vllm/v1/attention/ops/triton_tq_store.py (KEY_FP8 store, VQB == 4)",
               _tq_k8v4, _tq_slot, boundary_layers=2),
    PeerFormat("vllm-fp8-tensor", "vLLM fp8_e4m3 with per-tensor k_scale/v_scale calibrated on the first "
               "forward (--calculate-kv-scales)", f"{_VLLM}: vllm/config/cache.py (cache_dtype, calculate_kv_scales); "
               "the quantized KV-cache docs page", _fp8_calibrated, lambda h, d: 2 * h * d,
               layer_bytes=8),
    PeerFormat("llama-q8_0", "llama.cpp -ctk/-ctv q8_0: 32-value blocks, fp16 scale amax/127, no rotation",
               f"{_LLAMA}: ggml/src/ggml-quants.c (quantize_row_q8_0_ref), ggml/src/ggml-common.h (block_q8_0)",
               _both(_q8_0), _llama_row_bytes(34)),
    PeerFormat("llama-q4_0", "llama.cpp q4_0: 32-value blocks, fp16 scale max/-8, codes offset 8, no rotation",
               f"{_LLAMA}: ggml/src/ggml-quants.c (quantize_row_q4_0_ref), ggml/src/ggml-common.h (block_q4_0)",
               _both(_q4_0), _llama_row_bytes(18)),
    PeerFormat("llama-q8_0-rot", "llama.cpp q8_0 with the Hadamard rotation of K and V (default when quantized)",
               f"{_LLAMA}: PR #21038 (llama : rotate activations for better quantization), src/llama-graph.cpp",
               _both(_rotated(_q8_0)), _llama_row_bytes(34)),
    PeerFormat("llama-q4_0-rot", "llama.cpp q4_0 with the Hadamard rotation of K and V (default when quantized)",
               f"{_LLAMA}: PR #21038, src/llama-graph.cpp; ggml/src/ggml-quants.c (quantize_row_q4_0_ref)",
               _both(_rotated(_q4_0)), _llama_row_bytes(18)),
    PeerFormat("kivi-2", "KIVI-2: K per channel / V per token, 2-bit min-max, groups of 32, fp16 window 128",
               "arXiv 2402.02750 (KIVI; group 32 and window 128 as in its experiments); github.com/jy-yuan/KIVI: models/llama_kivi.py, quant/new_pack.py "
               "(triton_quantize_and_pack_along_last_dim)", None, lambda h, d: 0, kivi_bits=2),
    PeerFormat("kivi-4", "KIVI-4: as KIVI-2 with 4-bit codes", "arXiv 2402.02750; github.com/jy-yuan/KIVI "
               "(models/llama_kivi.py)", None, lambda h, d: 0, kivi_bits=4),
]}


def make_peer_cache(name: str, config: PreTrainedConfig) -> PeerCache:
    """The :class:`PeerCache` of peer ``name``.

    Raises:
        ValueError: unknown name (the message lists the peers) or a model that is not all full attention.
    """
    if name not in PEERS:
        raise ValueError(f"unknown peer format {name!r}; known peers: {list(PEERS)}")
    return PeerCache(PEERS[name], config)
