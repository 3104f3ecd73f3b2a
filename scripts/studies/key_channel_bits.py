"""Would spending key bits unevenly across channels buy issue 22's KL targets? A simulation, not a format.

Per-channel keys give every channel of a head the same width. A logit's error is ``sum_c q_c e_c``, so a channel
whose queries are large, or whose blocks span a wide range, costs more than the others at the same width. This
study gives the ``n_hi`` channels of each (layer, KV head) with the largest ``E[q_c^2] * E[range_c^2]`` (queries
over a calibration text, ranges over its 64-token blocks) ``hi`` bits and the others ``lo`` bits, and compares the
attention KL with uniform widths at the same code bits per element, and with the same widths on channels drawn at
random (what the choice of channels buys, apart from mixing two widths), and chosen by the keys' block ranges alone
(``E[range_c^2]``, what a cache could do without any calibration).

What is simulated: keys are rounded per channel in ``--block``-token blocks (asymmetric min-max, float16 scale
and zero, the last partial block exact), exactly what the stores do for int2/int3/int4 keys; the scale bytes are
the same for every scheme here and left out of the bits column. Each layer is measured alone: its own last
``--queries`` queries against its exact keys and against its rounded keys (the other layers exact), so unlike
``hf-asymkv eval attention`` the damage is not carried into later layers. The ratios between schemes are the point.

    python scripts/studies/key_channel_bits.py --stress qwen --out results/key_channel_bits/stress_qwen.md

Llama-like attention modules only (``q_proj``/``k_proj``, rotary ``position_embeddings``), e.g. the default model.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hf_asymkv.core.fileio import atomic_write_text, output_problem
from hf_asymkv.evals.attention import attention_stats
from hf_asymkv.evals.evaluate import encode_prompt
from hf_asymkv.evals.haystack import load_text
from hf_asymkv.evals.needle import make_task
from hf_asymkv.evals.ppl import text_windows
from hf_asymkv.evals.stress import forward_with_hooks, stress_description, stress_model
from hf_asymkv.models import load_model

# (channels at the high width, high width, low width)
MIXES = [(8, 8, 2), (24, 4, 2), (16, 6, 2), (12, 8, 2), (8, 6, 3), (16, 5, 3), (32, 4, 3)]


def capture_qk(model, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(q [Hq, T, D], k [Hk, T, D])`` after rotary embedding, from one forward pass over ``ids``."""
    found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(attn, args, kwargs):
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        shape = (1, h.shape[1], -1, attn.head_dim)
        q = attn.q_proj(h).view(shape).transpose(1, 2)
        k = attn.k_proj(h).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        found[attn.layer_idx] = (q[0], k[0])

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    forward_with_hooks(model, ids, handles)
    return found


