"""Eviction x quantization on the same needle prompts: kvpress presses alone, our presets alone, and both.

Each needle prompt (:mod:`.needle`) is split into its **context** (instructions and document) and its **question**
(the question, the chat template's turn end and the answer's start), as kvpress's pipeline splits them: a press
compresses the context in the prefill without seeing the question, the question then reads the compressed
history, and the answer is decoded greedily. For each prompt:

- ``full``: ``DynamicCache``, no press: the reference;
- each preset alone (``compact``, ...): the preset's cache given the reference prefill
  (:func:`.evaluate.cache_from_prefix`, what a real prefill leaves);
- each press alone: ``with press(model): model.model(context)`` on a ``DynamicCache``, as kvpress's pipeline does;
- each press x preset: the same, on the preset's :class:`~hf_asymkv.AsymKVCache` (the real composition: the press
  reads each layer's exact prefill and assigns the tokens it keeps, which the layer quantizes once).

The question is fed at the context's positions (``position_ids`` from the context length on), as kvpress's
pipeline feeds it: a press leaves fewer tokens in the cache than the context had.

Recorded per run: the real **bytes** the cache holds after the context (:func:`hf_asymkv.bench.memory.cache_nbytes`:
every tensor, capacity included, after :meth:`AsymKVCache.settle`: no dense copy of the prefill is left to count),
and ``bf16_nbytes``, the same tensors with those held in the model's dtype (a ``DynamicCache``'s K/V; our exact
parts, :meth:`AsymKVCache.memory_footprint`'s ``total_on_bf16``) counted at 2 bytes per element: what the cache
holds on a bf16 model, compared with a bf16 ``DynamicCache`` holding the whole context (``x_smaller``); the
**answer** (correct or not; lost/gained against full precision and against the press alone); the **tail KL**:
mean KL(full || run) of the question tokens' next-token distributions, nats, and the same against the press alone
(what the quantization adds to the press).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..bench.memory import cache_nbytes
from ..core.cache import EXACT_PARTS, AsymKVCache
from ..core.compat import cache_kwargs
from ..models import input_device
from .evaluate import cache_from_prefix, encode_prompt, kl_top1, tail_and_decode
from .needle import score_task
from .presses import make_press
from .retrieval import check_grid, needle_prompts

__all__ = ["PressRun", "context_and_question", "preset_label", "run_name", "run_press_grid"]


@dataclass
class PressRun:
    """One prompt through one configuration (press or not, preset or ``DynamicCache``)."""

    run: str  # "full", "compact", "KnormPress", "KnormPress x compact"
    press: str  # "" without a press
    preset: str  # "" for DynamicCache
    task: str
    length: int
    depth: float
    sample: int
    context_tokens: int
    kept_tokens: int  # tokens the first layer holds after the context
    nbytes: int  # real bytes held after the context
    bf16_nbytes: int  # the same, tensors in the model's dtype counted at 2 bytes per element
    exact_bf16_nbytes: int  # the part of bf16_nbytes held exact (a DynamicCache: all; ours: sinks and window)
    bf16_full_bytes: int  # a bf16 DynamicCache holding the whole context
    answer: str
    correct: bool
    tail_kl: float  # mean KL(full || run) over the question's next-token distributions, nats
    tail_kl_vs_press: float  # the same against the press alone (NaN without a press or without a preset)


def run_name(press: str, preset: str) -> str:
    """``"full"``, ``"compact"``, ``"KnormPress"`` or ``"KnormPress x compact"``."""
    return " x ".join(part for part in (press, preset) if part) or "full"


def context_and_question(tokenizer, task) -> tuple[torch.Tensor, torch.Tensor]:
    """``([1, c], [1, q])`` ids of the prompt's context and of its question (with the answer's start), which
    together are :func:`.evaluate.encode_prompt`'s ids.

    Raises:
        ValueError: the question is not at the end of the prompt's text (a chat template that moves it).
    """
    ids = encode_prompt(tokenizer, task)[0]
    content = task.messages[0]["content"]
    question = content.rsplit("\n", 1)[-1]
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(task.messages, add_generation_prompt=True, tokenize=False)
        prefix = tokenizer(text[: text.rindex(question)], add_special_tokens=False)["input_ids"]
    else:
        prefix = tokenizer(content[: content.rindex(question)])["input_ids"]
    n = 0
    while n < min(len(prefix), len(ids)) and prefix[n] == int(ids[n]):
        n += 1
    if n < len(prefix) - 2 or n == 0:  # a token or two may merge across the boundary; more means a moved question
        raise ValueError(f"the question of a {task.task!r} prompt is not at the end of its encoded text")
    return ids[None, :n], ids[None, n:]


def _held(cache, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(real bytes, bytes on a bf16 model, of which held exact, tokens held by the first layer)`` after the
    context. Our cache is settled first: the last layer's pressed update is quantized, as the question's first
    update would do."""
    if not isinstance(cache, AsymKVCache):
        nbytes = cache_nbytes(cache)  # a DynamicCache: every byte is K/V in the model's dtype
        return nbytes, nbytes * 2 // dtype.itemsize, nbytes * 2 // dtype.itemsize, cache.get_seq_length()
    cache.settle()
    nbytes = cache_nbytes(cache)
    parts = cache.memory_footprint()
    exact = sum(v for k, v in parts.items() if k.startswith(EXACT_PARTS)) * 2 // dtype.itemsize
    return nbytes, parts["total_on_bf16"], exact, cache.get_seq_length()


