"""The needle grid: every (length, depth, task, sample) prompt answered through every cache scheme.

Each prompt is prefilled once with ``DynamicCache`` except its last :data:`TAIL` tokens; every scheme then
receives that prefix K/V the way a real prefill hands it over (:func:`hf_asymkv.evals.evaluate.cache_from_prefix`),
feeds the tail and decodes greedily. The answer therefore reads the quantized history, as in deployment,
while the costly prefill is paid once per prompt instead of once per scheme.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..bench.schemes import make_cache, scheme_attention
from ..core.compat import cache_kwargs
from ..models import input_device
from .common import check_length, progress
from .evaluate import cache_from_prefix, encode_prompt, kl_top1, tail_and_decode
from .haystack import split_sentences
from .needle import TASKS, make_task, score_task

__all__ = ["TAIL", "NeedleRow", "accuracy_table", "answer_prompt", "check_grid", "heatmap_grid", "needle_prompts",
           "run_needle"]

TAIL = 16  # prompt tokens fed through each scheme's cache (they attend to the quantized prefix)


@dataclass
class NeedleRow:
    """One prompt answered through one scheme."""

    scheme: str
    task: str
    haystack: str
    length: int
    depth: float
    sample: int
    prompt_tokens: int
    expected: list[str]
    answer: str
    correct: bool
    recall: float
    same_as_full: bool  # the generated tokens equal the full-precision cache's
    tail_kl: float  # mean KL(full || scheme) of the tail's next-token distributions, nats


def needle_prompts(tokenizer, lengths: list[int], depths: list[float], tasks: list[str], samples: int,
                   haystack: str, text: str | None, seed: int):
    """Yield every ``NeedleTask`` of the grid (lengths outermost, then depths, tasks, samples)."""
    sentences = split_sentences(text) if text is not None else None
    for length in lengths:
        for depth in depths:
            for task in tasks:
                for sample in range(samples):
                    yield sample, make_task(tokenizer, task, length, depth, seed + sample, haystack, sentences)


def check_grid(model, lengths: list[int], depths: list[float], tasks: list[str], samples: int) -> None:
    for length in lengths:
        check_length(model, length)
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad:
        raise ValueError(f"--depths must be in [0, 1], got {bad}")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; known tasks: {list(TASKS)}")
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")


@torch.no_grad()
def answer_prompt(model, tokenizer, task, schemes: list[str], sample: int,
                  tick: Callable[[str], None] | None = None) -> list[NeedleRow]:
    """One prompt of :func:`needle_prompts` through every scheme (``schemes[0]`` must be ``dynamic``: the
    reference); ``tick`` is called after each scheme."""
    ids = encode_prompt(tokenizer, task).to(input_device(model))
    prefilled = make_cache("dynamic", model.config)
    model(input_ids=ids[:, :-TAIL], **cache_kwargs(prefilled), use_cache=True, logits_to_keep=1)
    rows, ref = [], None
    for name in schemes:
        with scheme_attention(model, name):  # e.g. the fused attention of asymkv-fused
            cache = cache_from_prefix(make_cache(name, model.config), prefilled)
            logits, tokens = tail_and_decode(model, cache, ids[:, -TAIL:], task.max_new)
        del cache
        if ref is None:
            ref = (logits, tokens)
        kl, _ = kl_top1(ref[0], logits)
        answer = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        correct, recall = score_task(answer, task)
        rows.append(NeedleRow(name, task.task, task.haystack, task.length, task.depth, sample, ids.shape[1],
                              list(task.answers), answer, correct, recall, tokens == ref[1], sum(kl) / len(kl)))
        if tick:
            tick(f"{name} ({len(rows)}/{len(schemes)})")
    return rows


def run_needle(model, tokenizer, schemes: list[str], lengths: list[int], depths: list[float], tasks: list[str],
               samples: int = 1, haystack: str = "noise", text: str | None = None, seed: int = 0,
               show_progress: bool = True, tick: Callable[[str], None] | None = None) -> list[NeedleRow]:
    """Answer every prompt of the grid through every scheme.

    Args:
        schemes: scheme names with ``dynamic`` first (see :func:`.common.check_schemes`).
        lengths: token budgets (prompt + answer), each within the model's ``max_position_embeddings``.
        depths: needle depths in [0, 1]. tasks: names from :data:`.needle.TASKS`.
        samples: prompts per (length, depth, task) cell, seeds ``seed .. seed + samples - 1``.
        haystack, text: the haystack kind and, for ``text``, the natural text.
        tick: called after each (prompt, scheme) with where the run is (:class:`.common.Heartbeat`).

    Raises:
        ValueError: a length over the model's limit, a depth outside [0, 1], unknown task, samples < 1.
    """
    check_grid(model, lengths, depths, tasks, samples)
    if schemes[0] != "dynamic":
        raise ValueError(f"the first scheme must be 'dynamic' (the reference), got {schemes[0]!r}")
    total = len(lengths) * len(depths) * len(tasks) * samples
    rows: list[NeedleRow] = []
    prompts = needle_prompts(tokenizer, lengths, depths, tasks, samples, haystack, text, seed)
    for n, (sample, task) in enumerate(progress(prompts, total=total, desc="needle prompts", enabled=show_progress), 1):
        step = (lambda where, n=n: tick(f"needle prompt {n}/{total}, {where}")) if tick else None
        rows += answer_prompt(model, tokenizer, task, schemes, sample, step)
    return rows


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def accuracy_table(rows: list[NeedleRow], by: str = "length") -> dict[str, dict]:
    """``{scheme: {value of `by`: accuracy}}`` plus an ``"all"`` column, schemes in first-seen order."""
    cells: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        cells[r.scheme][getattr(r, by)].append(float(r.correct))
        cells[r.scheme]["all"].append(float(r.correct))
    return {s: {k: _mean(v) for k, v in c.items()} for s, c in cells.items()}


def heatmap_grid(rows: list[NeedleRow], scheme: str, lengths: list[int], depths: list[float]) -> list[list[float]]:
    """Accuracy ``[depth][length]`` of one scheme (over tasks and samples); NaN where nothing ran."""
    cells: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        if r.scheme == scheme:
            cells[(r.depth, r.length)].append(float(r.correct))
    return [[_mean(cells[(d, n)]) for n in lengths] for d in depths]
