"""The range search of ``clip_search.py`` inside our caches, measured where it counts: ``hf-asymkv eval`` run with
the asymmetric encoder (``compute_scale_zero`` as the stores call it) patched for this process only, so that each
group's range is the lowest-error shrink of its min-max range (0.50 ... 1.00 about the midpoint).

    python scripts/studies/clip_search_eval.py --tensors keys,values -- eval attention --stress-outliers qwen \\
        --length 2048 --samples 2 --schemes asymkv-compact,asymkv-tight,asymkv-max --threads 1 --quiet \\
        --out results/clip_search/stress_keys_values

``--tensors values`` searches the per-token (value) groups only and keeps the keys' min-max ranges.
"""

from __future__ import annotations

import argparse
import sys

import torch

import hf_asymkv.core.store as store
from hf_asymkv.cli import main as cli_main
from hf_asymkv.core import quant
from hf_asymkv.core.rounding import round_down, round_up

SHRINK = torch.linspace(0.5, 1.0, 26).tolist()
_min_max = quant.compute_scale_zero


def searched_scale_zero(x: torch.Tensor, spec: quant.QuantSpec, kinds: set[str]) -> tuple:
    """:func:`~hf_asymkv.core.quant.compute_scale_zero` with the searched range for asymmetric integer groups of the
    chosen kinds (``"keys"``: per-channel blocks, ``"values"``: per token); other specs keep min-max."""
    kind = "values" if spec.granularity == "token" else "keys"
    if spec.symmetric or spec.is_float or spec.granularity == "tensor" or kind not in kinds:
        return _min_max(x, spec)
    tg, cg = spec.groups(x.shape[-1])
    g = quant._grouped(torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0), tg, cg)
    lo, hi = g.amin(dim=(3, 5), keepdim=True), g.amax(dim=(3, 5), keepdim=True)
    mid = (lo + hi) / 2
    tiny = torch.finfo(spec.scale_dtype).tiny
    best = best_lo = best_hi = None
    for c in SHRINK:
        low, high = mid - c * (mid - lo), mid + c * (hi - mid)
        step = ((high - low) / spec.qmax).clamp(min=tiny)
        codes = ((g - low) / step).round().clamp(0, spec.qmax)
        err = (codes * step + low - g).pow(2).sum(dim=(3, 5), keepdim=True)
        if best is None:
            best, best_lo, best_hi = err, low, high
            continue
        better = err < best
        best = torch.where(better, err, best)
        best_lo, best_hi = torch.where(better, low, best_lo), torch.where(better, high, best_hi)
    zero = round_down(best_lo, spec.scale_dtype)
    scale = round_up(((best_hi - zero.float()) / spec.qmax).clamp(min=tiny), spec.scale_dtype)
    return scale[:, :, :, 0, :, 0], zero[:, :, :, 0, :, 0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", default="keys,values", help="comma-separated: keys, values")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then an hf-asymkv command line")
    args = parser.parse_args()
    kinds = set(args.tensors.split(","))
    if not kinds <= {"keys", "values"}:
        parser.error(f"--tensors takes keys and/or values, got {args.tensors!r}")
    store.compute_scale_zero = lambda x, spec: searched_scale_zero(x, spec, kinds)
    return cli_main([a for a in args.command if a != "--"] if args.command[:1] == ["--"] else args.command)


if __name__ == "__main__":
    sys.exit(main())
