"""Perplexity on long natural text, each token scored against its scheme's quantized history.

A window of ``length`` tokens is cut from the text; its first ``prefix`` tokens are prefilled once with
``DynamicCache`` and handed to each scheme as a real prefill would leave them; the rest is then fed in
chunks of ``chunk`` tokens, so every scored token attends to history the scheme has already stored (in
the same call a cache returns its new tokens exact, which would hide the damage). Scored: the next-token
log-likelihood of every token after the prefix. Several windows are taken at evenly spaced offsets.

The default text is the built-in corpus of :mod:`.haystack` (Python's documentation topics, offline).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..bench.schemes import make_cache, scheme_attention
from ..core.compat import cache_kwargs
from ..models import input_device
from .common import check_length, progress
from .evaluate import cache_from_prefix

__all__ = ["PplRow", "check_ppl_args", "ppl_rows", "run_ppl", "score_window", "text_windows"]


@dataclass
class PplRow:
    """One scheme's perplexity over every scored token of every window."""

    scheme: str
    nll: float  # mean negative log-likelihood, nats/token
    ppl: float
    delta_ppl: float  # ppl - full-precision ppl
    delta_pct: float  # 100 * delta / full-precision ppl
    top1_agree: float  # fraction of positions whose argmax equals full precision's
    tokens: int
    delta_pct_se: float = 0.0  # standard error of delta_pct from the per-token NLL differences (see run_ppl)


def text_windows(tokenizer, text: str, length: int, windows: int) -> list[torch.Tensor]:
    """``windows`` ``[1, length]`` id windows at evenly spaced offsets of the tokenized text.

    Raises:
        ValueError: the text holds fewer than ``length`` tokens.
    """
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    bos = tokenizer.bos_token_id
    # every window starts like a document (Gemma needs its BOS as attention sink)
    need = length - (bos is not None)
    n = ids.shape[1]
    if n < need:
        raise ValueError(f"the text has {n} tokens, fewer than --length {length}; give a longer --text-file")
    step = (n - need) // max(windows - 1, 1)
    out = []
    for w in range(windows):
        window = ids[:, w * step : w * step + need]
        if bos is not None:
            window = torch.cat([torch.tensor([[bos]], dtype=window.dtype), window], dim=1)
        out.append(window)
    return out


@torch.no_grad()
def _score(model, cache, ids: torch.Tensor, start: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed ``ids[:, start:]`` in chunks after ``cache``: ``(nll [n-1], argmax [n-1])`` of tokens ``start+1..``."""
    nll, top = [], []
    for s in range(start, ids.shape[1], chunk):
        piece = ids[:, s : s + chunk]
        logits = model(input_ids=piece, **cache_kwargs(cache), use_cache=True).logits[0].float()
        targets = ids[0, s + 1 : s + 1 + piece.shape[1]]
        logits = logits[: targets.shape[0]]
        nll.append(torch.nn.functional.cross_entropy(logits, targets, reduction="none"))
        top.append(logits.argmax(-1))
    return torch.cat(nll), torch.cat(top)


def check_ppl_args(model, length: int, windows: int, prefix: int | None, chunk: int, schemes: list[str]) -> int:
    """Check :func:`run_ppl`'s arguments; return the prefix (default ``length // 2``).

    Raises:
        ValueError: a length over the model's limit, bad prefix/chunk/windows, a first scheme other than
            ``dynamic``.
    """
    check_length(model, length, "--length")
    prefix = length // 2 if prefix is None else prefix
    if not 1 <= prefix <= length - 2:
        raise ValueError(f"--prefix must be in [1, {length - 2}], got {prefix}")
    if chunk < 1 or windows < 1:
        raise ValueError(f"--chunk and --windows must be >= 1, got {chunk} and {windows}")
    if schemes[0] != "dynamic":
        raise ValueError(f"the first scheme must be 'dynamic' (the reference), got {schemes[0]!r}")
    return prefix


def score_window(model, ids: torch.Tensor, schemes: list[str], prefix: int, chunk: int = 64,
                 tick: Callable[[str], None] | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One window (``[1, length]`` ids) through every scheme: ``{scheme: (nll [scored], agrees with the
    reference's argmax [scored])}``, the reference (``schemes[0]``) first. ``tick`` is called after each scheme."""
    ids = ids.to(input_device(model))
    prefilled = make_cache("dynamic", model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :prefix], **cache_kwargs(prefilled), use_cache=True, logits_to_keep=1)
    out, ref_top = {}, None
    for n, name in enumerate(schemes, 1):
        with scheme_attention(model, name):
            cache = cache_from_prefix(make_cache(name, model.config), prefilled)
            losses, top = _score(model, cache, ids, prefix, chunk)
        ref_top = top if ref_top is None else ref_top
        out[name] = (losses, (top == ref_top).float())
        if tick:
            tick(f"{name} ({n}/{len(schemes)})")
    return out


def ppl_rows(windows: list[dict[str, tuple[torch.Tensor, torch.Tensor]]], schemes: list[str]) -> list[PplRow]:
    """Per-scheme rows over the scored windows (:func:`score_window` results); ``schemes[0]`` is the reference.

    ``delta_pct_se`` is the standard error of ``delta_pct`` from the scored tokens' paired NLL differences
    against full precision (``100 * exp(mean) * std / sqrt(n)``): how far the figure would move on other text of
    the same kind. Neighbouring tokens are correlated, so it is a lower bound; a Δppl within a few of it of
    another is a tie, not a ranking.
    """
    rows = []
    ref = torch.cat([w[schemes[0]][0] for w in windows]).double()
    base = math.exp(float(ref.mean()))
    for name in schemes:
        mine = torch.cat([w[name][0] for w in windows]).double()
        mean_nll = float(mine.mean())
        ppl = math.exp(mean_nll)
        diff = mine - ref
        se = float(diff.std() / math.sqrt(diff.numel())) if diff.numel() > 1 else 0.0
        rows.append(PplRow(name, mean_nll, ppl, ppl - base, 100 * (ppl - base) / base,
                           float(torch.cat([w[name][1] for w in windows]).mean()), int(mine.numel()),
                           100 * (ppl / base) * se))
    return rows


def run_ppl(model, tokenizer, schemes: list[str], text: str, length: int, windows: int = 2, prefix: int | None = None,
            chunk: int = 64, show_progress: bool = True, tick: Callable[[str], None] | None = None) -> list[PplRow]:
    """Perplexity per scheme over ``windows`` windows of ``length`` tokens (``schemes[0]`` = ``dynamic``).

    Args:
        prefix: tokens prefilled in full precision and handed over (default ``length // 2``); the
            ``length - prefix - 1`` tokens after it are scored.
        chunk: tokens per scoring call.
        tick: called after each (window, scheme) with where the run is (:class:`.common.Heartbeat`).

    Returns:
        one :class:`PplRow` per scheme (:func:`ppl_rows`).

    Raises:
        ValueError: a length over the model's limit, too short a text, bad prefix/chunk/windows.
    """
    prefix = check_ppl_args(model, length, windows, prefix, chunk, schemes)
    scored = []
    cut = text_windows(tokenizer, text, length, windows)
    for w, ids in enumerate(progress(cut, total=windows, desc="ppl windows", enabled=show_progress), 1):
        step = (lambda where, w=w: tick(f"ppl window {w}/{windows}, {where}")) if tick else None
        scored.append(score_window(model, ids, schemes, prefix, chunk, step))
    return ppl_rows(scored, schemes)
