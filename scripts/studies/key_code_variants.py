"""Could a cheaper key code reach int4 quality? Two known variants of per-channel keys, one layer at a time.

Issue 22's >= 5x target needs keys of int4 quality in fewer than int4's bits (``docs/protection.md``). This measures
two variants from the literature against plain per-channel rounding (asymmetric min-max in 64-token blocks, float16
scale and zero, the last partial block exact, as ``key_channel_bits.round_keys`` does), on the attention KL of each
layer's last 32 queries with only that layer's keys rounded (``key_channel_bits.py``'s measure):

- **pre-RoPE**: the keys are rounded before the rotary embedding and rotated afterwards (KVQuant, Hooper et al.
  2024, section 3.2): a channel's values before the rotation do not swing with position, so blocks span less;
- **sparse outliers**: in each (channel, block) the ``n`` elements farthest from the block's median are kept exact
  and the rest rounded over their own, narrower range (KVQuant's dense-and-sparse split, done per block); each kept
  element costs a float16 value and a 6-bit token index, ``n x 22 / 64`` bits per key element.

    python scripts/studies/key_code_variants.py --out results/key_code_variants/stress_qwen.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hf_asymkv.evals.evaluate import encode_prompt
from hf_asymkv.evals.needle import make_task
from hf_asymkv.evals.stress import forward_with_hooks, stress_model
from hf_asymkv.models import load_model

sys.path.insert(0, str(Path(__file__).parent))
from key_channel_bits import attention, kl, model_label, round_keys, stress_study_args, write_report  # noqa: E402

BLOCK = 64
OUTLIERS = (1, 2, 4)


def capture_pre_rope(model, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, ...]]:
    """Per layer ``(q, k, cos, sin)``: queries and keys ``[1, H, T, D]`` *before* the rotary embedding."""
    found: dict[int, tuple[torch.Tensor, ...]] = {}

    def hook(attn, args, kwargs):
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        shape = (1, h.shape[1], -1, attn.head_dim)
        found[attn.layer_idx] = (attn.q_proj(h).view(shape).transpose(1, 2),
                                 attn.k_proj(h).view(shape).transpose(1, 2), cos, sin)

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    forward_with_hooks(model, ids, handles)
    return found


def round_sparse(k: torch.Tensor, bits: int, block: int, exact: int) -> torch.Tensor:
    """``k [H, T, D]`` rounded as :func:`round_keys` does, but the ``exact`` elements of each (channel, block)
    farthest from its median are kept exact (as float16) and left out of the block's range."""
    h, t, d = k.shape
    n = t // block * block
    g = k[:, :n].reshape(h, n // block, block, d)
    median = g.median(2, keepdim=True).values
    kept = torch.zeros_like(g, dtype=torch.bool).scatter_(2, (g - median).abs().topk(exact, dim=2).indices, True)
    inner = torch.where(kept, median, g)
    lo = inner.amin(2, keepdim=True).half().float()
    step = ((inner.amax(2, keepdim=True) - lo) / (2**bits - 1)).clamp_min(1e-8).half().float()
    rounded = ((g - lo) / step).round().clamp(0, 2**bits - 1) * step + lo
    out = k.clone()
    out[:, :n] = torch.where(kept, g.half().float(), rounded).reshape(h, n, d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queries", type=int, default=32)
    args = stress_study_args(ap)
    model, tok = load_model()
    if args.stress != "none":
        stress_model(model, tok, args.stress)
    rows: dict[tuple[str, int, float], list[float]] = {}
    for i in range(args.samples):
        ids = encode_prompt(tok, make_task(tok, "multikey", args.length, round((i + 0.5) / args.samples, 3), i, "noise"))
        for q, k, cos, sin in capture_pre_rope(model, ids).values():
            q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
            ref = attention(q_rot[0], k_rot[0], args.queries)

            def add(name: str, bits: int, extra: float, keys: torch.Tensor, pre: bool = False) -> None:
                if pre:  # rounded before the rotary embedding: rotate the rounded keys now
                    keys = apply_rotary_pos_emb(q, keys[None], cos, sin)[1][0]
                rows.setdefault((name, bits, extra), []).append(kl(ref, attention(q_rot[0], keys, args.queries)))

            for bits in (3, 4):
                add("per channel (as stored today)", bits, 0.0, round_keys(k_rot[0], bits, BLOCK))
                add("pre-RoPE", bits, 0.0, round_keys(k[0], bits, BLOCK), pre=True)
                for n in OUTLIERS:
                    add(f"{n} exact per channel and block", bits, n * 22 / BLOCK, round_sparse(k_rot[0], bits, BLOCK, n))
                    add(f"pre-RoPE, {n} exact per channel and block", bits, n * 22 / BLOCK,
                        round_sparse(k[0], bits, BLOCK, n), pre=True)
    base = {bits: sum(v) / len(v) for (name, bits, _), v in rows.items() if name.startswith("per channel")}
    label = model_label(args.stress)
    lines = [f"`python scripts/studies/key_code_variants.py --stress {args.stress} --length {args.length} --samples "
             f"{args.samples} --queries {args.queries} --threads {args.threads} --out {args.out}`", "", label, "",
             f"Attention KL of each layer's last {args.queries} queries with that layer's keys rounded ({BLOCK}-token "
             f"blocks, per channel, asymmetric), mean over {args.samples} multikey prompts x every layer; bits per key "
             "element beyond the codes and scales of plain rounding in the 'extra bits' column.", "",
             "| keys | code bits | extra bits | mean KL | worst layer | x plain at these code bits |",
             "|---|---:|---:|---:|---:|---:|"]
    for (name, bits, extra), v in rows.items():
        mean = sum(v) / len(v)
        lines.append(f"| {name} | {bits} | {extra:.2f} | {mean:.3g} | {max(v):.3g} | {mean / base[bits]:.2f} |")
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
