"""`hf-asymkv demo`: one long-document retrieval prompt, full precision and AsymKVCache side by side."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..core.compat import cache_kwargs
from ..core.cache import AsymKVCache
from ..bench.memory import cache_nbytes
from .tasks import make_needle_prompt, score_answer

__all__ = ["DemoRow", "run_demo", "format_demo"]


@dataclass
class DemoRow:
    cache: str
    answer: str
    correct: bool
    kv_bytes: int
    seconds: float


@torch.no_grad()
def run_demo(model, tokenizer, *, context_tokens: int = 3000, depth: float = 0.35, seed: int = 7,
             max_new_tokens: int = 24) -> tuple[list[DemoRow], dict]:
    """Ask for a fact planted ``depth`` into a ``context_tokens`` document, once per cache.

    Returns:
        ``(rows, info)``: one row per cache (answer, correctness, real KV bytes after generation, wall time)
        and the prompt facts (length, expected answer).
    """
    prompt = make_needle_prompt(tokenizer, context_tokens, depth, seed)
    enc = tokenizer.apply_chat_template(
        prompt.messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    ).to(model.device)
    n_prompt = enc["input_ids"].shape[1]
    rows = []
    for name, cache in (("DynamicCache (full precision)", DynamicCache(config=model.config)),
                        ("AsymKVCache (K int8/ch, V int4/tok)", AsymKVCache(model.config))):
        start = time.perf_counter()
        out = model.generate(**enc, **cache_kwargs(cache), max_new_tokens=max_new_tokens, do_sample=False)
        seconds = time.perf_counter() - start
        answer = tokenizer.decode(out[0, n_prompt:], skip_special_tokens=True).strip()
        rows.append(DemoRow(name, answer, score_answer(answer, prompt.answer), cache_nbytes(cache), seconds))
    info = {"prompt_tokens": n_prompt, "expected": prompt.answer, "depth": depth, "key": prompt.key,
            "dtype": str(model.dtype).removeprefix("torch.")}
    return rows, info


def format_demo(rows: list[DemoRow], info: dict) -> str:
    """A plain-text table, with KV bytes as a ratio against the first (full-precision) row."""
    base = rows[0].kv_bytes
    head = (f"Prompt: {info['prompt_tokens']} tokens; the access code for the {info['key']} "
            f"({info['expected']}) sits {info['depth']:.0%} into the document.\n")
    lines = [f"{'cache':38} {'KV MiB':>8} {'x smaller':>9} {'time s':>7}  {'ok':3} answer"]
    for r in rows:
        answer = " ".join(r.answer.split())
        lines.append(f"{r.cache:38} {r.kv_bytes / 2**20:8.2f} {base / r.kv_bytes:9.2f} {r.seconds:7.1f}  "
                     f"{'yes' if r.correct else 'no':3} {answer}")
    lines.append(f"(model dtype {info.get('dtype', '?')}: exact tokens and the full-precision cache use it; "
                 "`hf-asymkv memory` compares bf16 caches)")
    return head + "\n".join(lines)
