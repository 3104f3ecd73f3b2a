"""Would a clipped range beat min-max at 2-4 bits? Quantization MSE of SmolLM2's real K/V with each group's range
chosen by a grid search (shrunk about its midpoint by 0.50 ... 1.00, the lowest squared error kept) against the
min-max range every preset uses today: values rotated and per token, keys per channel over 64-token blocks.

Only the encoder would change (same codes, scales and bytes; decoding untouched), so this bounds what such an
encoder buys before building it. The input is this repository's docs/*.md as one text (1024 tokens, natural
English), prefilled with a DynamicCache.

    python scripts/studies/clip_search.py --out results/clip_search/smollm2.md
"""

from __future__ import annotations

import argparse
import pathlib

import torch
from transformers import DynamicCache

from hf_asymkv.core.fileio import atomic_write_text
from hf_asymkv.core.rotation import rotate
from hf_asymkv.models import load_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHRINK = torch.linspace(0.5, 1.0, 26)


def squared_error(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-group squared error of asymmetric ``bits``-bit codes over ``[lo, hi]`` (saturating): ``x`` ``[G, n]``,
    ``lo``/``hi`` ``[G, 1]`` -> ``[G]``."""
    top = 2**bits - 1
    step = ((hi - lo) / top).clamp(min=1e-12)
    codes = ((x - lo) / step).round().clamp(0, top)
    return (codes * step + lo - x).pow(2).sum(-1)


def clip_gain(groups: torch.Tensor, bits: int) -> tuple[float, float]:
    """``(min-max error, searched error)`` summed over ``groups`` ``[G, n]``."""
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    mid = (lo + hi) / 2
    minmax = squared_error(groups, lo, hi, bits)
    best = minmax.clone()
    for c in SHRINK:
        best = torch.minimum(best, squared_error(groups, mid - c * (mid - lo), mid + c * (hi - mid), bits))
    return minmax.sum().item(), best.sum().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--out", required=True, help="markdown file to write")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    rows = []
    for kind, widths in (("values, rotated, per token", (2, 3, 4)), ("keys, per channel, 64-token blocks", (2, 3, 4))):
        for bits in widths:
            total = [0.0, 0.0]
            for layer in cache.layers:
                if kind.startswith("values"):
                    x = rotate(layer.values[0])  # [H, T, D]
                    groups = x.reshape(-1, x.shape[-1])
                else:
                    k = layer.keys[0].float()
                    h, t, d = k.shape
                    t -= t % 64
                    groups = k[:, :t].reshape(h, t // 64, 64, d).transpose(2, 3).reshape(-1, 64)
                for i, e in enumerate(clip_gain(groups, bits)):
                    total[i] += e
            rows.append(f"| {kind} | {bits} | {total[1] / total[0]:.3f} |")
    table = "\n".join(["| tensor | bits | MSE searched / min-max |", "|---|---:|---:|", *rows])
    report = (f"Command: `python scripts/studies/clip_search.py --tokens {args.tokens} --out {args.out}`\n\n"
              f"SmolLM2-135M-Instruct, {ids.shape[1]} tokens of docs/*.md, all 30 layers.\n\n{table}\n")
    atomic_write_text(args.out, report)
    print(report)


if __name__ == "__main__":
    main()
