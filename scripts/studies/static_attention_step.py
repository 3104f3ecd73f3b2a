"""One layer's decode step (cache update + attention) at SmolLM2's attention shape: transformers' caches with SDPA
beside the static cache read densely (SDPA) and through the attention over its codes (``asymkv_sdpa``), eager and
compiled (inductor). What the layer costs per token without the model around it.

Best and median of ``--steps`` single-token steps after a ``--length``-token prefill (the first 5 dropped); the
whole-model ``hf-asymkv bench`` swings with the machine, the minimum here much less.

    python scripts/studies/static_attention_step.py --preset balanced --length 4096 --steps 200 --threads 1
"""

from __future__ import annotations

import copy
import time

import torch
from static_layer_step import CONFIG, setup  # this folder's: SmolLM2's attention shape, the command line
from torch.nn.functional import scaled_dot_product_attention
from transformers import DynamicCache, StaticCache

from hf_asymkv import AsymKVCache, register_attention
from hf_asymkv.core.attention import ATTN_IMPLEMENTATION, asymkv_sdpa_attention

SCALING = 64**-0.5


class _Module(torch.nn.Module):  # what transformers' SDPA reads of an attention module
    num_key_value_groups = 3
    is_causal = True


def _dense_step(cache, q, k, v, mask):
    keys, values = cache.update(k, v, 0)
    return scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=SCALING, enable_gqa=True)


def _fused_step(cache, q, k, v, mask):
    keys, values = cache.update(k, v, 0)
    return asymkv_sdpa_attention(_Module(), q, keys, values, mask, scaling=SCALING)[0]


def time_steps(cache, step, prefill, steps: int, compiled: bool, static: bool) -> tuple[float, float]:
    """(best, median) ms of one single-token update + attention of layer 0 after the prefill."""
    cache.update(*prefill, 0)
    run = torch.compile(step, fullgraph=True, dynamic=False) if compiled else step
    g = torch.Generator().manual_seed(1)
    length = prefill[0].shape[2]
    room = cache.layers[0].max_cache_len if static else 0
    times = []
    for i in range(steps):
        q = torch.randn(1, 9, 1, 64, generator=g)
        k, v = (torch.randn(1, 3, 1, 64, generator=g) for _ in range(2))
        mask = None
        if static:  # transformers' mask for a static cache: the filled positions, this token's included
            mask = (torch.arange(room) <= length + i)[None, None, None]
        start = time.perf_counter()
        run(cache, q, k, v, mask)
        times.append(time.perf_counter() - start)
    times = sorted(times[5:])
    return times[0] * 1e3, times[len(times) // 2] * 1e3


def main() -> None:
    args, prefill, room = setup(__doc__, steps=200)

    register_attention()
    fused_config = copy.deepcopy(CONFIG)
    fused_config._attn_implementation = ATTN_IMPLEMENTATION  # the cache then hands the attention its codes

    def ours(fused: bool):
        return lambda: AsymKVCache.from_preset(args.preset, fused_config if fused else CONFIG, max_cache_len=room)

    rows = [("DynamicCache + SDPA, eager", lambda: DynamicCache(config=CONFIG), _dense_step, False, False),
            ("StaticCache + SDPA, compiled", lambda: StaticCache(config=CONFIG, max_cache_len=room), _dense_step, True,
             True),
            (f"{args.preset}, dynamic + SDPA, eager", lambda: AsymKVCache.from_preset(args.preset, CONFIG),
             _dense_step, False, False),
            (f"{args.preset}, static + SDPA, compiled", ours(False), _dense_step, True, True),
            (f"{args.preset}, static + attention over codes, eager", ours(True), _fused_step, False, True),
            (f"{args.preset}, static + attention over codes, compiled", ours(True), _fused_step, True, True)]
    print(f"one layer's update + attention, {args.length}-token prefill, {args.threads} thread(s), {args.steps} steps")
    print("| cache | best ms | median ms |\n|---|---:|---:|")
    for name, build, step, compiled, static in rows:
        best, median = time_steps(build(), step, prefill, args.steps, compiled, static)
        print(f"| {name} | {best:.3f} | {median:.3f} |", flush=True)


if __name__ == "__main__":
    main()
