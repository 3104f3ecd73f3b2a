"""Decode time of stored codes per bit width at one SmolLM2 layer's shape (4096 tokens, 3 KV heads, head_dim 64).

Best of ``--repeats`` calls of ``decode_codes`` (codes -> float32 code values) and ``dequantize`` (scale and zero
applied) per width, for per-token V codes in blocks of ``--block`` tokens. Runs against any checkout of the package
(releases before token packing have no ``block_size`` argument: the script then calls them without it; later
ones carry the block size in ``QuantSpec``), so the before/after of a packing change is one command on each commit.

    OMP_NUM_THREADS=1 python scripts/decode_bench.py --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import time

import torch

from hf_asymkv.core.quant import QuantSpec, compute_scale_zero, decode_codes, dequantize, quantize


def best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--block", type=int, default=128, help="tokens per block (the store's block size)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    for name in ("tokens", "block", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.tokens % args.block:
        p.error(f"--tokens must be a multiple of --block (whole blocks are stored), got {args.tokens} and {args.block}")
    torch.set_num_threads(args.threads)
    x = torch.randn(1, 3, args.tokens, 64, generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(x)
    in_spec = "block_size" in {f.name for f in dataclasses.fields(QuantSpec)}
    has_block = in_spec or "block_size" in inspect.signature(decode_codes).parameters
    print(f"| V bits | decode ms | dequantize ms |  (block {args.block}, token packing API: {has_block})")
    print("|---:|---:|---:|")
    for bits in (2, 3, 4, 5, 6, 8):
        block = {"block_size": args.block} if in_spec else {}
        spec = QuantSpec(f"int{bits}", "token", group_size=64, symmetric=False, **block)
        extra = (args.block,) if has_block and not in_spec else ()  # releases that passed the block beside the spec
        scale, zero = compute_scale_zero(x, spec, *extra)
        codes = quantize(x, scale, zero, spec, *extra)
        dec = best_ms(lambda: decode_codes(codes, spec, *extra, out=out), args.repeats)
        deq = best_ms(lambda: dequantize(codes, scale, zero, spec, *extra, out=out), args.repeats)
        print(f"| {bits} | {dec:.3f} | {deq:.3f} |")


if __name__ == "__main__":
    main()
