"""What each stage of one layer's dense read-out costs, per preset, at one context length (issue 20, item 6).

One SmolLM2-shaped layer (3 KV heads x 64 channels) is filled with random keys and values through the preset's own
cache; then, for each stored tensor, the read-out's stages are timed alone (best of ``--repeats`` calls): unpacking
the packed codes, the wide key channels' high bits (their table lookup, then their fold into the codes), the codes to
floats, the whole dequantize, and for rotated values the integer-path read-out that rotates back. Stages nest, so the
cost of one is the difference to the stage before it. They run the torch read-out (``HF_ASYMKV_CPU_READOUT=torch``);
the last row of each tensor is the native read-out (:mod:`hf_asymkv.kernels.cpu_readout`), one pass that writes the
same bits as the whole torch read-out above it.

    python scripts/studies/readout_stages.py --presets balanced,compact --length 4096 --threads 2 \
        --out results/bench/readout_stages.md
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig

from hf_asymkv import AsymKVCache
from hf_asymkv.core.fileio import atomic_write_text
from hf_asymkv.core.packing import unpack_codes
from hf_asymkv.core.quant import decode_codes, dequantize
from hf_asymkv.core.rotation import dequantize_rotated
from hf_asymkv.core.wide import add_wide_codes, high_bits
from hf_asymkv.kernels import cpu_readout

sys.path.insert(0, str(Path(__file__).parents[1]))
from layer_step import HEAD_DIM, KV_HEADS, Q_HEADS, best_ms  # noqa: E402  (SmolLM2's attention shape)


def best_us(fn, repeats: int) -> float:
    return best_ms(fn, repeats) * 1e3


def stages(preset: str, length: int, repeats: int) -> list[tuple[str, str, float]]:
    """``(tensor, stage, µs)`` rows for one preset."""
    config = LlamaConfig(hidden_size=Q_HEADS * HEAD_DIM, num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS,
                         num_hidden_layers=1, intermediate_size=64, vocab_size=128)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 1, KV_HEADS, length, HEAD_DIM, generator=g)
    layer = AsymKVCache.from_preset(preset, config).layers[0]
    layer.update(k, v)
    layer.settle()  # a held prefill is quantized at the next read; do it now
    rows = []
    for name, store in (("K", layer.key_store), ("V", layer.value_store)):
        blocks = store.blocks
        codes, scale, zero, wide = blocks.parts(0, blocks.length)
        spec = blocks.spec
        label = f"{name} {spec.fmt}{' rotated' if spec.rotated else ''}{' wide' if wide is not None else ''}"
        rows.append((label, "unpack codes", best_us(lambda: unpack_codes(codes), repeats)))
        if wide is not None:
            ints = unpack_codes(codes)
            rows.append((label, "wide: high bits (table lookup)", best_us(lambda: high_bits(wide), repeats)))
            rows.append((label, "wide: copy of the codes", best_us(lambda: ints.clone(), repeats)))
            rows.append((label, "wide: copy + high bits + fold", best_us(lambda: add_wide_codes(ints.clone(), wide, spec),
                                                                          repeats)))
        rows.append((label, "codes to float32 (decode_codes)",
                     best_us(lambda: decode_codes(codes, spec, wide=wide), repeats)))
        rows.append((label, "dequantize (+ scale, zero)",
                     best_us(lambda: dequantize(codes, scale, zero, spec, wide=wide), repeats)))
        if spec.rotated:
            rows.append((label, "dequantize rotated back (the read-out)",
                         best_us(lambda: dequantize_rotated(codes, scale, zero, spec), repeats)))
        os.environ[cpu_readout.ENV_VAR] = "native"  # the same call as the torch read-out's last row above
        read_out = (lambda: dequantize_rotated(codes, scale, zero, spec)) if spec.rotated else (
            lambda: dequantize(codes, scale, zero, spec, wide=wide))
        rows.append((label, "**native read-out (one pass, the same bits)**", best_us(read_out, repeats)))
        os.environ[cpu_readout.ENV_VAR] = "torch"
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="balanced,compact")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--out", default=None, help="markdown file for the table")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ[cpu_readout.ENV_VAR] = "torch"  # the stages are the torch read-out's; the native row sets its own
    lines = [f"`python scripts/studies/readout_stages.py --presets {args.presets} --length {args.length} "
             f"--threads {args.threads} --repeats {args.repeats}` (one layer, {KV_HEADS} KV heads x {HEAD_DIM}, "
             f"fp32, best of {args.repeats} calls, µs; stages nest)", "",
             "| preset | tensor | stage | µs |", "|---|---|---|---:|"]
    for preset in args.presets.split(","):
        for tensor, stage, us in stages(preset, args.length, args.repeats):
            lines.append(f"| {preset} | {tensor} | {stage} | {us:.0f} |")
            print(lines[-1], flush=True)
    if args.out:
        atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
