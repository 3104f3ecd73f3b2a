"""One layer's cache update at SmolLM2's attention shape, for the static cache eager and compiled (inductor) beside
the dynamic caches: what the static layer's read-out and flush cost per step, without the model around it.

Best and median of ``--steps`` single-token updates after a ``--length``-token prefill (the first 5 dropped); the
whole-model ``hf-asymkv bench`` swings with the machine, the minimum here much less.

    python scripts/studies/static_layer_step.py --preset balanced --length 4096 --steps 120 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache, LlamaConfig

from hf_asymkv import AsymKVCache

# SmolLM2-135M's attention shape: 9 query heads sharing 3 KV heads of 64 channels.
CONFIG = LlamaConfig(num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3, hidden_size=576, head_dim=64)


def time_updates(cache, prefill: tuple[torch.Tensor, torch.Tensor], steps: int, compiled: bool) -> tuple[float, float]:
    """(best, median) ms of one single-token ``update`` of layer 0 after the prefill."""
    cache.update(*prefill, 0)
    update = torch.compile(cache.update, fullgraph=True, dynamic=False) if compiled else cache.update
    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        k, v = (torch.randn(1, 3, 1, 64, generator=g) for _ in range(2))
        start = time.perf_counter()
        update(k, v, 0)
        times.append(time.perf_counter() - start)
    times = sorted(times[5:])
    return times[0] * 1e3, times[len(times) // 2] * 1e3


def setup(doc: str, steps: int) -> tuple[argparse.Namespace, tuple[torch.Tensor, torch.Tensor], int]:
    """The command line of a one-layer study (``--preset``, ``--length``, ``--steps``, ``--threads``, threads set):
    ``(args, (keys, values) of the prefill [1, 3, length, 64], max_cache_len for the prefill and every step)``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--preset", default="balanced")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    prefill = tuple(torch.randn(1, 3, args.length, 64, generator=g) for _ in range(2))
    return args, prefill, args.length + args.steps + 1


def main() -> None:
    args, prefill, room = setup(__doc__, steps=120)
    rows = [("DynamicCache", lambda: DynamicCache(config=CONFIG), False),
            (f"{args.preset}, dynamic", lambda: AsymKVCache.from_preset(args.preset, CONFIG), False),
            (f"{args.preset}, static, eager", lambda: AsymKVCache.from_preset(args.preset, CONFIG, max_cache_len=room),
             False),
            (f"{args.preset}, static, compiled", lambda: AsymKVCache.from_preset(args.preset, CONFIG,
                                                                                 max_cache_len=room), True)]
    print(f"one layer's update, {args.length}-token prefill, {args.threads} thread(s), {args.steps} steps")
    print("| cache | best ms | median ms |\n|---|---:|---:|")
    for name, build, compiled in rows:
        best, median = time_updates(build(), prefill, args.steps, compiled)
        print(f"| {name} | {best:.3f} | {median:.3f} |")


if __name__ == "__main__":
    main()
