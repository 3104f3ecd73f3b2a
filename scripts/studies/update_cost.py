"""Where the eager dense path's decode time goes (issue 20, item 6): the cache update inside the whole model, split
into the dense read-out and the rest, beside DynamicCache's update; and one layer's update at short contexts, where
what is left is the cost per call (Python and operator dispatch), not the bytes.

    python scripts/studies/update_cost.py --presets balanced,compact,max --out results/bench/update_cost.md

Whole model: the default model (fp32) prefilled with ``--length`` random tokens, 3 untimed steps, then ``--steps``
timed steps; per step, the time inside ``Cache.update`` of every layer (and inside ``QuantizedKV.dense``, the
read-out) summed over the layers, and SDPA's. Two interleaved rounds, both printed: this machine's speed moves
between runs. One layer: 3 KV heads x 64 (SmolLM2's attention), ``update`` of one decode token, median of 300.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import LlamaConfig
from transformers.cache_utils import DynamicLayer

from hf_asymkv.bench.schemes import make_cache
from hf_asymkv.core import kv_view
from hf_asymkv.core.compat import cache_kwargs
from hf_asymkv.core.fileio import atomic_write_text
from hf_asymkv.core.layer import AsymKVLayer
from hf_asymkv.models import load_model

sys.path.insert(0, str(Path(__file__).parent))
from key_channel_bits import study_args  # noqa: E402

SPENT: dict[str, float] = defaultdict(float)


def timed(owner, name: str, label: str) -> None:
    """Wrap ``owner.name`` so that its wall time accumulates in ``SPENT[label]`` (for this process only)."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def make(name: str, config):
    """``"dynamic"`` or a preset name -> the bench's cache of that name."""
    return make_cache("dynamic" if name == "dynamic" else f"asymkv-{name}", config)


@torch.no_grad()
def warmed_up(model, ids: torch.Tensor, cache, steps: int = 3) -> torch.Tensor:
    """Prefill ``ids`` into ``cache`` and decode ``steps`` untimed tokens; the next input token ``[1, 1]``."""
    token = model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
    for _ in range(steps):
        token = model(input_ids=token, **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
    return token


@torch.no_grad()
def step_times(model, token: torch.Tensor, cache, steps: int) -> list[float]:
    """Seconds of each of ``steps`` greedy decode steps from ``token``."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        token = model(input_ids=token, **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - start)
    return times


def whole_model(model, ids: torch.Tensor, name: str, steps: int) -> dict[str, float]:
    """ms per step: the step, the layers' updates, the read-outs and SDPA."""
    cache = make(name, model.config)
    token = warmed_up(model, ids, cache)
    SPENT.clear()
    step = sum(step_times(model, token, cache, steps)) / steps
    return {"step": step * 1e3, **{k: v / steps * 1e3 for k, v in SPENT.items()}}


def one_layer(name: str, tokens: int, steps: int = 300) -> float:
    """Median µs of one decode token's ``update`` on one layer already holding ``tokens`` tokens."""
    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                         head_dim=64)
    cache = make(name, config)
    gen = torch.Generator().manual_seed(0)
    cache.update(torch.randn(1, 3, tokens, 64, generator=gen), torch.randn(1, 3, tokens, 64, generator=gen), 0)
    times = []
    for _ in range(steps):
        k, v = torch.randn(1, 3, 1, 64, generator=gen), torch.randn(1, 3, 1, 64, generator=gen)
        start = time.perf_counter()
        cache.update(k, v, 0)
        times.append(time.perf_counter() - start)
    return sorted(times)[steps // 2] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="balanced,compact,max")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--short", default="128,1024", help="contexts of the one-layer measure")
    args = study_args(ap)
    names = ["dynamic", *args.presets.split(",")]
    timed(DynamicLayer, "update", "update")
    timed(AsymKVLayer, "update", "update")
    timed(kv_view.QuantizedKV, "dense", "read-out")
    timed(torch.nn.functional, "scaled_dot_product_attention", "sdpa")
    model, _ = load_model()
    ids = torch.randint(0, model.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
    lines = [f"`python scripts/studies/update_cost.py --presets {args.presets} --length {args.length} --steps "
             f"{args.steps} --short {args.short} --threads {args.threads} --out {args.out}` (torch threads: "
             f"{args.threads})", "", f"Whole model (SmolLM2-135M fp32, {args.length}-token context), ms per decode step, "
             "summed over the 30 layers:", "",
             "| round | cache | step | x DynamicCache | cache update | of which dense read-out | rest of the update | SDPA |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for round_ in (1, 2):
        base = None
        for name in names:
            r = whole_model(model, ids, name, args.steps)
            base = base or r["step"]
            readout = r.get("read-out", 0.0)
            lines.append(f"| {round_} | {name} | {r['step']:.1f} | {r['step'] / base:.2f} | {r['update']:.1f} | "
                         f"{readout:.1f} | {r['update'] - readout:.1f} | {r.get('sdpa', 0.0):.1f} |")
            print(lines[-1], flush=True)
    short = [int(t) for t in args.short.split(",")]
    lines += ["", "One layer (3 KV heads x 64), one decode token's `update`, median µs of 300 (the time per call "
              "that does not grow with the context):", "",
              "| cache | " + " | ".join(f"{t} tokens" for t in short) + " |", "|---|" + "---:|" * len(short)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{one_layer(name, t):.0f}" for t in short) + " |")
        print(lines[-1], flush=True)
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
