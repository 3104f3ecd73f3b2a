"""The attention alone, for ``scripts/gpu_check.py``: the Triton kernel over a layer's codes against SDPA over the
same K/V in bf16 (time, bytes read, bandwidth), and its agreement with the torch fused attention (SQNR).

K/V come from a real cache (``AsymKVCache.from_preset``) filled through ``Cache.update`` with random keys (one
outlier channel) and values, at the model's first layer's shapes.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..core.attention import fused_attention
from ..core.backend import triton_fused_attention
from ..core.quant import sqnr_db
from .gpu_runs import attention_backend_env, timed_seconds
from .schemes import make_cache, scheme_attention

__all__ = ["attention_rows", "graph_seconds", "kernel_check_rows", "quantized_kv", "read_bytes"]


def quantized_kv(model, preset: str, batch: int, context: int, dtype: torch.dtype, q_len: int = 1, seed: int = 0):
    """``(key, value, query)``: a ``preset`` cache's layer-0 ``QuantizedKV`` after ``context + q_len`` tokens, and a
    ``[B, Hq, q_len, D]`` query."""
    cfg, device = model.config, model.device
    g = torch.Generator(device).manual_seed(seed)
    shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
    keys, values = torch.randn(shape, generator=g, device=device), torch.randn(shape, generator=g, device=device)
    keys[..., 3] *= 10  # a key outlier channel, as real keys have
    name = f"asymkv-{preset}-fused"
    with scheme_attention(model, name):
        cache = make_cache(name, cfg)
        cache.update(keys[:, :, :-q_len].to(dtype), values[:, :, :-q_len].to(dtype), 0)
        key, value = cache.update(keys[:, :, -q_len:].to(dtype), values[:, :, -q_len:].to(dtype), 0)
    if not hasattr(key, "codes"):
        raise ValueError(f"a context of {context} tokens quantizes no block of preset {preset!r}: use a longer one.")
    query = torch.randn(batch, cfg.num_attention_heads, q_len, cfg.head_dim, generator=g, device=device).to(dtype)
    return key, value, query


def read_bytes(kv) -> int:
    """Bytes one attention call reads of a layer's ``QuantizedKV`` (codes, scales, zeros, wide channels' high bits and
    indices, and exact tokens)."""
    overlay = None if kv.overlay is None else kv.overlay.tokens
    wide = (None, None) if kv.wide is None else (kv.wide.bits, kv.wide.channels)
    parts = (kv.prefix, kv.codes.data, kv.scale, kv.zero, kv.tail, overlay, *wide)
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def graph_seconds(fn, iters: int, device: torch.device) -> float | None:
    """Seconds per call replayed from a CUDA graph (no launch overhead), or None off CUDA or if capture fails."""
    if device.type != "cuda":
        return None
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        return None
    seconds, _ = timed_seconds(lambda: [graph.replay() for _ in range(iters)], device)
    return seconds / iters


def _time_call(fn, iters: int, device: torch.device) -> dict:
    fn()  # compiles the kernels, warms the allocator
    eager, _ = timed_seconds(lambda: [fn() for _ in range(iters)], device)
    graph = graph_seconds(fn, iters, device)
    return {"eager_us": eager / iters * 1e6, "graph_us": None if graph is None else graph * 1e6}


@torch.no_grad()
def attention_rows(model, presets: list[str], batch: int, context: int, iters: int) -> list[dict]:
    """One row per implementation: ``sdpa-bf16`` (the dense K/V of the first preset) and ``triton-<preset>``, each
    with microseconds per call (eager loop, and CUDA-graph replay on a GPU) and the bytes it reads."""
    scale = model.config.head_dim**-0.5
    rows = []
    for i, preset in enumerate(presets):
        key, value, query = quantized_kv(model, preset, batch, context, model.dtype)
        if i == 0:
            dense_k, dense_v = key.dense(), value.dense()
            sdpa = lambda: F.scaled_dot_product_attention(query, dense_k, dense_v, scale=scale, enable_gqa=True)  # noqa: E731
            rows.append({"impl": "sdpa-bf16", "batch": batch, "context": context,
                         "bytes": 2 * dense_k.numel() * dense_k.element_size(), **_time_call(sdpa, iters, model.device)})
        ours = lambda: triton_fused_attention(query, key, value, None, scale, None)  # noqa: E731
        row = {"impl": f"triton-{preset}", "batch": batch, "context": context, "bytes": read_bytes(key) + read_bytes(value)}
        with attention_backend_env("triton"), _failures_recorded(row):
            row.update(_time_call(ours, iters, model.device))
        rows.append(row)
    return rows


@contextlib.contextmanager
def _failures_recorded(row: dict) -> Iterator[None]:
    """Record an exception as ``row["status"]`` (traceback on stderr) instead of raising: on a borrowed GPU, one
    failing kernel variant must not cost the other figures of the run."""
    try:
        yield
    except Exception as exc:
        traceback.print_exc()
        row["status"] = f"failed: {type(exc).__name__}: {str(exc)[:160]}"


@torch.no_grad()
def kernel_check_rows(model, presets: list[str], batch: int, context: int) -> list[dict]:
    """SQNR of the Triton kernel against the torch fused attention (same codes), per preset, dtype and query
    length, on a left-padded batch (row 1 misses its first 7 tokens) with a causal mask."""
    rows = []
    for preset in presets:
        for dtype in dict.fromkeys((torch.float32, model.dtype)):
            for q_len in (1, 5):
                key, value, query = quantized_kv(model, preset, batch, context, dtype, q_len, seed=1)
                kv = key.shape[2]
                mask = torch.ones(q_len, kv, dtype=torch.bool, device=model.device).tril(kv - q_len)
                mask = mask[None, None].repeat(batch, 1, 1, 1)
                mask[1:, :, :, :7] = False
                want = fused_attention(query, key, value, mask, query.shape[-1] ** -0.5)
                row = {"preset": preset, "dtype": str(dtype).replace("torch.", ""), "q_len": q_len, "sqnr_db": None}
                with attention_backend_env("triton"), _failures_recorded(row):
                    got = triton_fused_attention(query, key, value, mask, query.shape[-1] ** -0.5, None)
                    row["sqnr_db"] = sqnr_db(want, got)
                rows.append(row)
    return rows
