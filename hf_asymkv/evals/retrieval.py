"""The needle grid: every (length, depth, task, sample) prompt answered through every cache scheme.

By default (the ``tail`` form) each prompt is prefilled once with ``DynamicCache`` except its last :data:`TAIL`
tokens; every scheme then receives that prefix K/V the way a real prefill hands it over
(:func:`hf_asymkv.evals.evaluate.cache_from_prefix`), feeds the tail and decodes greedily. The answer therefore reads
the quantized history, as in deployment, while the costly prefill is paid once per prompt instead of once per scheme.
The other forms of :mod:`.forms` (one-pass, the whole question reading the cache, a chunked prefill) run beside it
with ``forms=``, from one shared prefill too (:func:`hf_asymkv.evals.scheme_decode.prefilled_caches`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..bench.schemes import make_cache, scheme_attention
from ..models import input_device
from .common import check_length, progress
from .evaluate import cache_from_prefix, encode_prompt, kl_top1, prompt_question_start, tail_and_decode
from .forms import QUESTION, TAIL_FORM, parse_variant, variant
from .haystack import split_sentences
from .needle import TASKS, make_task, score_task
from .prefill import SHARED_PREFILL_CHUNK, prefill
from .scheme_decode import greedy_continue, prefilled_caches

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
    same_as_full: bool  # the generated tokens equal the full-precision cache's (in the same form)
    tail_kl: float  # KL(full || scheme), nats: mean over the tail's next-token distributions (tail form), else the
    # first answer token's
    form: str = TAIL_FORM  # how the prompt reached the cache (hf_asymkv.evals.forms)


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


def _row(name: str, form: str, task, sample: int, ids: torch.Tensor, tokenizer, tokens: list[int], kl: float,
         same: bool) -> NeedleRow:
    answer = tokenizer.decode(tokens, skip_special_tokens=True).strip()
    correct, recall = score_task(answer, task)
    return NeedleRow(name, task.task, task.haystack, task.length, task.depth, sample, ids.shape[1], list(task.answers),
                     answer, correct, recall, same, kl, form)


def _tail_rows(model, tokenizer, task, ids: torch.Tensor, schemes: list[str], sample: int, shared_chunk: int | None,
               tick: Callable[[str], None] | None) -> list[NeedleRow]:
    """The tail form: the prompt minus its last :data:`TAIL` tokens prefilled once, the tail through each cache."""
    prefilled = make_cache("dynamic", model.config)
    prefill(model, ids[:, :-TAIL], prefilled, shared_chunk)
    rows, ref = [], None
    for name in schemes:
        with scheme_attention(model, name):  # e.g. the fused attention of asymkv-fused
            cache = cache_from_prefix(make_cache(name, model.config), prefilled)
            logits, tokens = tail_and_decode(model, cache, ids[:, -TAIL:], task.max_new)
        del cache
        ref = ref or (logits, tokens)
        kl, _ = kl_top1(ref[0], logits)
        rows.append(_row(name, TAIL_FORM, task, sample, ids, tokenizer, tokens, sum(kl) / len(kl), tokens == ref[1]))
        if tick:
            tick(f"{name} ({len(rows)}/{len(schemes)})")
    return rows


def _form_rows(model, tokenizer, task, ids: torch.Tensor, schemes: list[str], forms: list[str], sample: int,
               shared_chunk: int | None, tick: Callable[[str], None] | None) -> list[NeedleRow]:
    """The other forms (:mod:`.forms`), from one shared prefill; each form's reference is full precision in it."""
    split = prompt_question_start(tokenizer, task, ids) if QUESTION in forms else None
    names = [variant(s, f) for f in forms for s in schemes]
    found = {}
    for name, cache, logits in prefilled_caches(model, ids, names, split, shared_chunk):
        found[name] = (logits, greedy_continue(model, cache, logits, task.max_new))
        del cache
        if tick:
            tick(f"{name} ({len(found)}/{len(names)})")
    rows = []
    for form in forms:
        ref = found[variant(schemes[0], form)]
        for scheme in schemes:
            logits, tokens = found[variant(scheme, form)]
            kl, _ = kl_top1(ref[0], logits)
            rows.append(_row(variant(scheme, form, plain=TAIL_FORM), form, task, sample, ids, tokenizer, tokens, kl[0],
                             tokens == ref[1]))
    return rows


@torch.no_grad()
def answer_prompt(model, tokenizer, task, schemes: list[str], sample: int, tick: Callable[[str], None] | None = None,
                  forms: tuple[str, ...] = (TAIL_FORM,), shared_chunk: int | None = SHARED_PREFILL_CHUNK
                  ) -> list[NeedleRow]:
    """One prompt of :func:`needle_prompts` through every scheme (``schemes[0]`` must be ``dynamic``: the
    reference) in every form of ``forms`` (:mod:`.forms`; ``tail`` is the grid's own: the last :data:`TAIL` tokens
    through the cache); ``tick`` is called after each scheme. Rows come scheme by scheme, the forms of a scheme side
    by side; a row's ``scheme`` is the scheme's name for the tail form, ``<scheme>@<form>`` for the others."""
    ids = encode_prompt(tokenizer, task).to(input_device(model))
    rows = _tail_rows(model, tokenizer, task, ids, schemes, sample, shared_chunk, tick) if TAIL_FORM in forms else []
    other = [f for f in forms if f != TAIL_FORM]
    if other:
        rows += _form_rows(model, tokenizer, task, ids, schemes, other, sample, shared_chunk, tick)
    order = {s: i for i, s in enumerate(schemes)}
    return sorted(rows, key=lambda r: (order[parse_variant(r.scheme)[0]], forms.index(r.form)))


def run_needle(model, tokenizer, schemes: list[str], lengths: list[int], depths: list[float], tasks: list[str],
               samples: int = 1, haystack: str = "noise", text: str | None = None, seed: int = 0,
               show_progress: bool = True, tick: Callable[[str], None] | None = None,
               forms: tuple[str, ...] = (TAIL_FORM,), shared_chunk: int | None = SHARED_PREFILL_CHUNK
               ) -> list[NeedleRow]:
    """Answer every prompt of the grid through every scheme.

    Args:
        schemes: scheme names with ``dynamic`` first (see :func:`.common.check_schemes`).
        lengths: token budgets (prompt + answer), each within the model's ``max_position_embeddings``.
        depths: needle depths in [0, 1]. tasks: names from :data:`.needle.TASKS`.
        samples: prompts per (length, depth, task) cell, seeds ``seed .. seed + samples - 1``.
        haystack, text: the haystack kind and, for ``text``, the natural text.
        tick: called after each (prompt, scheme) with where the run is (:class:`.common.Heartbeat`).
        forms: how each prompt reaches the caches (:func:`answer_prompt`); shared_chunk: tokens per forward of the
            shared full-precision prefill (:mod:`.prefill`; None: one forward).

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
        rows += answer_prompt(model, tokenizer, task, schemes, sample, step, tuple(forms), shared_chunk)
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
