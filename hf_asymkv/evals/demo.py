"""`hf-asymkv demo`: one long-document retrieval prompt, full precision and AsymKVCache side by side.

Each cache answers the same prompt by greedy ``generate``. The table shows the real KV bytes in the model's own
dtype next to the same caches on a bf16 model (the README's comparison), and the decode speed as the median
time per generated token after warm-up steps, read from a streamer that stamps every token ``generate`` emits.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from ..bench.memory import cache_nbytes
from ..core.cache import AsymKVCache
from ..core.compat import cache_kwargs
from ..models import input_device
from .tasks import make_needle_prompt, score_answer

__all__ = ["WARMUP_STEPS", "DemoRow", "StepClock", "bf16_bytes", "format_demo", "run_demo"]

WARMUP_STEPS = 2
"""Decode steps after the prefill left out of the timing (allocator and kernel warm-up)."""
MIN_TIMED_STEPS = 3
"""Fewer timed steps than this (an answer that ends early): no timing is shown."""


@dataclass
class DemoRow:
    """One cache's run: its answer, its KV bytes as held and on a bf16 model, and its decode speed.

    ``decode_ms`` is the median milliseconds per decode step over ``timed_steps`` steps (None: too few steps).
    """

    cache: str
    answer: str
    correct: bool
    kv_bytes: int
    kv_bytes_bf16: int
    decode_ms: float | None
    timed_steps: int


class StepClock(BaseStreamer):
    """A ``generate`` streamer that stamps ``time.perf_counter()`` each time tokens arrive.

    ``generate`` calls :meth:`put` with the prompt before the prefill, then once per generated token, so the
    gaps between stamps from the second on are the decode steps (the first gap is prefill + first token).
    """

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_ms(self, warmup: int = WARMUP_STEPS) -> tuple[float | None, int]:
        """``(median ms per decode step after warmup steps, steps timed)``; the median is None with fewer
        than :data:`MIN_TIMED_STEPS` steps."""
        gaps = [(b - a) * 1e3 for a, b in zip(self.stamps[1:], self.stamps[2:])][warmup:]
        return (statistics.median(gaps) if len(gaps) >= MIN_TIMED_STEPS else None), len(gaps)


def bf16_bytes(cache, held_bytes: int, itemsize: int) -> int:
    """The bytes ``cache`` would hold for the same tokens on a bf16 model.

    A ``DynamicCache`` holds only K/V in the model's dtype (``itemsize`` bytes/element): it scales to 2 bytes.
    In an :class:`AsymKVCache` only the exact parts (sinks and window, ``sink_*``/``window_*``) are in the model's
    dtype; codes, scales and zeros have their own dtypes and do not change.
    """
    if not isinstance(cache, AsymKVCache):
        return held_bytes * 2 // itemsize
    footprint = cache.memory_footprint()
    exact = sum(v for k, v in footprint.items() if k.startswith(("sink_", "window_")))
    return footprint["total"] - exact + exact * 2 // itemsize


@torch.no_grad()
def run_demo(model, tokenizer, *, context_tokens: int = 3000, depth: float = 0.35, seed: int = 7,
             max_new_tokens: int = 24) -> tuple[list[DemoRow], dict]:
    """Ask for a fact planted ``depth`` into a ``context_tokens`` document, once per cache.

    Returns:
        ``(rows, info)``: one row per cache (answer, correctness, real KV bytes after generation and on a bf16
        model, median decode ms/token) and the prompt facts (length, expected answer, model dtype).
    """
    prompt = make_needle_prompt(tokenizer, context_tokens, depth, seed)
    enc = tokenizer.apply_chat_template(
        prompt.messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    ).to(input_device(model))
    n_prompt = enc["input_ids"].shape[1]
    itemsize = model.dtype.itemsize
    rows = []
    for name, cache in (("DynamicCache (full precision)", DynamicCache(config=model.config)),
                        ("AsymKVCache (default: K int8/ch, V int4/tok rotated, 4 sinks)", AsymKVCache(model.config))):
        clock = StepClock()
        out = model.generate(**enc, **cache_kwargs(cache), max_new_tokens=max_new_tokens, do_sample=False,
                             streamer=clock)
        answer = tokenizer.decode(out[0, n_prompt:], skip_special_tokens=True).strip()
        held = cache_nbytes(cache)
        rows.append(DemoRow(name, answer, score_answer(answer, prompt.answer), held,
                            bf16_bytes(cache, held, itemsize), *clock.decode_ms()))
    info = {"prompt_tokens": n_prompt, "expected": prompt.answer, "depth": depth, "key": prompt.key,
            "dtype": str(model.dtype).removeprefix("torch.")}
    return rows, info


def format_demo(rows: list[DemoRow], info: dict) -> str:
    """A plain-text table: KV MiB and "x smaller" against the first (full-precision) row, in the model's dtype
    and (when that is not bf16) on a bf16 model, side by side; then decode ms/token and the answer."""
    dtype = info.get("dtype", "?")
    both = dtype != "bfloat16"
    head = (f"Prompt: {info['prompt_tokens']} tokens; the access code for the {info['key']} "
            f"({info['expected']}) sits {info['depth']:.0%} into the document.\n")
    kv_head = f"{'KV MiB ' + dtype:>16} {'x smaller':>9}"
    if both:
        kv_head += f" {'KV MiB bf16':>12} {'x smaller':>9}"
    width = max(len("cache"), *(len(r.cache) for r in rows))
    lines = [f"{'cache':{width}} {kv_head} {'decode ms/token':>15}  {'ok':3} answer"]
    for r in rows:
        kv = f"{r.kv_bytes / 2**20:16.2f} {rows[0].kv_bytes / r.kv_bytes:9.2f}"
        if both:
            kv += f" {r.kv_bytes_bf16 / 2**20:12.2f} {rows[0].kv_bytes_bf16 / r.kv_bytes_bf16:9.2f}"
        ms = f"{r.decode_ms:15.1f}" if r.decode_ms is not None else f"{'n/a':>15}"
        lines.append(f"{r.cache:{width}} {kv} {ms}  {'yes' if r.correct else 'no':3} {' '.join(r.answer.split())}")
    if both:
        lines.append(f"KV MiB {dtype}: what this run holds (model dtype {dtype}). KV MiB bf16: the same caches on a "
                     "bf16 model (exact tokens at 2 bytes, codes and scales unchanged), the README's comparison.")
    steps = sorted({r.timed_steps for r in rows})
    counted = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
    lines.append(f"decode ms/token: median of {counted} decode steps after {WARMUP_STEPS} warm-up "
                 "steps, one run (n/a: too few steps); `hf-asymkv bench` repeats and interleaves the schemes.")
    return head + "\n".join(lines)
