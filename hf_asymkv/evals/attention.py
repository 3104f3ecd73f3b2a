"""Per-layer attention damage: how far each scheme moves the last queries' attention over the cache.

For each prompt (a multi-key retrieval prompt of ``length`` tokens), the prompt minus its last ``queries``
tokens is prefilled once with ``DynamicCache``; each scheme gets that prefix (as a real prefill would leave
it) and the last ``queries`` tokens are fed with eager attention and ``output_attentions``. Per layer we
compare the scheme's attention probabilities ``[heads, queries, keys]`` with the full-precision ones:

- ``kl``: KL(full || scheme) in nats over the keys, averaged over heads and queries;
- ``top{k}``: ``|top-k(full) ∩ top-k(scheme)| / k`` over the keys, averaged likewise (k = 8, 32).

Layer errors compound: layer ``l`` sees inputs that earlier quantized layers already changed, so the curve
is the damage a deployment sees, not the damage of one layer in isolation. An induction score per layer
(attention from the second copy of a repeated random sequence to the token after its first occurrence,
best head) marks where induction-style heads sit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..bench.schemes import ATTENTION, make_cache
from ..core.compat import cache_kwargs
from ..models import input_device
from .common import check_length, progress
from .evaluate import cache_from_prefix, encode_prompt, sliding_margin, widen_sliding
from .haystack import split_sentences
from .needle import make_task
from .prefill import SHARED_PREFILL_CHUNK, prefill

__all__ = ["TOPK", "AttentionRow", "attention_stats", "eager_attention", "induction_scores", "run_attention"]

TOPK = (8, 32)


@dataclass
class AttentionRow:
    """One scheme's per-layer damage, averaged over prompts."""

    scheme: str
    kl: list[float]
    topk: dict[str, list[float]] = field(default_factory=dict)  # "8" -> per-layer overlap

    @property
    def kl_mean(self) -> float:
        return sum(self.kl) / len(self.kl)


@contextmanager
def eager_attention(model) -> Iterator:
    """Switch ``model`` to eager attention (the path that returns probabilities) and always switch back."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


@torch.no_grad()
def _attentions(model, cache, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer ``[heads, q, keys]`` attention probabilities of ``ids`` (``[1, q]``) fed after ``cache``."""
    with eager_attention(model):
        out = model(input_ids=ids, **cache_kwargs(cache), use_cache=cache is not None, output_attentions=True,
                    logits_to_keep=1)
    return [a[0].float() for a in out.attentions]


def attention_stats(ref: torch.Tensor, probs: torch.Tensor, ks: tuple[int, ...] = TOPK) -> dict[str, float]:
    """KL(ref || probs) and top-k overlaps of two ``[heads, q, keys]`` probability tensors, averaged.

    Returns:
        ``{"kl": nats, "8": overlap in [0, 1], "32": ...}`` (``k`` capped at the number of keys).
    """
    p, q = ref.double(), probs.double()
    kl = (torch.xlogy(p, p) - torch.xlogy(p, q.clamp_min(1e-300))).sum(-1)
    stats = {"kl": float(kl.clamp_min(0).mean())}
    for k in ks:
        kk = min(k, ref.shape[-1])
        a, b = ref.topk(kk, dim=-1).indices, probs.topk(kk, dim=-1).indices
        shared = (a[..., :, None] == b[..., None, :]).any(-1).sum(-1).double()
        stats[str(k)] = float((shared / kk).mean())
    return stats


