"""How many wide key channels `compact` can afford: attention KL on the stress and the plain model against bytes.

`compact`'s keys with ``key_wide_fraction`` (a fifth bit for each 64-token block's widest channels, as built in
``hf_asymkv.core.wide``) cost bytes that issue 22 says must stay inside `compact`'s budget (>= 3.5x smaller than a
bf16 DynamicCache). This measures candidates that pay for them elsewhere (a shorter exact window, longer key blocks,
fewer wide channels) beside `compact` as it was before them, on the same prompts (the window of 32 is what
`compact` now uses):

- attention KL as ``hf-asymkv eval attention --length 2048 --samples 2`` measures it, on the stress model
  (``--stress-outliers qwen``) and on the plain model;
- bytes at 4096 tokens two ways: ``memory_footprint()["total"]`` after a prefill (what the README's presets table
  quotes) and what the frontier and the protection ablation count (``scheme_nbytes``: a prefill and one decode step,
  growth capacity included), both against a bf16 DynamicCache.

    python scripts/studies/wide_channels.py --out results/key_channel_bits/wide_channels.md

``--base tight`` measures the same question at issue 22's >= 5x target instead: `tight` (int3 keys, 2-bit values)
with wide channels, paid for with 128-token key blocks (``results/key_channel_bits/wide_channels_tight.md``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_asymkv.evals.stress import stress_description
from hf_asymkv.models import load_model

sys.path.insert(0, str(Path(__file__).parent))
from key_channel_bits import (  # noqa: E402
    bytes_and_attention,
    bytes_and_attention_note,
    register_candidates,
    stress_study_args,
    write_report,
)

TOKENS = 4096
# label -> settings over compact's
CANDIDATES = {
    "compact before (no wide channels, window 64)": dict(key_wide_fraction=0.0, residual_length=64),
    "1/4 wide (16 of 64), window 64": dict(key_wide_fraction=0.25, residual_length=64),
    "1/8 wide (8 of 64), window 64": dict(key_wide_fraction=0.125, residual_length=64),
    "**1/4 wide, window 32 (compact now)**": dict(key_wide_fraction=0.25, residual_length=32),
    "1/4 wide, window 48": dict(key_wide_fraction=0.25, residual_length=48),
    "1/8 wide, window 32": dict(key_wide_fraction=0.125, residual_length=32),
    "no wide channels, window 32": dict(key_wide_fraction=0.0, residual_length=32),
    "1/4 wide, 128-token key blocks, window 64": dict(key_wide_fraction=0.25, key_block_size=128, residual_length=64),
}

# label -> settings over tight's (int3 keys in 64-token blocks, 2-bit rotated values, window 32)
TIGHT_CANDIDATES = {
    "tight as it is": {},
    "1/4 wide": dict(key_wide_fraction=0.25),
    "1/4 wide, 128-token key blocks": dict(key_wide_fraction=0.25, key_block_size=128),
    "1/8 wide, 128-token key blocks": dict(key_wide_fraction=0.125, key_block_size=128),
    "no wide channels, 128-token key blocks": dict(key_block_size=128),
}
BASES = {"compact": CANDIDATES, "tight": TIGHT_CANDIDATES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", choices=sorted(BASES), default="compact", help="the preset the candidates change")
    args = stress_study_args(ap)
    names = register_candidates(args.base, BASES[args.base])
    model, tok = load_model()
    footprint, counted, plain, stressed = bytes_and_attention(model, tok, list(names), [], args, TOKENS)
    base = "" if args.base == "compact" else f" --base {args.base}"
    lines = [f"`python scripts/studies/wide_channels.py{base} --stress {args.stress} --length {args.length} --samples "
             f"{args.samples} --threads {args.threads} --out {args.out}`", "",
             stress_description(args.stress), "",
             bytes_and_attention_note(args, TOKENS) + f". Every row is `{args.base}` with the settings named.", "",
             f"| keys / settings over {args.base} | x smaller (footprint) | x smaller (frontier) | attention KL, stress | "
             "attention KL, plain |", "|---|---:|---:|---:|---:|"]
    for name, label in names.items():
        lines.append(f"| {label} | {footprint[name]:.3f} | {counted[name]:.3f} | {stressed[name]:.3g} | "
                     f"{plain[name]:.3g} |")
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
