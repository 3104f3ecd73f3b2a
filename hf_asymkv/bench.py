"""KV memory measurement: real cache bytes after a prefill (and after some decode steps), per scheme.

All schemes run on the same model and the same token ids in one process; ratios are against
``DynamicCache`` in the model's dtype (bf16 by default), so the numbers compare like with like.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from .fileio import atomic_write_text
from .memory import cache_nbytes
from .schemes import make_cache

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
def _run(model, input_ids: torch.Tensor, cache, decode_tokens: int) -> tuple[int, int]:
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    prefill = cache_nbytes(cache)
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(decode_tokens):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
    return prefill, cache_nbytes(cache)


def measure_kv_memory(
    model, schemes: list[str], lengths: list[int], *, decode_tokens: int = 0, seed: int = 0
) -> list[MemoryRow]:
    """Prefill ``length`` random tokens per scheme and count the cache's real tensor bytes.

    Args:
        model: a causal LM (its dtype is the dtype compared).
        schemes: names from :mod:`hf_asymkv.schemes`; ``"dynamic"`` is added first if missing.
        lengths: prefill lengths.
        decode_tokens: greedy steps after the prefill, to show steady-state bytes (capacity included).

    Returns:
        One row per (scheme, length), with ``ratio_vs_dynamic`` filled in.
    """
    schemes = ["dynamic"] + [s for s in schemes if s != "dynamic"]
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for length in lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, length), generator=gen).to(model.device)
        base = None
        for name in schemes:
            prefill, decoded = _run(model, ids, make_cache(name, model.config), decode_tokens)
            base = prefill if base is None else base
            rows.append(MemoryRow(name, length, prefill, decoded, decode_tokens, base / prefill))
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
