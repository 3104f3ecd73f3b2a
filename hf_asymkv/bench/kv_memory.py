"""KV memory per cache scheme, always beside ``DynamicCache`` in the same process, as ratios (``hf-asymkv memory``).

Real cache bytes after a prefill and after some decode steps. All schemes store the same K/V tensors (recorded
once from the model), in the same storage dtype (bf16 by default). Speed lives in :mod:`hf_asymkv.bench.speed`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
from transformers.cache_utils import DynamicCache

from ..core.compat import cache_kwargs
from ..core.fileio import atomic_write_text
from .memory import cache_nbytes
from .schemes import make_cache, with_baseline

__all__ = ["MemoryRow", "measure_kv_memory", "format_memory_table"]


@dataclass
class MemoryRow:
    scheme: str
    context: int
    prefill_bytes: int
    decode_bytes: int
    decode_tokens: int
    ratio_vs_dynamic: float = 0.0  # DynamicCache bytes / this scheme's bytes, after prefill


@torch.no_grad()
def record_kv(model, input_ids: torch.Tensor, chunk_size: int = 1024) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer post-RoPE K/V ``[B, kv_heads, T, head_dim]`` of a chunked prefill (full history, every layer)."""
    cache = DynamicCache()  # no config: sliding layers keep their whole history too, so any cache can replay it
    for start in range(0, input_ids.shape[-1], chunk_size):
        model(input_ids=input_ids[:, start : start + chunk_size], **cache_kwargs(cache), use_cache=True,
              logits_to_keep=1)
    return [(layer.keys, layer.values) for layer in cache.layers]


def replay_bytes(cache, kv: list[tuple[torch.Tensor, torch.Tensor]], prefill: int, dtype: torch.dtype) -> tuple[int, int]:
    """Store ``kv`` in ``cache`` as ``generate`` would (one prefill update, then one token per step).

    Returns:
        ``(bytes after the prefill, bytes after the remaining tokens)``, real tensor bytes.
    """
    total = kv[0][0].shape[2]
    for i, (k, v) in enumerate(kv):
        cache.update(k[:, :, :prefill].to(dtype), v[:, :, :prefill].to(dtype), i)
    after_prefill = cache_nbytes(cache)
    for t in range(prefill, total):
        for i, (k, v) in enumerate(kv):
            cache.update(k[:, :, t : t + 1].to(dtype), v[:, :, t : t + 1].to(dtype), i)
    return after_prefill, cache_nbytes(cache)


def measure_kv_memory(
    model, schemes: list[str], lengths: list[int], *, decode_tokens: int = 0, dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> list[MemoryRow]:
    """Real KV bytes per scheme after a ``length``-token prefill stored in ``dtype``, then ``decode_tokens`` steps.

    The model's K/V are computed once per length (in the model's own dtype, e.g. fp32, which is fast on a
    CPU) and replayed into every scheme's cache in ``dtype``: the bytes a cache holds depend on the shapes and
    the storage dtype, not on rounding of the values, and every scheme stores exactly the same tensors.

    Args:
        model: a causal LM.
        schemes: names from :mod:`hf_asymkv.bench.schemes`; ``"dynamic"`` is added first if missing.
        lengths: prefill lengths.
        decode_tokens: single-token updates after the prefill (steady state, capacity included).
        dtype: storage dtype the caches receive (bf16: the comparison the README quotes).

    Returns:
        One row per (scheme, length), with ``ratio_vs_dynamic`` filled in.
    """
    schemes = with_baseline(schemes)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for length in lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, length + decode_tokens), generator=gen).to(model.device)
        kv = record_kv(model, ids)
        base = None
        for name in schemes:
            prefill_bytes, decoded = replay_bytes(make_cache(name, model.config), kv, length, dtype)
            base = prefill_bytes if base is None else base
            rows.append(MemoryRow(name, length, prefill_bytes, decoded, decode_tokens, base / prefill_bytes))
        del kv
    return rows


def format_memory_table(rows: list[MemoryRow]) -> str:
    """Markdown table of the rows."""
    lines = [
        "| scheme | context | KV bytes after prefill | x smaller than DynamicCache | KV bytes after decode |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.scheme} | {r.context} | {r.prefill_bytes:,} | {r.ratio_vs_dynamic:.3f} | "
            f"{r.decode_bytes:,} (+{r.decode_tokens} tok) |"
        )
    return "\n".join(lines)


def save_rows(rows: list[MemoryRow], path, meta: dict) -> None:
    atomic_write_text(path, json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
