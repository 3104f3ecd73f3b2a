"""Opt-in fused attention over the quantized cache: ``attn_implementation="asymkv_sdpa"``.

With the default attention, :class:`~hf_asymkv.core.layer.AsymKVLayer` hands transformers dense K/V: every closed
block is decoded into a full-precision ``[B, H, seq, D]`` tensor at each step. After :func:`register` and
loading the model with ``attn_implementation="asymkv_sdpa"``, the layers hand over a
:class:`~hf_asymkv.core.kv_view.QuantizedKV`
instead and this module's attention never builds dense K or V for the quantized region:

- keys (scales per block and channel, i.e. ``channel``/``tensor`` granularity): the scale is folded into the
  query, ``q . (s * c) = (q * s) . c``, one small matmul per block against the raw codes;
- values (per-token scale and zero): they are folded into the attention weights,
  ``sum_t p_t (s_t c_t + z_t) = (p * s) @ c + p @ z``; rotated values (``V H`` stored) are mixed as stored and
  only the mixed output is rotated back, ``(p @ V H) H^T``: one ``[q, D] x [D, D]`` product per head; rotated
  keys (an ablation) meet the rotated query, ``q . k = (q H) . (k H)``.

What it materializes, per layer and call: the quantized region's codes converted to float32 (``[B, H, N, D]``
for K and for V: as large as a float32 copy of that region; PyTorch has no int8 x float matmul on CPU), the
scaled queries per block (``[B, H, N / block, n_rep * q, D]``) and the scores (``[B, H, n_rep * q, seq]``, like
eager attention). So the win over the dense path is the skipped scale passes and model-dtype copies, not fewer
bytes read; a fused GPU kernel would read the codes directly. Because the last two grow with the query
length, queries longer than :data:`FUSED_MAX_QUERY_TOKENS` (a long prefill chunk, a second chat turn) take the
dense path, whose SDPA kernel does not materialize the scores. Cases this path does not fold (softcapping,
sliding windows, attention sinks ``s_aux``, dropout in training, per-token K scales) decode densely and use
transformers' SDPA too, so results are always those of the reference path up to float rounding.
"""

from __future__ import annotations

import threading

import torch

from .backend import native_fused_attention, triton_fused_attention
from .kv_view import HEADWISE_MASKING_REFUSED, QuantizedKV, SinkOverlayView, mask_bias, write_rows
from .quant import decode_codes
from .rotation import rotate, unrotate
from .static_attention import StaticQuantizedKV, static_fused_attention
from .static_op import static_attention, static_attention_args, use_operator

__all__ = ["ATTN_IMPLEMENTATION", "FUSED_MAX_QUERY_TOKENS", "asymkv_sdpa_attention", "fused_attention", "register"]

ATTN_IMPLEMENTATION = "asymkv_sdpa"
FUSED_MAX_QUERY_TOKENS = 16
"""Longest query (tokens per call) the fused path takes; longer ones decode densely and use SDPA. At 16 tokens
over a 32k history (GQA 3 query heads per KV head, head_dim 64) the scaled queries take ~9 MiB per layer; at
1,000 tokens they would take ~600 MiB and the scores ~1.2 GiB."""


def _foldable(kv: QuantizedKV, head_dim: int) -> bool:
    """Scales shared by whole blocks (channel/tensor granularity) fold into the query or the weights."""
    return kv.spec.groups(head_dim)[0] == kv.spec.block_size