@torch.no_grad()
def induction_scores(model, n: int = 128, seed: int = 0, prefix_ids: list[int] | None = None) -> list[float]:
    """Per layer, the best head's mean attention from token ``t`` of a repeated random sequence to ``t - n + 1``.

    An induction head, seeing a token for the second time, attends to what followed it the first time:
    score 1.0 is a perfect induction head, ~1/t a uniform one.
    """
    vocab = model.config.get_text_config(decoder=True).vocab_size
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(vocab // 10, vocab, (1, n), generator=g)
    prefix = torch.tensor([prefix_ids or []], dtype=torch.long)
    ids = torch.cat([prefix, seq, seq], dim=1).to(input_device(model))
    start = prefix.shape[1]
    queries = torch.arange(start + n, start + 2 * n)
    scores = []
    for a in _attentions(model, None, ids):  # [heads, T, T]
        hits = a[:, queries, queries - n + 1]  # [heads, n]
        scores.append(float(hits.mean(-1).max()))
    return scores


def _aligned(p: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``p`` ``[..., keys]`` over the keys of ``ref`` ``[..., keys_ref]``: a quantized sliding-window layer holds
    older keys than transformers' (whole blocks), first in its key order and masked out (weight 0): they are cut."""
    extra = p.shape[-1] - ref.shape[-1]
    if extra <= 0:
        return p
    if float(p[..., :extra].abs().max()) != 0.0:
        raise RuntimeError(f"{extra} keys beyond the reference's window got attention weight: the layer's mask is wrong")
    return p[..., extra:]


def _one_prompt(model, ids: torch.Tensor, schemes: list[str], queries: int,
                tick: Callable[[str], None] | None = None, shared_chunk: int | None = None) -> dict[str, list[dict]]:
    """Per scheme, per layer stats of one prompt (``schemes[0]`` is the reference); ``tick`` after each scheme; the
    shared prefill runs in forwards of ``shared_chunk`` tokens (:mod:`.prefill`)."""
    margin = sliding_margin(make_cache(name, model.config) for name in schemes if name not in ATTENTION)
    prefilled = widen_sliding(make_cache("dynamic", model.config), margin)  # (a quantized sliding layer needs a block more)
    prefill(model, ids[:, :-queries], prefilled, shared_chunk)
    ref, out = None, {}
    for name in schemes:
        probs = _attentions(model, cache_from_prefix(make_cache(name, model.config), prefilled), ids[:, -queries:])
        ref = probs if ref is None else ref
        out[name] = [attention_stats(r, _aligned(p, r)) for r, p in zip(ref, probs)]
        if tick:
            tick(f"{name} ({len(out)}/{len(schemes)})")
    return out


def run_attention(model, tokenizer, schemes: list[str], length: int, samples: int = 2, queries: int = 32,
                  haystack: str = "noise", text: str | None = None, seed: int = 0,
                  show_progress: bool = True, tick: Callable[[str], None] | None = None,
                  shared_chunk: int | None = SHARED_PREFILL_CHUNK) -> list[AttentionRow]:
    """Per-layer KL and top-k overlap of every scheme against ``schemes[0]`` (``dynamic``), over ``samples``
    multi-key retrieval prompts of ``length`` tokens with the target at depths spread over the document;
    ``tick`` is called after each (prompt, scheme) with where the run is (:class:`.common.Heartbeat`); the
    full-precision prefill the schemes share runs in forwards of ``shared_chunk`` tokens (None: one forward).

    Raises:
        ValueError: length beyond the model's limit, samples < 1, queries outside [1, length / 2].
    """
    check_length(model, length, "--length")
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    if not 1 <= queries <= length // 2:
        raise ValueError(f"--queries must be in [1, {length // 2}], got {queries}")
    if schemes[0] != "dynamic":
        raise ValueError(f"the first scheme must be 'dynamic' (the reference), got {schemes[0]!r}")
    if fused := [s for s in schemes if s in ATTENTION]:
        raise ValueError(f"schemes {fused} run their own attention kernel, which returns no probabilities; "
                         "measure the same cache through its eager scheme (e.g. asymkv)")
    sentences = split_sentences(text) if text is not None else None
    sums: dict[str, list[dict]] = {}
    for i in progress(range(samples), total=samples, desc="attention prompts", enabled=show_progress):
        depth = (i + 0.5) / samples
        task = make_task(tokenizer, "multikey", length, round(depth, 3), seed + i, haystack, sentences)
        step = (lambda where, i=i: tick(f"attention prompt {i + 1}/{samples}, {where}")) if tick else None
        stats = _one_prompt(model, encode_prompt(tokenizer, task).to(input_device(model)), schemes, queries, step,
                            shared_chunk)
        for name, layers in stats.items():
            acc = sums.setdefault(name, [dict.fromkeys(s, 0.0) for s in layers])
            for a, s in zip(acc, layers):
                for key, value in s.items():
                    a[key] += value / samples
    return [AttentionRow(name, [s["kl"] for s in layers], {str(k): [s[str(k)] for s in layers] for k in TOPK})
            for name, layers in sums.items()]
