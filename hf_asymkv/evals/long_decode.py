"""Damage over a long generation: does a cache's error pile up as it stores its own generated tokens?

For each prompt (a window of natural text, :func:`.ppl.text_windows`), the full-precision model prefills the
prompt once and continues it for ``steps`` tokens twice: by sampling (temperature 1, seeded) and greedily.
End-of-sequence tokens are never chosen (as with ``generate(min_new_tokens=...)``), so every continuation has the
same length. Every scheme then receives that prefill (:func:`.evaluate.cache_from_prefix`) and is
**teacher-forced** along a continuation, one token per forward call, so the cache stores each generated token as
decoding does: it ages out of the exact window into quantized blocks, and later steps attend to it quantized.

- **KL per segment**, along the sampled continuation: ``KL(full || scheme)`` of every step's next-token
  distribution (nats), averaged over :data:`SEGMENT`-step segments. A flat curve means errors do not pile up, a
  rising one that they do. Sampled at temperature 1, not greedy nor cooled: SmolLM2-135M's greedy continuation of
  the built-in corpus falls into a loop within ~200 tokens and its next-token entropy drops ~5x along it (at
  temperature 0.7 still ~3x), so every cache grows confident and later segments' KL shrinks whatever the cache
  does. A sample from the model's own distribution keeps the entropy level (3-4 nats per segment on SmolLM2), so
  a later segment is as hard as an earlier one; it is also how RL rollouts are generated, where low-precision KV
  has been seen to fail.
- **Greedy agreement**, along the greedy continuation: the steps before the scheme's greedy choice first
  differs from full precision's. Up to that step the teacher-forced inputs *are* the tokens the scheme would
  have generated itself, so this is the common prefix of the scheme's own greedy generation and full
  precision's (a test holds it to ``generate``); the run stops at the first difference. The first generated
  token comes from the prefill, which every cache returns exactly, so it is not counted. Each difference comes
  with full precision's own **margin** there: its top-1 minus top-2 log-probability (nats). A margin near 0 is a
  near-tie any perturbation can flip (the cache's damage is then small, whatever the agreement count); a large
  one is a choice the cache really changed.

Why natural text for the prompt: the continuation of a long document depends on its context (names, topics and
code thousands of tokens back), it needs no chat template (base and instruct models alike), and the built-in
corpus (:mod:`.haystack`) is the same offline on every machine. The needle evaluations cover chat retrieval.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..bench.schemes import make_cache, scheme_attention
from ..core.compat import cache_kwargs
from ..models import input_device
from .common import check_length, progress
from .evaluate import cache_from_prefix, eos_ids
from .ppl import text_windows

__all__ = ["SEGMENT", "LongDecodeRow", "check_long_decode_args", "long_decode_markdown", "plot_long_decode", "run_long_decode",
           "segment_means"]

SEGMENT = 64
"""Steps per reported KL segment."""


@dataclass
class LongDecodeRow:
    """One scheme's damage along the continuations (means over prompts)."""

    scheme: str
    segments: list[float]  # mean KL(full || scheme) per SEGMENT-step segment, nats
    agreement: list[int]  # per prompt: greedy steps equal to full precision's before the first different one
    top1: float  # fraction of the sampled continuation's steps whose greedy choice equals full precision's
    steps: int  # teacher-forced steps per prompt
    kl: list[float] = field(default_factory=list)  # per step, mean over prompts
    entropy: list[float] = field(default_factory=list)  # the scheme's next-token entropy per segment, nats
    margins: list[float | None] = field(default_factory=list)  # per prompt: full precision's top-1 - top-2
    # log-probability (nats) at the first difference; None where the scheme agreed all the way

    @property
    def kl_mean(self) -> float:
        return sum(self.kl) / len(self.kl) if self.kl else float("nan")

    @property
    def growth(self) -> float:
        """Last segment's KL / first segment's (1: flat; NaN when the first is 0, e.g. full precision)."""
        first, last = self.segments[0], self.segments[-1]
        return last / first if first > 0 else float("nan")

    @property
    def agreement_mean(self) -> float:
        return sum(self.agreement) / len(self.agreement)


def segment_means(values: list[float], segment: int = SEGMENT) -> list[float]:
    """Means of consecutive ``segment``-long slices of ``values`` (the last one may be shorter)."""
    return [sum(values[i : i + segment]) / len(values[i : i + segment]) for i in range(0, len(values), segment)]


def _margin(logits: torch.Tensor, banned: list[int]) -> float:
    """Top-1 minus top-2 log-probability of ``logits`` (``[vocab]``), the ``banned`` ids left out: nats."""
    logp = logits.float().log_softmax(-1)
    if banned:
        logp = logp.clone()
        logp[banned] = -math.inf
    top = logp.topk(2).values
    return float(top[0] - top[1])


def _choose(logits: torch.Tensor, banned: list[int], generator: torch.Generator | None = None) -> int:
    """The next token from ``logits`` (``[vocab]``), never one of ``banned`` (the end-of-sequence ids): the most
    likely one, or with ``generator`` a sample from the softmax (temperature 1)."""
    if banned:
        logits = logits.clone()
        logits[banned] = -math.inf
    if generator is None:
        return int(logits.argmax())
    return int(torch.multinomial(logits.float().cpu().softmax(-1), 1, generator=generator))