def round_keys(k: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """``k [H, T, D]`` rounded per channel in ``block``-token blocks (asymmetric, float16 scale and zero); the last
    partial block stays exact, as the window does."""
    h, t, d = k.shape
    n = t // block * block
    g = k[:, :n].reshape(h, n // block, block, d)
    lo = g.amin(2, keepdim=True).half().float()
    step = ((g.amax(2, keepdim=True) - lo) / (2**bits - 1)).clamp_min(1e-8).half().float()
    out = k.clone()
    out[:, :n] = (((g - lo) / step).round().clamp(0, 2**bits - 1) * step + lo).reshape(h, n, d)
    return out


def channel_weights(q: torch.Tensor, k: torch.Tensor, block: int) -> torch.Tensor:
    """``[Hk, D]``: mean ``q_c^2`` over the KV head's query heads and tokens, times the mean squared block range."""
    hk, t, d = k.shape
    q2 = q.pow(2).mean(1).view(hk, -1, d).mean(1)
    n = t // block * block
    g = k[:, :n].reshape(hk, -1, block, d)
    return q2 * (g.amax(2) - g.amin(2)).pow(2).mean(1)


def mixed_keys(k: torch.Tensor, weights: torch.Tensor, n_hi: int, hi: int, lo: int, block: int) -> torch.Tensor:
    top = weights.topk(n_hi, dim=-1).indices
    high = torch.zeros_like(weights, dtype=torch.bool).scatter_(1, top, True)[:, None, :]
    return torch.where(high, round_keys(k, hi, block), round_keys(k, lo, block))


def attention(q: torch.Tensor, k: torch.Tensor, queries: int) -> torch.Tensor:
    """``[Hq, queries, T]`` causal attention probabilities of the last ``queries`` queries."""
    kk = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
    t = k.shape[1]
    scores = q[:, -queries:] @ kk.transpose(1, 2) / math.sqrt(q.shape[-1])
    future = torch.arange(t)[None, :] > torch.arange(t - queries, t)[:, None]
    return scores.masked_fill(future, float("-inf")).softmax(-1)


def kl(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Mean KL(ref || approx) of ``[heads, q, keys]`` probabilities, as ``hf-asymkv eval attention`` computes it."""
    return attention_stats(ref, approx, ks=())["kl"]


def stress_study_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """:func:`study_args` with the stress studies' common options: ``--stress``, ``--length``, ``--samples``."""
    ap.add_argument("--stress", default="qwen", help="--stress-outliers spec, or 'none' for the model as it is")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=2)
    return study_args(ap)


def register_candidates(base: str, candidates: dict[str, dict]) -> dict[str, str]:
    """Register each candidate (settings over preset ``base``) as a bench scheme ``study-N``: ``{name: label}``."""
    from hf_asymkv import PRESETS, AsymKVCache
    from hf_asymkv.bench import schemes

    names = {}
    for label, settings in candidates.items():
        config = PRESETS[base].replace(**settings)
        name = f"study-{len(names)}"
        schemes.SCHEMES[name] = (label, lambda cfg, c=config: AsymKVCache(cfg, c))
        names[name] = label
    return names


def bytes_and_attention(model, tokenizer, names: list[str], peers: list[str], args: argparse.Namespace,
                        tokens: int = 4096) -> tuple[dict, dict, dict, dict]:
    """``(footprint, counted, plain, stressed)``, each ``{scheme: figure}``: x smaller than a bf16 DynamicCache at
    ``tokens`` tokens as the README counts (``memory_footprint()``, ours only) and as the frontier counts
    (``scheme_nbytes``, peers too), and the attention KL of ``eval attention --length --samples`` on the plain
    model, then on the stress model (``args.stress``). The model is left stressed."""
    from hf_asymkv.evals.attention import run_attention
    from hf_asymkv.evals.frontier import scheme_nbytes
    from hf_asymkv.evals.presets_table import measure_bytes

    footprint = measure_bytes(model, names, tokens)
    dynamic = scheme_nbytes("dynamic", model.config, tokens)
    counted = {name: dynamic / scheme_nbytes(name, model.config, tokens) for name in [*peers, *names]}

    def kl() -> dict:
        return {r.scheme: r.kl_mean for r in run_attention(model, tokenizer, ["dynamic", *peers, *names], args.length,
                                                             args.samples, show_progress=False)}

    plain = kl()
    stress_model(model, tokenizer, args.stress)
    return footprint, counted, plain, kl()


def bytes_and_attention_note(args: argparse.Namespace, tokens: int = 4096) -> str:
    """What :func:`bytes_and_attention` measured, for a report (one sentence, no closing punctuation)."""
    return (f"Attention KL as `hf-asymkv eval attention --length {args.length} --samples {args.samples}` measures it "
            f"(stress: `--stress-outliers {args.stress}`); x smaller than a bf16 DynamicCache at {tokens} tokens, "
            "as the README's presets table counts (`memory_footprint()`) and as the frontier counts "
            "(`scheme_nbytes`: growth capacity included)")


def model_label(stress: str) -> str:
    """A report's line naming the model: the stress case's description, or the plain default model (``none``)."""
    return stress_description(stress) if stress != "none" else "SmolLM2-135M-Instruct as it is"


def write_report(out: Path, lines: list[str]) -> None:
    """Write the report's lines to ``out`` (atomically) and print them."""
    atomic_write_text(out, "\n".join(lines) + "\n")
    print("\n".join(lines))


def study_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """Add ``--threads`` and ``--out`` to a study's own options and parse: ``--out`` is checked before minutes of
    work, and torch gets ``--threads`` threads."""
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if problem := output_problem(args.out, "file"):
        ap.error(f"--out: {problem}")
    torch.set_num_threads(args.threads)
    return args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--block", type=int, default=64)
    args = stress_study_args(ap)
    model, tok = load_model()
    if args.stress != "none":
        stress_model(model, tok, args.stress)
    prompts = [encode_prompt(tok, make_task(tok, "multikey", args.length, round((i + 0.5) / args.samples, 3), i,
                                            "noise")) for i in range(args.samples)]
    sources = {"natural text": capture_qk(model, text_windows(tok, load_text(None)[0], args.length, 1)[0]),
               "needle prompt (seed 7)": capture_qk(model, encode_prompt(
                   tok, make_task(tok, "multikey", args.length, 0.4, 7, "noise")))}
    rows: dict[tuple[str, float, str], list[float]] = {}
    for ids in prompts:
        here = capture_qk(model, ids)
        for layer, (q, k) in sorted(here.items()):
            ref = attention(q, k, args.queries)

            def add(name: str, bits: float, source: str, keys: torch.Tensor) -> None:
                rows.setdefault((name, bits, source), []).append(kl(ref, attention(q, keys, args.queries)))

            for bits in (2, 3, 4):
                add(f"uniform int{bits}", bits, "", round_keys(k, bits, args.block))
            for n_hi, hi, lo in MIXES:
                bits = (n_hi * hi + (k.shape[-1] - n_hi) * lo) / k.shape[-1]
                calibrations = {**sources, "the prompt itself (oracle)": here}
                for source, cal in [*calibrations.items(), ("keys' own block ranges (no queries)", "keys"),
                                    ("random (control)", None)]:
                    if cal is None:  # the same widths on channels drawn at random: what the choice itself buys
                        w = torch.rand(k.shape[0], k.shape[-1], generator=torch.Generator().manual_seed(layer))
                    elif cal == "keys":  # what a cache sees by itself: E[range_c^2] of the keys it stores
                        w = channel_weights(torch.ones_like(k), k, args.block)
                    else:
                        w = channel_weights(*cal[layer], args.block)
                    add(f"{n_hi} ch x int{hi} + rest int{lo}", bits, source,
                        mixed_keys(k, w, n_hi, hi, lo, args.block))
    uniform = {bits: sum(v) / len(v) for (name, bits, _), v in rows.items() if name.startswith("uniform")}

    def at_bits(bits: float) -> float:  # uniform widths' KL, log-linear between the measured widths
        lo = max(b for b in uniform if b <= bits)
        hi = min(b for b in uniform if b >= bits)
        if lo == hi:
            return uniform[lo]
        f = (bits - lo) / (hi - lo)
        return math.exp((1 - f) * math.log(uniform[lo]) + f * math.log(uniform[hi]))

    label = model_label(args.stress)
    lines = [f"`python scripts/studies/key_channel_bits.py --stress {args.stress} --length {args.length} --samples "
             f"{args.samples} --queries {args.queries} --block {args.block} --out {args.out}`", "", label, "",
             f"Attention KL of each layer's last {args.queries} queries with that layer's keys rounded ({args.block}-token "
             f"blocks, per channel), mean over {len(prompts)} multikey prompts x {len(next(iter(rows.values()))) // len(prompts)} "
             "layers; 'uniform at these bits' is log-linear between the uniform widths.", "",
             "| keys | code bits / element | channel choice from | mean KL | worst layer | uniform at these bits | "
             "x uniform |", "|---|---:|---|---:|---:|---:|---:|"]
    for (name, bits, source), v in rows.items():
        mean = sum(v) / len(v)
        ref = at_bits(bits)
        lines.append(f"| {name} | {bits:.3g} | {source or '-'} | {mean:.3g} | {max(v):.3g} | {ref:.3g} | "
                     f"{mean / ref:.2f} |")
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
