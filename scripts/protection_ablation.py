"""Protection ablation: what per-layer widths chosen by measurement buy, in attention KL per byte.

For each budget (the bits a preset spends: ``compact``, ``tight``, ``max``), widths are allocated per layer
(:func:`hf_asymkv.calibration.allocate.allocate`) from two sensitivities measured on the same calibration window
(the first 2048 tokens of the built-in text, not the evaluation's prompts):

- ``cal``: calibrated, :func:`~hf_asymkv.calibration.sensitivity.layer_sensitivity` (attention KL per layer and
  width; ``--sensitivity LABEL=PATH``, as ``hf-asymkv calibrate`` writes it; the scheme is named by the label);
- ``cal-keys``: the same, keys only (values keep the preset's width);
- ``auto``: from the prefill alone, :func:`~hf_asymkv.calibration.sensitivity.prefill_sensitivity` (relative
  key/value error per layer and width: what a cache could measure at its first flush; keys only, as a
  relative error is no KL and cannot be traded between keys and values).

Every allocated config keeps its preset's window and sinks. The presets, the allocations and transformers' fp8
cache are then measured as ``eval attention --length 2048 --samples 2`` measures them
(:func:`hf_asymkv.evals.attention.run_attention`, 32 queries; ``ablation.{json,md}``), bytes as the frontier counts
them at 4096 tokens; with ``--needle SCHEMES`` instead, the named schemes on the stress frontier's 12-prompt needle
grid (``needle.{json,md}``). An allocation's bits budget is lowered
until its bytes are no more than its preset's (pending partial blocks stay exact, which the bits leave out).

Usage (SmolLM2 + the qwen outlier pattern, the stress case of ``docs/stress.md``)::

    python scripts/protection_ablation.py --stress-outliers qwen \\
        --sensitivity cal=results/protection/smollm2_qwen/sensitivity.json \\
        --sensitivity needle=results/protection/smollm2_qwen/sensitivity_needle.json \\
        --out results/protection/smollm2_qwen
    python scripts/protection_ablation.py ... --needle asymkv-compact,compact+needle,asymkv-max,max+needle,hf-fp8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from hf_asymkv.bench.schemes import SCHEMES
from hf_asymkv.calibration.allocate import allocate, allocation_overrides, check_sensitivity, preset_bits
from hf_asymkv.calibration.sensitivity import prefill_sensitivity
from hf_asymkv.core.cache import AsymKVCache
from hf_asymkv.core.compat import cache_kwargs
from hf_asymkv.core.fileio import atomic_write_text
from hf_asymkv.core.presets import PRESETS
from hf_asymkv.evals.attention import run_attention
from hf_asymkv.evals.frontier import scheme_nbytes
from hf_asymkv.evals.haystack import load_text
from hf_asymkv.evals.ppl import text_windows
from hf_asymkv.evals.report import flips
from hf_asymkv.evals.retrieval import run_needle
from hf_asymkv.evals.stress import stress_model
from hf_asymkv.models import load_model

BUDGETS = ("compact", "tight", "max")
TOKENS = 4096  # bytes counted as the stress frontier counts them (its longest needle prompt)


def fitted(model, sensitivity: dict, base: str, head_dim: int) -> dict:
    """The allocation at ``base``'s bits, the budget lowered in 1/64-bit steps until the bytes as stored (pending
    partial blocks stay exact, so longer blocks cost more than their scale bytes) are no more than ``base``'s."""
    budget = preset_bits(PRESETS[base], head_dim)
    limit = scheme_nbytes(f"asymkv-{base}", model.config, TOKENS)
    while True:
        widths = allocate(sensitivity, budget, head_dim)
        config = PRESETS[base].replace(layer_overrides=allocation_overrides(widths))
        register({"probe": ("", config)})
        if scheme_nbytes("probe", model.config, TOKENS) <= limit:
            del SCHEMES["probe"]
            return widths
        budget -= 1 / 64