@torch.no_grad()
def _step(model, cache, token: int) -> torch.Tensor:
    """Feed one token through ``cache``: the float32 next-token logits ``[vocab]``."""
    ids = torch.tensor([[token]], device=input_device(model))
    return model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits[0, -1].float()


@torch.no_grad()
def _continuation(model, prefilled, logits: torch.Tensor, steps: int, banned: list[int],
                  generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | list[float]]:
    """Full precision's continuation of a prefill whose last logits are ``logits``: the ``steps + 1`` tokens it
    chooses (greedy, or sampled with ``generator``) and, when sampled, the log-probabilities ``[steps, vocab]``
    (float32) of each step's next token; when greedy, each step's margin (:func:`_margin`, ``steps`` floats)
    instead. Step ``i`` feeds token ``i`` and predicts token ``i + 1``."""
    cache = cache_from_prefix(make_cache("dynamic", model.config), prefilled)  # a copy: prefilled stays the prefix
    tokens, logps, margins = [_choose(logits, banned, generator)], [], []
    for _ in range(steps):
        logits = _step(model, cache, tokens[-1])
        if generator is not None:
            logps.append(logits.log_softmax(-1))
        else:
            margins.append(_margin(logits, banned))
        tokens.append(_choose(logits, banned, generator))
    return tokens, torch.stack(logps) if generator is not None else margins


@torch.no_grad()
def _teacher_force(model, cache, tokens: list[int], ref_logp: torch.Tensor, banned: list[int]):
    """Feed ``tokens[:-1]`` one per call through ``cache``: per step, the KL against ``ref_logp``, whether the
    cache's greedy choice equals full precision's, and the cache's next-token entropy."""
    kl, same, entropy = [], [], []
    for i, token in enumerate(tokens[:-1]):
        logits = _step(model, cache, token)
        logq, logp = logits.log_softmax(-1), ref_logp[i]
        kl.append(max(float((logp.exp() * (logp - logq)).sum()), 0.0))
        same.append(_choose(logits, banned) == _choose(logp, banned))
        entropy.append(float(-(logq.exp() * logq).sum()))
    return kl, same, entropy


@torch.no_grad()
def _greedy_agreement(model, cache, tokens: list[int], banned: list[int]) -> int:
    """Steps of full precision's greedy continuation ``tokens`` the cache reproduces, choosing greedily itself,
    before its first different choice (it stops there)."""
    for i, token in enumerate(tokens[:-1]):
        if _choose(_step(model, cache, token), banned) != tokens[i + 1]:
            return i
    return len(tokens) - 1


def _one_prompt(model, ids: torch.Tensor, schemes: list[str], steps: int, seed: int, show_progress: bool,
                tick: Callable[[str], None] | None = None) -> dict:
    """``{scheme: (kl, same as full, entropy: per step; greedy agreement; full precision's margin at the first
    difference, or None)}`` for one prompt ``[1, T]``."""
    banned = sorted(eos_ids(model))
    prefilled = make_cache("dynamic", model.config)
    with torch.no_grad():
        logits = model(input_ids=ids, **cache_kwargs(prefilled), use_cache=True, logits_to_keep=1).logits[0, -1]
    logits = logits.float()
    sampled, ref_logp = _continuation(model, prefilled, logits, steps, banned, torch.Generator().manual_seed(seed))
    greedy, margins = _continuation(model, prefilled, logits, steps, banned)
    entropy = (-(ref_logp.exp() * ref_logp).sum(-1)).tolist()
    out = {schemes[0]: ([0.0] * steps, [True] * steps, entropy, steps, None)}  # the reference itself
    for name in progress(schemes[1:], desc="long-decode schemes", enabled=show_progress):
        with scheme_attention(model, name):
            forced = _teacher_force(model, cache_from_prefix(make_cache(name, model.config), prefilled), sampled,
                                    ref_logp, banned)
            agreement = _greedy_agreement(model, cache_from_prefix(make_cache(name, model.config), prefilled),
                                          greedy, banned)
        out[name] = (*forced, agreement, margins[agreement] if agreement < steps else None)
        if tick:
            tick(f"long decode, {name} ({len(out)}/{len(schemes)})")
    return out