def _expand_channels(meta: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[B, H, G_t, D // cg]`` -> ``[B, H, G_t, D]`` (one value per channel)."""
    return meta.repeat_interleave(head_dim // meta.shape[-1], dim=-1) if meta.shape[-1] != head_dim else meta


def _key_scores(q: torch.Tensor, k: QuantizedKV) -> torch.Tensor:
    """``q @ K_quant^T`` without dequantizing K: ``[B, H, Q, N]`` for ``q`` ``[B, H, Q, D]``.

    Per block ``b``: ``q . (s_b * c + z_b) = (q * s_b) . c + q . z_b`` (the wide channels' high bits folded into
    ``c``).
    """
    b, h, nq, d = q.shape
    n, bs = k.n_quantized, k.spec.block_size
    codes = decode_codes(k.codes, k.spec, dtype=q.dtype, wide=k.wide).view(b, h, n // bs, bs, d)
    scale = _expand_channels(k.scale.to(q.dtype), d)  # [B, H, nblk, D]
    qs = q[:, :, None] * scale[:, :, :, None, :]  # [B, H, nblk, Q, D]
    scores = qs @ codes.transpose(-1, -2)  # [B, H, nblk, Q, bs]
    if k.zero is not None:
        zero = _expand_channels(k.zero.to(q.dtype), d)
        scores += (q[:, :, None] @ zero[:, :, :, :, None])  # [B, H, nblk, Q, 1]
    return scores.permute(0, 1, 3, 2, 4).reshape(b, h, nq, n)


def _value_mix(p: torch.Tensor, v: QuantizedKV, head_dim: int) -> torch.Tensor:
    """``p @ V_quant`` without dequantizing V: ``[B, H, Q, D]`` for weights ``p`` ``[B, H, Q, N]``."""
    b, h, nq, n = p.shape
    tg, cg = v.spec.groups(head_dim)
    codes = decode_codes(v.codes, v.spec, dtype=p.dtype)  # [B, H, N, D]
    scale = v.scale.to(p.dtype)
    zero = None if v.zero is None else v.zero.to(p.dtype)
    if tg == 1:  # per-token groups of cg channels: fold the scale into the weights, group by group
        groups = head_dim // cg
        if groups == 1:
            out = (p * scale[..., 0][:, :, None, :]) @ codes
        else:
            w = p[..., None] * scale[:, :, None]  # [B, H, Q, N, G]
            c = codes.view(b, h, n, groups, cg).transpose(2, 3)  # [B, H, G, N, cg]
            out = (w.permute(0, 1, 4, 2, 3) @ c).permute(0, 1, 3, 2, 4).reshape(b, h, nq, head_dim)
        if zero is not None:
            out += (p @ zero).repeat_interleave(cg, dim=-1)
        return out
    # scales per block (channel/tensor granularity): mix each block's raw codes, then scale the block sums
    nblk = n // tg
    pb = p.view(b, h, nq, nblk, tg).transpose(2, 3)  # [B, H, nblk, Q, tg]
    mixed = pb @ codes.view(b, h, nblk, tg, head_dim)  # [B, H, nblk, Q, D]
    out = (mixed * _expand_channels(scale, head_dim)[:, :, :, None, :]).sum(2)
    if zero is not None:
        out += (pb.sum(-1)[..., None] * _expand_channels(zero, head_dim)[:, :, :, None, :]).sum(2)
    return out


def _parts(kv: QuantizedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact tokens before and after the quantized region: ``([B, H, ns, D], [B, H, m, D])``."""
    prefix = kv.prefix if kv.prefix is not None else kv.tail[:, :, :0]
    return prefix, kv.tail


def _overlay_scores(q: torch.Tensor, overlay: SinkOverlayView, bias: torch.Tensor | None, kv_len: int
                    ) -> torch.Tensor:
    """Scores ``[B, H, R, S]`` of the exact sink overlay: ``q`` against its tokens, with the mask of their positions;
    slots outside the quantized region are -inf (they are attended where they lie, exact)."""
    scores = q @ overlay.tokens.to(q.dtype).transpose(-1, -2)
    if bias is not None:
        index = overlay.positions.clamp(max=kv_len - 1)[:, None, None, :]
        scores = scores + bias.gather(-1, index.expand(*bias.shape[:3], index.shape[-1]))
    return scores.masked_fill(~overlay.valid[:, None, None, :], float("-inf"))


def fused_attention(query: torch.Tensor, key: QuantizedKV, value: QuantizedKV, attention_mask: torch.Tensor | None,
                    scaling: float) -> torch.Tensor:
    """Softmax attention of ``query`` ``[B, Hq, q, D]`` over quantized K/V; returns ``[B, q, Hq, D_v]``.

    Grouped-query heads are packed (``Hq = H * n_rep``): each K/V head serves its ``n_rep * q`` query rows.
    Scores and softmax run in float32 for half-precision inputs.
    """
    b, hq, q_len, d = query.shape
    h = key.tail.shape[1]
    n_rep = hq // h
    work = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    q = (query.to(work) * scaling).reshape(b, h, n_rep * q_len, d)  # query is often a transposed view
    k_pre, k_tail = _parts(key)
    v_pre, v_tail = _parts(value)
    n, ns = key.n_quantized, k_pre.shape[2]
    q_codes = rotate(q).to(work) if key.spec.rotated else q  # rotated keys: q . k = (q H) . (k H)
    quantized = _key_scores(q_codes, key) if n else q[..., :0]
    overlay = key.overlay if n else None
    if overlay is not None:  # padded rows' exact sinks replace their quantized positions (one more segment below)
        write_rows(quantized, 3, overlay.positions - ns, overlay.valid, float("-inf"))
    scores = torch.cat([q @ k_pre.to(work).transpose(-1, -2), quantized,
                        q @ k_tail.to(work).transpose(-1, -2)], dim=-1)  # [B, H, n_rep*q, kv]
    kv_len = scores.shape[-1]
    bias = mask_bias(attention_mask, b, h, n_rep, q_len, kv_len, work, query.device)
    if bias is not None:
        scores = scores + bias
    if overlay is not None:
        scores = torch.cat([scores, _overlay_scores(q, overlay, bias, kv_len)], dim=-1)
    p = scores.softmax(dim=-1)
    out = p[..., :ns] @ v_pre.to(work) + p[..., ns + n : kv_len] @ v_tail.to(work)
    if overlay is not None:
        out += p[..., kv_len:] @ value.overlay.tokens.to(work)
    if n:  # rotated values: mix the rotated codes, rotate the [B, H, n_rep*q, D] result back (cheaper than V)
        mixed = _value_mix(p[..., ns : ns + n], value, value.tail.shape[-1])
        out += unrotate(mixed) if value.spec.rotated else mixed
    dv = out.shape[-1]
    return out.view(b, h, n_rep, q_len, dv).reshape(b, hq, q_len, dv).transpose(1, 2).to(query.dtype).contiguous()


def _static_refused(module, dropout: float, kwargs: dict) -> str | None:
    """A feature of the call that the static fused attention does not serve (such calls decode densely), or None."""
    for name in ("sliding_window", "s_aux"):
        if kwargs.get(name) is not None:
            return f"attention with {name}"
    if dropout > 0 and module.training:
        return f"dropout {dropout} in training"
    return None


def _refused(module, key: QuantizedKV, dropout: float, kwargs: dict) -> str | None:
    """A feature of the call that neither fused backend serves (such calls decode densely), or None."""
    refused = _static_refused(module, dropout, kwargs)
    if refused is not None:
        return refused
    if not _foldable(key, key.tail.shape[-1]):
        return f"keys with one scale per {key.spec.granularity!r} group (not per block)"
    return None


def asymkv_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          is_causal=None, **kwargs):
    """transformers attention function (``AttentionInterface``) for ``attn_implementation="asymkv_sdpa"``.

    Dense K/V (layers that are not quantized, or nothing quantized yet) go to transformers' SDPA unchanged;
    :class:`~hf_asymkv.core.kv_view.QuantizedKV` goes through the fused attention when it can be folded and the query has at most
    :data:`FUSED_MAX_QUERY_TOKENS` tokens, else is decoded densely. The fused attention runs on the backend
    ``HF_ASYMKV_ATTENTION_BACKEND`` picks (:func:`~hf_asymkv.core.backend.triton_fused_attention`): the Triton
    kernel (CUDA tensors, by default) or :func:`fused_attention`.
    Returns ``(attn_output [B, q, Hq, D], None)`` like the SDPA path.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # SDPA has no logit soft-capping; transformers' sdpa refuses it from 5.21 but silently ignored it before, so it is
    # refused here on every release rather than computing attention without the cap.
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{ATTN_IMPLEMENTATION!r} attention does not support `softcap` (neither does `sdpa`); load the "
                         "model with attn_implementation='eager' for soft-capped attention.")
    # kvpress's head-wise presses leave the keys to mask on the module after the prefill (whose query covers every
    # key); refused on every read after it, dense or not, so that masking is never skipped silently.
    if getattr(module, "masked_key_indices", None) is not None and query.shape[2] < key.shape[2]:
        raise ValueError(f"{HEADWISE_MASKING_REFUSED}.")
    if isinstance(key, StaticQuantizedKV):  # a static layer's parts: read at fixed shapes (compiled decode steps)
        if query.shape[2] <= FUSED_MAX_QUERY_TOKENS and _static_refused(module, dropout, kwargs) is None:
            scale = scaling if scaling is not None else key.shape[-1] ** -0.5
            if use_operator(query.device):  # one opaque call in the graph (a kernel's place), see static_op
                return static_attention(*static_attention_args(query, key, value, attention_mask, scale)), None
            return static_fused_attention(query, key, value, attention_mask, scale), None
        key, value = key.dense(), value.dense()
    if isinstance(key, QuantizedKV):
        if key.n_quantized and query.shape[2] <= FUSED_MAX_QUERY_TOKENS:
            refused = _refused(module, key, dropout, kwargs)
            scale = scaling if scaling is not None else key.tail.shape[-1] ** -0.5
            out = triton_fused_attention(query, key, value, attention_mask, scale, refused)
            if out is None and query.device.type == "cpu":
                out = native_fused_attention(query, key, value, attention_mask, scale, refused)
            if out is not None:
                return out, None
            if refused is None:
                return fused_attention(query, key, value, attention_mask, scale), None
        key, value = key.dense(), value.dense()
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def register() -> str:
    """Register ``"asymkv_sdpa"`` with transformers' attention and mask interfaces; returns the name.

    Nothing is registered on import. Use it with
    ``AutoModelForCausalLM.from_pretrained(..., attn_implementation="asymkv_sdpa")`` (or
    ``model.set_attn_implementation("asymkv_sdpa")``); an :class:`~hf_asymkv.AsymKVCache` built from such a
    model's config hands its layers' K/V over as :class:`~hf_asymkv.core.kv_view.QuantizedKV`. Masks are those of SDPA.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    with _REGISTER_LOCK:  # transformers' process-wide registries: both entries written before any caller returns
        AttentionInterface.register(ATTN_IMPLEMENTATION, asymkv_sdpa_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


_REGISTER_LOCK = threading.Lock()
"""Guards :func:`register` (called from any thread, as often as a request handler likes: the same entries each time)."""