def _prefill(model, context: torch.Tensor, cache, press=None):
    """The context through the model without its head (as kvpress's pipeline prefills), under ``press`` if any."""
    with torch.no_grad():
        if press is None:
            model.model(input_ids=context, **cache_kwargs(cache))
        else:
            with press(model):
                model.model(input_ids=context, **cache_kwargs(cache))
    return cache


def _answer(model, tokenizer, task, cache, context: torch.Tensor, question: torch.Tensor):
    """``(question logits, tokens, answer, correct)``, the question at the context's positions."""
    logits, tokens = tail_and_decode(model, cache, question, task.max_new, start=context.shape[1])
    answer = tokenizer.decode(tokens, skip_special_tokens=True).strip()
    return logits, tokens, answer, score_task(answer, task)[0]


def preset_label(preset: str, window: int | None) -> str:
    """The preset's name in run names: ``"compact"``, or ``"compact, window 16"`` with its window overridden."""
    return preset if window is None else f"{preset}, window {window}"


def _caches(model, context: torch.Tensor, presses: list[str], presets: list[str], ratio: float,
            window: int | None = None):
    """Yield ``(press, preset label, cache)`` after the context, the reference ``("", "", DynamicCache)`` first."""
    config = model.config
    overrides = {} if window is None else {"residual_length": window}

    def ours(preset: str) -> AsymKVCache:
        return AsymKVCache.from_preset(preset, config, **overrides)

    reference = _prefill(model, context, DynamicCache())
    for preset in presets:  # from the reference prefill, before the reference reads its question
        yield "", preset_label(preset, window), cache_from_prefix(ours(preset), reference)
    yield "", "", reference
    for name in presses:
        yield name, "", _prefill(model, context, DynamicCache(), make_press(name, ratio))
        for preset in presets:
            yield name, preset_label(preset, window), _prefill(model, context, ours(preset), make_press(name, ratio))


def press_prompt(model, tokenizer, task, sample: int, presses: list[str], presets: list[str], ratio: float,
                 tick: Callable[[str], None] | None = None, window: int | None = None) -> list[PressRun]:
    """One needle prompt through every configuration (see the module docstring)."""
    context, question = (t.to(input_device(model)) for t in context_and_question(tokenizer, task))
    bf16_full = None
    results = {}
    for press, preset, cache in _caches(model, context, presses, presets, ratio, window):
        held = _held(cache, model.dtype)
        if not press and not preset:
            bf16_full = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers) * 2
        results[(press, preset)] = (*held, *_answer(model, tokenizer, task, cache, context, question))
        del cache
        if tick:
            tick(run_name(press, preset))
    full_logits = results[("", "")][4]
    runs = []
    for (press, preset), (nbytes, bf16_nbytes, exact, kept, logits, _, answer, correct) in results.items():
        kl = kl_top1(full_logits, logits)[0]
        vs_press = kl_top1(results[(press, "")][4], logits)[0] if press and preset else [float("nan")]
        runs.append(PressRun(run_name(press, preset), press, preset, task.task, task.length, task.depth, sample,
                             context.shape[1], kept, nbytes, bf16_nbytes, exact, bf16_full, answer, correct,
                             sum(kl) / len(kl), sum(vs_press) / len(vs_press)))
    return runs


def run_press_grid(model, tokenizer, presses: list[str], presets: list[str], ratio: float, lengths: list[int],
                   depths: list[float], tasks: list[str], samples: int = 1, seed: int = 0,
                   on_prompt: Callable[[list[PressRun]], None] | None = None,
                   tick: Callable[[str], None] | None = None, window: int | None = None) -> list[PressRun]:
    """Every prompt of the needle grid (noise haystack) through every configuration.

    Args:
        presses: names from :data:`.presses.PRESSES`; presets: names from ``hf_asymkv.PRESETS``.
        ratio: the presses' compression ratio (fraction of the context's tokens dropped).
        on_prompt: called with every run so far after each prompt (to save partial results).
        window: every preset's exact window (``residual_length``) instead of its own; None: the preset's. The
            bytes of a quantized token stay the preset's; the window's exact tokens are what a press x preset pays
            beyond them (the ``exact_share`` of the table).

    Raises:
        ValueError: a bad grid (see :func:`.retrieval.check_grid`), press or ratio (checked before the first
            prefill), or preset.
    """
    check_grid(model, lengths, depths, tasks, samples)
    for name in presses:
        make_press(name, ratio)
    for preset in presets:
        AsymKVCache.from_preset(preset, model.config, **({} if window is None else {"residual_length": window}))
    runs: list[PressRun] = []
    for n, (sample, task) in enumerate(needle_prompts(tokenizer, lengths, depths, tasks, samples, "noise", None,
                                                      seed), 1):
        where = (lambda detail, n=n: tick(f"prompt {n}, {detail}")) if tick else None
        runs += press_prompt(model, tokenizer, task, sample, presses, presets, ratio, where, window)
        if on_prompt:
            on_prompt(runs)
    return runs