def allocated_configs(model, tokenizer, calibrated: dict[str, dict]) -> dict[str, tuple[str, object]]:
    """``{scheme name: (description, AsymKVConfig)}`` for every budget and sensitivity source (``calibrated``:
    label -> :func:`layer_sensitivity` dict)."""
    ids = text_windows(tokenizer, load_text(None)[0], 2048, 1)[0]
    prefilled = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(prefilled), use_cache=True, logits_to_keep=1)
    auto = prefill_sensitivity(prefilled, next(iter(calibrated.values()))["layers"])
    head_dim = model.config.head_dim
    out = {}
    for base in BUDGETS:
        # auto: a relative error is no KL, so keys and values cannot be traded on it; keys are allocated,
        # values keep the preset's width
        value = f"v{PRESETS[base].value_bits}"
        sources = {"auto": {**auto, "values": {value: auto["values"][value]}}}
        for label, sensitivity in calibrated.items():
            sources[label] = sensitivity
            sources[f"{label}-keys"] = {**sensitivity, "values": {value: sensitivity["values"][value]}}
        for source, sensitivity in sources.items():
            widths = fitted(model, sensitivity, base, head_dim)
            out[f"{base}+{source}"] = (f"{base}'s bytes, widths allocated by {source} sensitivity: {widths}",
                                       PRESETS[base].replace(layer_overrides=allocation_overrides(widths)))
    return out


def register(configs: dict) -> None:
    for name, (description, config) in configs.items():
        SCHEMES[name] = (description, lambda model_config, c=config: AsymKVCache(model_config, c))


def table(rows: list[dict], fp8_kl: float) -> str:
    lines = ["| scheme | x smaller than bf16 | attention KL | vs hf-fp8 |", "|---|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: r["x_smaller"]):
        lines.append(f"| {r['scheme']} | {r['x_smaller']:.2f} | {r['kl']:.3g} | {r['kl'] / fp8_kl:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stress-outliers", default="qwen")
    p.add_argument("--sensitivity", required=True, action="append", metavar="LABEL=PATH",
                   help="a labelled JSON from layer_sensitivity (hf-asymkv calibrate); repeat to compare sources")
    p.add_argument("--needle", default="", help="instead of the attention KL: comma-separated schemes (presets, "
                   "peers or the allocations' names) to run the 12-prompt needle grid on")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    calibrated = {}
    for item in args.sensitivity:
        label, _, path = item.partition("=")
        calibrated[label] = json.loads(Path(path).read_text(encoding="utf-8"))
        check_sensitivity(calibrated[label])
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    stress_model(model, tokenizer, args.stress_outliers)
    configs = allocated_configs(model, tokenizer, calibrated)
    register(configs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python scripts/protection_ablation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.needle:
        print(needle(model, tokenizer, ["dynamic", *args.needle.split(",")], out, command))
        return 0
    schemes = ["dynamic", "hf-fp8", *(f"asymkv-{b}" for b in BUDGETS), *configs]
    start = time.perf_counter()
    attention = {r.scheme: r.kl_mean for r in run_attention(model, tokenizer, schemes, 2048, samples=2, queries=32,
                                                            seed=0, show_progress=False)}
    dynamic = scheme_nbytes("dynamic", model.config, TOKENS)
    rows = [{"scheme": name, "x_smaller": dynamic / scheme_nbytes(name, model.config, TOKENS), "kl": attention[name],
             "description": (configs.get(name) or SCHEMES[name])[0]} for name in schemes[1:]]
    atomic_write_text(out / "ablation.json", json.dumps({"command": command, "seconds": time.perf_counter() - start,
                                                         "rows": rows}, indent=1))
    text = f"Command: `{command}`\n\n" + table(rows, attention["hf-fp8"])
    atomic_write_text(out / "ablation.md", text + "\n")
    print(text)
    return 0


def needle(model, tokenizer, schemes: list[str], out: Path, command: str) -> str:
    """Needle prompts lost against full precision on the stress frontier's 12-prompt grid, into needle.{json,md}."""
    rows = run_needle(model, tokenizer, schemes, [2048, 4096], [0.25, 0.5, 0.75], ["single", "multikey"],
                      show_progress=False)
    flipped = flips([asdict(r) for r in rows])
    atomic_write_text(out / "needle.json", json.dumps({"command": command, "rows": [asdict(r) for r in rows]},
                                                      indent=1))
    text = (f"Command: `{command}`\n\n| scheme | needle prompts lost / gained (of 12) |\n|---|---:|\n"
            + "\n".join(f"| {name} | {flipped[name][0]} / {flipped[name][1]} |" for name in schemes[1:]))
    atomic_write_text(out / "needle.md", text + "\n")
    return text


if __name__ == "__main__":
    sys.exit(main())
