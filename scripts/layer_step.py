"""One attention layer's decode step in isolation: cache update + attention, per read-out path.

Isolates what the cache adds to a decode step from the model's matmuls (which every scheme shares), with
the best of many repeats so that a busy machine's slow moments drop out. Paths:

- ``dynamic``: transformers' DynamicCache (``torch.cat`` of the whole history) + SDPA;
- ``asymkv-dense``: AsymKVLayer decoding every closed block into dense K/V + SDPA (the default);
- ``asymkv-fused``: AsymKVLayer handing its codes to the fused attention (``attn_implementation="asymkv_sdpa"``);

plus the two decodes alone (K int8 per channel, V int4 per token) to show where the dense path's time goes.

    python scripts/layer_step.py --lengths 1024,4096,16384 --threads 1 --out results/bench/layer_step.md
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig
from transformers.cache_utils import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_asymkv import AsymKVCache
from hf_asymkv.cli.args import int_list as _int_list
from hf_asymkv.core.attention import fused_attention
from hf_asymkv.core.fileio import atomic_write_text
from hf_asymkv.core.quant import dequantize

# SmolLM2-135M's attention shape: 9 query heads sharing 3 KV heads of 64 channels.
Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
REPEATS = 60  # timed calls per path; the minimum is reported
MIN_LENGTH = 256  # the default 128-token window plus one 128-token block


class _Attn(torch.nn.Module):
    num_key_value_groups = Q_HEADS // KV_HEADS
    is_causal = True


def best_ms(fn, repeats: int = REPEATS) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def measure(length: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 1, KV_HEADS, length, HEAD_DIM, generator=g)
    new = torch.randn(1, KV_HEADS, 1, HEAD_DIM, generator=g)
    q = torch.randn(1, Q_HEADS, 1, HEAD_DIM, generator=g)
    scale, module = HEAD_DIM**-0.5, _Attn()
    config = LlamaConfig(hidden_size=Q_HEADS * HEAD_DIM, num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS,
                         num_hidden_layers=1, intermediate_size=64, vocab_size=128)
    dynamic = DynamicCache()
    dynamic.update(k, v, 0)
    layer = AsymKVCache(config).layers[0]
    layer.update(k, v)
    n_quantized = layer.key_store.blocks.length

    def step_dynamic():
        keys, values = dynamic.update(new, new, 0)
        sdpa_attention_forward(module, q, keys, values, None, scaling=scale)
        dynamic.crop(-1)

    def step_asymkv(fused: bool):
        layer.return_views = fused
        keys, values = layer.update(new, new)
        if fused:
            fused_attention(q, keys, values, None, scale)
        else:
            sdpa_attention_forward(module, q, keys, values, None, scaling=scale)
        layer.crop(-1)

    return {
        "dynamic": best_ms(step_dynamic),
        "asymkv-dense": best_ms(lambda: step_asymkv(False)),
        "asymkv-fused": best_ms(lambda: step_asymkv(True)),
        "K decode": best_ms(lambda: _decode(layer.key_store.blocks, n_quantized)),
        "V decode": best_ms(lambda: _decode(layer.value_store.blocks, n_quantized)),
    }


def _decode(blocks, n: int):
    """The blocks' codes to float32 (scale, zero and wide channels; values stay in their rotated space)."""
    codes, scale, zero, wide = blocks.parts(0, n)
    return dequantize(codes, scale, zero, blocks.spec, wide=wide)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=_int_list, default=[1024, 4096, 16384], help="context lengths, e.g. 1024,4096")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="markdown file for the table")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if min(args.lengths) < MIN_LENGTH:
        p.error(f"--lengths must be >= {MIN_LENGTH} (window + one block, so that something is quantized), "
                f"got {min(args.lengths)}")
    torch.set_num_threads(args.threads)
    lengths = ",".join(map(str, args.lengths))
    lines = [f"`python scripts/layer_step.py --lengths {lengths} --threads {args.threads}` "
             f"(one layer, {Q_HEADS} query / {KV_HEADS} KV heads x {HEAD_DIM}, fp32, best of {REPEATS}, ms)", "",
             "| context | DynamicCache + SDPA | ours dense + SDPA | ours fused | dense x Dynamic | fused x Dynamic "
             "| K int8 decode | V int4 decode |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for length in args.lengths:
        r = measure(length)
        lines.append(f"| {length} | {r['dynamic']:.3f} | {r['asymkv-dense']:.3f} | {r['asymkv-fused']:.3f} | "
                     f"{r['asymkv-dense'] / r['dynamic']:.2f} | {r['asymkv-fused'] / r['dynamic']:.2f} | "
                     f"{r['K decode']:.3f} | {r['V decode']:.3f} |")
        print(lines[-1], flush=True)
    if args.out:
        atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