def check_long_decode_args(model, tokenizer, schemes: list[str], text: str, prompt_length: int, steps: int,
                           prompts: int = 1, segment: int = SEGMENT) -> list[torch.Tensor]:
    """The prompts (``[1, prompt_length]`` token windows) of :func:`run_long_decode`, after checking its arguments
    (so that a caller can fail before other work runs).

    Raises:
        ValueError: see :func:`run_long_decode`.
    """
    for name, value in (("--prompt-length", prompt_length), ("--steps", steps), ("--prompts", prompts),
                        ("--segment", segment)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    check_length(model, prompt_length + steps, "--prompt-length + --steps")
    if schemes[0] != "dynamic":
        raise ValueError(f"the first scheme must be 'dynamic' (the reference), got {schemes[0]!r}")
    return text_windows(tokenizer, text, prompt_length, prompts)


def run_long_decode(model, tokenizer, schemes: list[str], text: str, prompt_length: int = 2048, steps: int = 512,
                    prompts: int = 1, segment: int = SEGMENT, seed: int = 0,
                    show_progress: bool = True, tick: Callable[[str], None] | None = None) -> list[LongDecodeRow]:
    """Per-segment KL and greedy agreement of every scheme along full precision's own continuations.

    Args:
        schemes: scheme names, ``dynamic`` first (the reference).
        text: natural text the prompts are cut from (``prompts`` windows at evenly spaced offsets, BOS first).
        prompt_length: prompt tokens, prefilled in full precision and handed to every scheme.
        steps: generated tokens teacher-forced through each cache, one per call.
        prompts: number of prompts; KL is averaged over them, agreement kept per prompt.
        segment: steps per KL segment.
        seed: sampling seed of the first prompt's continuation (prompt ``i`` uses ``seed + i``).
        tick: called after each (prompt, scheme) with where the run is (:class:`.common.Heartbeat`).

    Raises:
        ValueError: ``prompt_length + steps`` over the model's position limit, a non-positive count, too short a
            text, or a first scheme that is not ``dynamic``.
    """
    windows = check_long_decode_args(model, tokenizer, schemes, text, prompt_length, steps, prompts, segment)
    per_prompt = []
    for i, ids in enumerate(progress(windows, total=prompts, desc="long-decode prompts", enabled=show_progress)):
        per_prompt.append(_one_prompt(model, ids.to(input_device(model)), schemes, steps, seed + i, show_progress,
                                      tick))
    rows = []
    for name in schemes:
        kl, same, entropy, agreement, margin = ([p[name][part] for p in per_prompt] for part in range(5))
        kl_mean = [sum(values) / prompts for values in zip(*kl)]
        entropy_mean = [sum(values) / prompts for values in zip(*entropy)]
        same_all = [s for flags in same for s in flags]
        rows.append(LongDecodeRow(name, segment_means(kl_mean, segment), agreement, sum(same_all) / len(same_all),
                                  steps, kl_mean, segment_means(entropy_mean, segment), margin))
    return rows


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2e}"


def long_decode_markdown(rows: list[LongDecodeRow], segment: int = SEGMENT, skipped: dict[str, str] | None = None
                         ) -> str:
    """Two tables: KL per segment (with last/first) under full precision's entropy per segment (how hard each
    segment is), and greedy agreement and top-1 agreement per scheme (``rows[0]``: the reference)."""
    n = len(rows[0].segments)
    starts = [f"{i * segment}-{min((i + 1) * segment, rows[0].steps) - 1}" for i in range(n)]
    head = "| scheme | " + " | ".join(starts) + " | last / first |"
    lines = [head, "|---|" + "---:|" * (n + 1)]
    for r in rows:
        growth = "-" if math.isnan(r.growth) else f"{r.growth:.2f}"
        lines.append(f"| {r.scheme} | " + " | ".join(_fmt(x) for x in r.segments) + f" | {growth} |")
    agree = ["| scheme | greedy agreement per prompt (of {}) | full precision's margin there (nats) | mean | "
             "top-1 = full, all steps | mean KL |".format(rows[0].steps), "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        margins = ", ".join("-" if m is None else f"{m:.3f}" for m in r.margins) if r.margins else "-"
        agree.append(f"| {r.scheme} | {', '.join(map(str, r.agreement))} | {margins} | {r.agreement_mean:.1f} | "
                     f"{100 * r.top1:.1f}% | {_fmt(r.kl_mean)} |")
    title = f"Long decode: KL(full || scheme) of each step's next token, mean per {segment}-step segment (nats)"
    entropy = ", ".join(f"{e:.2f}" for e in rows[0].entropy)
    text = title + "\n\n" + "\n".join(lines) + f"\n\nFull precision's next-token entropy per segment (nats): " \
        f"{entropy}\n\nGreedy agreement: steps before the first token that differs from full precision, and full " \
        f"precision's top-1 minus top-2 log-probability at that step (near 0: a near-tie)\n\n" \
        + "\n".join(agree)
    if skipped:
        text += "\n\nNot run on this model: " + "; ".join(f"`{s}` ({why})" for s, why in skipped.items())
    return text


def plot_long_decode(rows: list[LongDecodeRow], title: str, path, segment: int = SEGMENT):
    """Per-segment KL (log y) against generated tokens, one line per scheme (the reference left out)."""
    from ..plots import require_matplotlib, save_figure

    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        if r.scheme == "dynamic":
            continue
        mids = [i * segment + segment / 2 for i in range(len(r.segments))]
        ax.plot(mids, [max(x, 1e-9) for x in r.segments], marker=".",
                label=f"{r.scheme} (greedy agreement {r.agreement_mean:.0f})")
    ax.set_yscale("log")
    ax.set_xlabel(f"generated tokens (segments of {segment})")
    ax.set_ylabel("KL(full || scheme) of the next token, nats")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)
