"""`hf-asymkv demo`: one long-document retrieval prompt, full precision and AsymKVCache side by side.

Each cache answers the same prompt by greedy ``generate``. The table's first column is how many times smaller than a
bf16 ``DynamicCache`` holding the same tokens each cache is (``memory_footprint()["ratio_vs_bf16"]``: the basis of
the README's and the presets table's ratios, the same on an fp32 and a bf16 model), with the tokens it holds; then
the real KV bytes, on a bf16 model and in the model's own dtype (what this run holds). Decode speed is shown only when asked
for (``timing_runs``): one run's timing flips between runs on a busy machine (ours 4x faster in one, 1.5x slower
in the next), so a figure needs repeated, interleaved runs: each run's median time per generated token after
warm-up steps, read from a streamer that stamps every token ``generate`` emits, then the median over runs and
their range.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from ..bench.memory import cache_nbytes
from ..core.cache import AsymKVCache
from ..core.compat import cache_kwargs
from ..models import input_device
from .tasks import make_needle_prompt, score_answer

__all__ = ["CACHES", "WARMUP_STEPS", "DemoRow", "StepClock", "bf16_bytes", "format_demo", "run_demo"]

WARMUP_STEPS = 2
"""Decode steps after the prefill left out of the timing (allocator and kernel warm-up)."""
MIN_TIMED_STEPS = 3
"""Fewer timed steps than this (an answer that ends early): no timing is shown."""


@dataclass
class DemoRow:
    """One cache's answer, its KV bytes as held and on a bf16 model, how many times smaller than a bf16
    ``DynamicCache`` of the same ``tokens`` it is, and (when timed) its decode speed.

    ``run_ms``: per timed run, the median milliseconds per decode step over ``timed_steps`` steps (a run with too
    few steps is left out); empty when not timed.
    """

    cache: str
    answer: str
    correct: bool
    kv_bytes: int
    kv_bytes_bf16: int
    ratio_vs_bf16: float = 1.0
    tokens: int = 0
    run_ms: list[float] = field(default_factory=list)
    timed_steps: int = 0

    @property
    def decode_ms(self) -> float | None:
        """Median over the timed runs (None: not timed)."""
        return statistics.median(self.run_ms) if self.run_ms else None


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

    A ``DynamicCache`` holds only K/V in the model's dtype (``itemsize`` bytes/element): it scales to 2 bytes. An
    :class:`AsymKVCache` says it itself (``memory_footprint()["total_on_bf16"]``: its exact parts at 2 bytes, codes,
    scales and zeros unchanged).
    """
    if not isinstance(cache, AsymKVCache):
        return held_bytes * 2 // itemsize
    return cache.memory_footprint()["total_on_bf16"]


CACHES = (("DynamicCache (full precision)", lambda config: DynamicCache(config=config)),
          ("AsymKVCache (default: K int8/ch, V int4/tok rotated, 4 sinks)", AsymKVCache))
"""(row name, factory) of the caches the demo compares."""


