"""One layer's decode step (cache update + SDPA, the dense read-out) per preset at SmolLM2's attention shape.

The whole-model ``hf-asymkv bench`` on a shared 2-core machine swings by 2x within minutes; this isolates what
the cache adds to a step with the best of many interleaved repeats, so that slow moments drop out (like
``scripts/layer_step.py``, for the presets).

    python scripts/presets_layer_step.py --lengths 4096 --repeats 100 --out results/presets/layer_step.md
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig
from transformers.cache_utils import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_asymkv import PRESETS, AsymKVCache
from hf_asymkv.cli.args import int_list
from hf_asymkv.core.config import LEGACY_DEFAULTS
from hf_asymkv.core.fileio import atomic_write_text

# SmolLM2-135M's attention shape: 9 query heads sharing 3 KV heads of 64 channels.
Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


class _Attn(torch.nn.Module):
    num_key_value_groups = Q_HEADS // KV_HEADS
    is_causal = True


def _caches(config) -> dict:
    makers = {"dynamic": lambda: DynamicCache(config=config),
              "asymkv 0.1 default": lambda: AsymKVCache(config, **LEGACY_DEFAULTS)}
    for name in PRESETS:
        makers[name] = lambda n=name: AsymKVCache.from_preset(n, config)
        makers[f"{name}, V unrotated"] = lambda n=name: AsymKVCache.from_preset(n, config, value_rotation=False)
    return makers


def measure(length: int, repeats: int) -> dict[str, float]:
    """Best-of-``repeats`` milliseconds of one decode step's update + attention, per cache, interleaved."""
    config = LlamaConfig(hidden_size=Q_HEADS * HEAD_DIM, num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, num_hidden_layers=1, intermediate_size=64, vocab_size=64)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=g) for _ in range(2))
    caches = {}
    for name, make in _caches(config).items():
        caches[name] = make()
        caches[name].update(k, v, 0)
    q = torch.randn(1, Q_HEADS, 1, HEAD_DIM, generator=g)
    best = dict.fromkeys(caches, float("inf"))
    for _ in range(repeats):
        for name, cache in caches.items():
            token = torch.randn(1, KV_HEADS, 1, HEAD_DIM, generator=g)
            start = time.perf_counter()
            keys, values = cache.update(token, token, 0)
            sdpa_attention_forward(_Attn(), q, keys, values, None, scaling=HEAD_DIM**-0.5)
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: t * 1e3 for name, t in best.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int_list, default=[4096])
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="markdown file for the table")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lines = ["| cache | context | ms per layer step (best) | x DynamicCache |", "|---|---:|---:|---:|"]
    for length in args.lengths:
        ms = measure(length, args.repeats)
        lines += [f"| {name} | {length} | {t:.3f} | {t / ms['dynamic']:.2f} |" for name, t in ms.items()]
    table = "\n".join(lines)
    print(table)
    if args.out:
        command = f"python scripts/presets_layer_step.py --lengths {','.join(map(str, args.lengths))} " \
                  f"--repeats {args.repeats} --threads {args.threads} --out {args.out}"
        atomic_write_text(args.out, f"`{command}`\n\n{table}\n")


if __name__ == "__main__":
    main()
