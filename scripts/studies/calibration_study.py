"""Do short calibration samples under-estimate long-context key ranges, and what do calibrated scales buy?

1. Calibrate the model three times on the same text, packed into 512-, 2048- and 8192-token samples, and
   compare the per-channel K ranges (and the position-bucket report of the long run).
2. Long needle prompts (about ``LENGTH`` tokens), prefilled once in full precision, then continued (tail +
   greedy answer) with: per-block dynamic K scales (the default), long-calibrated scales, short-calibrated
   scales with the default ``widen`` policy, and short-calibrated scales with ``clip``. Reported per scheme:
   KL(full || quantized) and top-1 agreement of the tail logits, retrieval, and the overflow counters.

Usage:
    python scripts/studies/calibration_study.py                      # the embedded SmolLM2-135M-Instruct
    python scripts/studies/calibration_study.py --out results/calibration
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

# ----------------------------------------------------------------------------- defaults
MODEL = "smollm2-135m-instruct"  # hf_asymkv.models.DEFAULT_MODEL, an HF folder/id or a .gguf path
DATA = "/usr/share/common-licenses"  # natural English text present on Debian machines (~65k tokens)
CALIBRATIONS = {"512": (512, 16), "2k": (2048, 4), "8k": (8192, 2)}  # name -> (seq_len, num_samples)
LENGTH = 7000  # needle-prompt document length (SmolLM2 was trained to 8192 positions)
DEPTHS = [0.25, 0.75]  # needle depths, one prompt each
TAIL = 32  # prompt tokens fed after the quantized prefix (their logits are compared)
MAX_NEW = 24  # greedy answer tokens
OUT = "results/calibration"  # JSON + README.md
THREADS = 2


def calibrate_all(model, tokenizer, data: str) -> dict:
    from hf_asymkv.calibration.calibrate import bucket_report, calibrate_model, scales_from_stats
    from hf_asymkv.calibration.data import load_texts, pack_samples

    texts = load_texts(data)
    out = {}
    for name, (seq_len, n) in CALIBRATIONS.items():
        t0 = time.time()
        samples = pack_samples(texts, tokenizer, seq_len, n)
        stats = calibrate_model(model, samples, chunk_size=2048, progress=False)
        scales = scales_from_stats(stats, model.config, metadata={"data": data, "seq_len": seq_len})
        out[name] = {"scales": scales, "report": bucket_report(stats), "seconds": time.time() - t0}
        print(f"calibrated {name}: {n} x {seq_len} tokens in {out[name]['seconds']:.0f}s", flush=True)
    return out


def compare_ranges(short, long) -> dict:
    """Per layer: how much the long calibration's per-channel K range exceeds the short one's."""
    rows = []
    for i in sorted(long.k_channel_absmax):
        ratio = long.k_channel_absmax[i] / short.k_channel_absmax[i]
        rows.append({"layer": i, "max_ratio": float(ratio.max()), "mean_ratio": float(ratio.mean()),
                     "share_over_10pct": float((ratio > 1.1).float().mean()),
                     "layer_absmax_short": float(short.k_channel_absmax[i].max()),
                     "layer_absmax_long": float(long.k_channel_absmax[i].max())})
    return {"layers": rows, "share_over_10pct_mean": sum(r["share_over_10pct"] for r in rows) / len(rows),
            "max_ratio": max(r["max_ratio"] for r in rows)}


@torch.no_grad()
def continue_schemes(model, tokenizer, cals: dict) -> list[dict]:
    from transformers import DynamicCache

    from hf_asymkv import AsymKVCache, cache_kwargs
    from hf_asymkv.evals.evaluate import cache_from_prefix, compare_continuation, encode_prompt, tail_and_decode
    from hf_asymkv.evals.tasks import make_needle_prompt, score_answer

    schemes = {
        "dynamic per-block scales": lambda: AsymKVCache(model.config),
        "calibrated 8k, widen": lambda: AsymKVCache(model.config, scales=cals["8k"]["scales"]),
        "calibrated 512, widen": lambda: AsymKVCache(model.config, scales=cals["512"]["scales"]),
        "calibrated 512, clip": lambda: AsymKVCache(model.config, scales=cals["512"]["scales"],
                                                    overflow_policy="clip"),
    }
    rows = []
    for seed, depth in enumerate(DEPTHS):
        t0 = time.time()
        prompt = make_needle_prompt(tokenizer, LENGTH, depth, seed=seed)
        ids = encode_prompt(tokenizer, prompt)
        head, tail = ids[:, :-TAIL], ids[:, -TAIL:]
        dyn = DynamicCache(config=model.config)
        model(input_ids=head, **cache_kwargs(dyn), use_cache=True, logits_to_keep=1)
        caches = {name: cache_from_prefix(make(), dyn) for name, make in schemes.items()}
        ref_logits, ref_tokens = tail_and_decode(model, dyn, tail, MAX_NEW)
        del dyn
        ref_answer = tokenizer.decode(ref_tokens, skip_special_tokens=True).strip()
        row = {"prompt_tokens": ids.shape[1], "depth": depth, "expected": prompt.answer,
               "full precision": {"answer": ref_answer, "correct": score_answer(ref_answer, prompt.answer)}}
        for name, cache in caches.items():
            row[name] = compare_continuation(model, tokenizer, cache, tail, ref_logits, ref_tokens, prompt.answer,
                                             MAX_NEW) | {"stats": cache.stats()}
        row["seconds"] = time.time() - t0
        rows.append(row)
        print(f"prompt {ids.shape[1]} tokens depth {depth}: " + "; ".join(
            f"{n} KL {row[n]['kl_mean']:.2e} {row[n]['answer'][:40]!r}" for n in schemes), flush=True)
    return rows


def render(data: dict) -> str:
    cmp_ = data["ranges_512_vs_8k"]
    lines = ["# Calibration: short vs long samples, calibrated vs per-block dynamic K scales\n",
             f"Generated by `{data['meta']['command']}` ({data['meta']['seconds']:.0f} s, {THREADS} CPU threads). "
             f"Model {data['meta']['model']}; calibration text `{data['meta']['data']}`.\n",
             "## Do short samples under-estimate long-context key ranges?\n",
             "| calibration | samples x tokens | largest K range (max over layers) |", "|---|---|---:|"]
    for name, (seq_len, n) in CALIBRATIONS.items():
        lines.append(f"| {name} | {n} x {seq_len} | {data['largest_k'][name]:.2f} |")
    lines += ["", f"Per-channel K range of the 8k calibration over the 512 one: on average "
              f"{cmp_['share_over_10pct_mean']:.1%} of (head, channel) pairs per layer are more than 10% wider "
              f"with 8k samples; the widest channel is x{cmp_['max_ratio']:.2f}.\n",
              "| layer | K absmax 512 | K absmax 8k | channels >10% wider at 8k | widest channel ratio |",
              "|---:|---:|---:|---:|---:|"]
    for r in cmp_["layers"]:
        lines.append(f"| {r['layer']} | {r['layer_absmax_short']:.2f} | {r['layer_absmax_long']:.2f} | "
                     f"{r['share_over_10pct']:.1%} | {r['max_ratio']:.2f} |")
    rep = data["report_8k"]
    warned = {w.split(":")[0] for w in rep["warnings"]}  # one warning per (layer, bucket)
    lines += ["", f"Position buckets of the 8k calibration: {len(warned)} of {len(rep['layers'])} layers have K "
              "channels whose range beyond position 512 exceeds their range within it by >10%. Part of this is "
              "simply more tokens seen (a maximum over more samples grows); the 512-token calibration above saw "
              "as many tokens in total (16 x 512 = 8192) and still misses ranges that the long samples reach.\n",
              "## Calibrated vs per-block dynamic K scales on long prompts\n",
              "| scheme | mean KL(full‖quant) | max KL | top-1 | retrieval | K overflow (block, head, channel) | "
              "clipped key values |", "|---|---:|---:|---:|---:|---:|---:|"]
    rows, n = data["continuation"], len(data["continuation"])
    names = [k for k in rows[0] if isinstance(rows[0][k], dict) and "kl_mean" in rows[0][k]]
    for name in names:
        kl = sum(r[name]["kl_mean"] for r in rows) / n
        lines.append(f"| {name} | {kl:.3e} | {max(r[name]['kl_max'] for r in rows):.3e} | "
                     f"{sum(r[name]['top1'] for r in rows) / n:.1%} | {sum(r[name]['correct'] for r in rows)}/{n} | "
                     f"{sum(r[name]['stats']['key_overflow_channels'] for r in rows):,} | "
                     f"{sum(r[name]['stats']['key_clipped_values'] for r in rows):,} |")
    lines.append(f"| full precision | 0 | 0 | 100% | {sum(r['full precision']['correct'] for r in rows)}/{n} | - | - |")
    lines += ["", "Answers:", ""] + [
        f"- {r['prompt_tokens']} tokens, depth {r['depth']}, expected {r['expected']}: "
        + "; ".join(f"{k}: {r[k]['answer']!r}" for k in ["full precision", *names]) for r in rows]
    return "\n".join(lines) + "\n"


def rerender(out: Path) -> None:
    """Rewrite README.md from an existing study.json (no model run)."""
    from hf_asymkv.core.fileio import atomic_write_text

    atomic_write_text(out / "README.md", render(json.loads((out / "study.json").read_text())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--render-only", action="store_true", help="rewrite README.md from OUT/study.json")
    args = ap.parse_args()
    if args.render_only:
        return rerender(Path(args.out))
    torch.set_num_threads(args.threads)
    from hf_asymkv.core.fileio import atomic_write_text
    from hf_asymkv.models import load_model

    t0 = time.time()
    model, tokenizer = load_model(args.model)
    cals = calibrate_all(model, tokenizer, args.data)
    out = Path(args.out)
    for name, cal in cals.items():
        cal["scales"].save(out / f"kv_scales_{name}.safetensors")
    continuation = continue_schemes(model, tokenizer, cals)
    data = {
        "meta": {"model": args.model, "data": args.data, "seconds": time.time() - t0,
                 "command": " ".join(["python scripts/studies/calibration_study.py", *sys.argv[1:]])},
        "largest_k": {n: max(float(k.max()) for k in c["scales"].k_channel_absmax.values()) for n, c in cals.items()},
        "ranges_512_vs_8k": compare_ranges(cals["512"]["scales"], cals["8k"]["scales"]),
        "ranges_2k_vs_8k": compare_ranges(cals["2k"]["scales"], cals["8k"]["scales"]),
        "report_8k": cals["8k"]["report"],
        "continuation": continuation,
    }
    atomic_write_text(out / "study.json", json.dumps(data, indent=2))
    atomic_write_text(out / "README.md", render(data))
    print(render(data))


if __name__ == "__main__":
    main()