@torch.no_grad()
def run_demo(model, tokenizer, *, context_tokens: int = 3000, depth: float = 0.35, seed: int = 7,
             max_new_tokens: int = 24, timing_runs: int = 0) -> tuple[list[DemoRow], dict]:
    """Ask for a fact planted ``depth`` into a ``context_tokens`` document, once per cache.

    Args:
        timing_runs: 0 (default): no speed figure. N: each cache generates N times, the caches interleaved
            (run 1 of each, then run 2 of each, ...), so that a slow spell of the machine falls on both; the
            first run also gives the answer and bytes.

    Returns:
        ``(rows, info)``: one row per cache (answer, correctness, real KV bytes after generation and on a bf16
        model, per-run median decode ms/token when timed) and the prompt facts (length, expected answer, model
        dtype, timing runs).
    """
    prompt = make_needle_prompt(tokenizer, context_tokens, depth, seed)
    enc = tokenizer.apply_chat_template(
        prompt.messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    ).to(input_device(model))
    n_prompt = enc["input_ids"].shape[1]
    itemsize = model.dtype.itemsize
    rows = []
    for run in range(max(timing_runs, 1)):
        for k, (name, make) in enumerate(CACHES):
            cache, clock = make(model.config), StepClock()
            out = model.generate(**enc, **cache_kwargs(cache), max_new_tokens=max_new_tokens, do_sample=False,
                                 streamer=clock)
            if run == 0:
                answer = tokenizer.decode(out[0, n_prompt:], skip_special_tokens=True).strip()
                held = cache_nbytes(cache)
                footprint = cache.memory_footprint() if isinstance(cache, AsymKVCache) else {}
                rows.append(DemoRow(name, answer, score_answer(answer, prompt.answer), held,
                                    bf16_bytes(cache, held, itemsize), footprint.get("ratio_vs_bf16", 1.0),
                                    cache.get_seq_length()))
            ms, steps = clock.decode_ms()
            if timing_runs and ms is not None:
                rows[k].run_ms.append(ms)
                rows[k].timed_steps = steps
    info = {"prompt_tokens": n_prompt, "expected": prompt.answer, "depth": depth, "key": prompt.key,
            "dtype": str(model.dtype).removeprefix("torch."), "timing_runs": timing_runs}
    return rows, info


def format_demo(rows: list[DemoRow], info: dict) -> str:
    """A plain-text table: x smaller than a bf16 ``DynamicCache`` of the same tokens (the README's basis) with the
    tokens held; KV MiB on a bf16 model and (when the model is not bf16) as this run holds them; decode ms/token
    when timed; then the answer."""
    dtype = info.get("dtype", "?")
    both = dtype != "bfloat16"
    timed = any(r.run_ms for r in rows)
    head = (f"Prompt: {info['prompt_tokens']} tokens; the access code for the {info['key']} "
            f"({info['expected']}) sits {info['depth']:.0%} into the document.\n")
    kv_head = f"{'x smaller than bf16':>19} {'tokens':>6} {'KV MiB bf16':>11}"
    if both:
        kv_head += f" {'KV MiB ' + dtype:>14}"
    if timed:
        kv_head += f" {'decode ms/token (range)':>24}"
    width = max(len("cache"), *(len(r.cache) for r in rows))
    lines = [f"{'cache':{width}} {kv_head}  {'ok':3} answer"]
    for r in rows:
        kv = f"{r.ratio_vs_bf16:19.2f} {r.tokens:6d} {r.kv_bytes_bf16 / 2**20:11.2f}"
        if both:
            kv += f" {r.kv_bytes / 2**20:14.2f}"
        if timed:
            spread = f"{r.decode_ms:.1f} ({min(r.run_ms):.1f}-{max(r.run_ms):.1f})" if r.run_ms else "n/a"
            kv += f" {spread:>24}"
        lines.append(f"{r.cache:{width}} {kv}  {'yes' if r.correct else 'no':3} {' '.join(r.answer.split())}")
    lines.append("x smaller than bf16: than a bf16 DynamicCache holding the same tokens (memory_footprint()"
                 "['ratio_vs_bf16'], the README's basis; the saving grows with the context). KV MiB bf16: the cache "
                 "on a bf16 model" + (f"; KV MiB {dtype}: what this run holds." if both else "."))
    if timed:
        lines.append(f"decode ms/token: median over {info.get('timing_runs', len(rows[0].run_ms))} interleaved runs "
                     f"of each run's median step after {WARMUP_STEPS} warm-up steps, with the range over runs (n/a: "
                     "too few steps); `hf-asymkv bench` measures speed at several lengths.")
    else:
        lines.append("Decode speed is not shown: one run's timing is noise on a busy machine. --repeats 3 gives the "
                     "median of 3 interleaved runs of each cache; `hf-asymkv bench` measures speed at several lengths.")
    return head + "\n".join(lines)
