"""Greedy answers and continuation scores of one prompt through every cache scheme, from one shared prefill.

``model.generate(ids, cache=scheme_cache)`` runs the whole prompt in one forward (the prefill), then one token per
step. In the prefill, our ``AsymKVCache``, transformers' ``QuantizedCache`` (quanto, HQQ, fp8) and the KIVI
emulation store the prompt's K/V and hand the attention back the exact K/V they were given: the prefill's logits
are full precision's, and what the cache holds afterwards is exactly what one ``update`` with full precision's K/V
leaves (:func:`hf_asymkv.evals.evaluate.cache_from_prefix`). So the prompt is prefilled once with a
``DynamicCache``, and every such scheme continues from a copy of that state: the first token comes from the
shared prefill logits, every later token reads the scheme's quantized history, as in ``generate``. A 4k-token
prefill is most of a RULER request's cost on a CPU; sharing it runs ten schemes for little more than one.

Schemes whose layers quantize the very update that brings the tokens (the per-token peer emulations of vLLM and
llama.cpp: their prefill already attends to quantized K/V) and schemes that switch the attention implementation
(``-fused``) get a prefill of their own. ``tests/evals/test_scheme_decode.py`` checks every scheme against
``model.generate`` with its cache: same first-token logits, same tokens.

The same shared prefill serves the question-reads-cache form (:mod:`.forms`): it stops at the question, each scheme
continues from the document's K/V and feeds the question through its own cache; the chunked-prefill form runs the
prompt through each scheme's own cache (``tests/evals/test_forms.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicLayer

from ..bench.peers import PeerLayer
from ..bench.schemes import ATTENTION, make_cache, scheme_attention
from ..core.compat import DUMMY_LAYER_CLASSES, cache_kwargs
from ..core.layer import AsymKVLayer
from ..models import input_device
from .evaluate import cache_from_prefix, eos_ids, sliding_margin, widen_sliding
from .forms import ONE_PASS, QUESTION, TAIL_FORM, form_chunk, parse_variant
from .prefill import prefill

__all__ = ["StopCheck", "generate_per_scheme", "greedy_continue", "prefilled_caches", "score_per_scheme",
           "shares_prefill"]

StopCheck = Callable[[list[int]], bool]
"""Called with the tokens generated so far (after each new one); True ends the answer (a stop string appeared)."""


def shares_prefill(name: str, cache) -> bool:
    """Whether scheme ``name``'s fresh ``cache`` can continue from a full-precision prefill's state.

    True when every layer returns the prefill's K/V exact from the update that stores them: transformers' plain
    and quantized layers (all ``DynamicLayer`` subclasses), KIVI's and ours; False for the per-token peer layers
    (they quantize the prefill inside its own update), for any other layer kind, and for schemes that run another
    attention implementation (its prefill may round differently). Our quantized sliding-window layers share it when
    the prefill kept its sliding layers a block wider (:func:`~hf_asymkv.evals.evaluate.widen_sliding`), as
    :func:`prefilled_caches` does.
    """
    if name in ATTENTION:
        return False
    for layer in cache.layers:
        if isinstance(layer, PeerLayer):
            return False
        if not isinstance(layer, (DynamicLayer, AsymKVLayer, *DUMMY_LAYER_CLASSES)):
            return False
    return True


def _prefill(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Run ``ids`` ``[1, T]`` into ``cache`` in one forward; the last position's logits ``[1, vocab]`` (float32)."""
    return prefill(model, ids, cache)


def _own_cache(model, name: str, shared, ids: torch.Tensor):
    """Scheme ``name``'s cache holding ``ids`` ``[1, T]`` (already under its attention): continued from ``shared``
    (the full-precision prefill of ``ids``) when it shares the prefill, else prefilled by itself in one forward.
    Returns ``(cache, last logits [1, vocab] or None when shared)``."""
    cache = make_cache(name, model.config)
    if shares_prefill(name, cache):
        return cache_from_prefix(cache, shared), None
    return cache, _prefill(model, ids, cache)


def prefilled_caches(model, ids: torch.Tensor, variants: list[str], split: int | None = None,
                     shared_chunk: int | None = None):
    """Yield ``(variant, cache, logits [1, vocab])`` for each of ``variants`` (scheme names, ``<scheme>@<form>`` for
    the forms of :mod:`.forms`): the cache holding the whole prompt ``ids`` ``[1, T]`` the way that form fills it,
    and the logits the first answer token is drawn from. The model runs under the scheme's attention implementation
    while the caller uses the cache.

    The one-pass and question forms share one full-precision prefill (:func:`shares_prefill`), run in forwards of
    ``shared_chunk`` tokens (:func:`~hf_asymkv.evals.prefill.prefill`; None: one forward) and stopped at ``split``
    while question forms are asked: each of them continues from the document's K/V and feeds ``ids[:, split:]``
    through its own cache; then the shared prefill takes the question too and the one-pass forms continue from it.
    A chunked form prefills the prompt through the scheme's own cache.

    Raises:
        ValueError: a question form without ``split``, or ``split`` outside ``[1, T - 1]``.
    """
    parsed = [(name, *parse_variant(name)) for name in variants]
    asked = {form for _, _, form in parsed}
    if TAIL_FORM in asked:
        raise ValueError(f"the tail form is the needle grid's own (hf_asymkv.evals.retrieval), not one of {variants}")
    if QUESTION in asked and (split is None or not 1 <= split < ids.shape[1]):
        raise ValueError(f"the question form needs the question's first token index in [1, {ids.shape[1] - 1}], "
                         f"got {split}")
    shared = logits = None
    if asked & {ONE_PASS, QUESTION}:
        # quantized sliding layers are filled from a sliding layer that kept a block more than its window
        margin = sliding_margin(make_cache(scheme, model.config) for _, scheme, form in parsed
                                if form in (ONE_PASS, QUESTION) and scheme not in ATTENTION)
        shared = widen_sliding(make_cache("dynamic", model.config), margin)
        end = split if QUESTION in asked else ids.shape[1]
        logits = prefill(model, ids[:, :end], shared, shared_chunk)
    for name, scheme, form in parsed:
        if form == QUESTION:
            with scheme_attention(model, scheme):
                cache, _ = _own_cache(model, scheme, shared, ids[:, :split])
                yield name, cache, _prefill(model, ids[:, split:], cache)  # the question reads the stored document
    if QUESTION in asked and ONE_PASS in asked:
        logits = _prefill(model, ids[:, split:], shared)
    for name, scheme, form in parsed:
        if form == ONE_PASS:
            with scheme_attention(model, scheme):
                cache, own = _own_cache(model, scheme, shared, ids)
                yield name, cache, logits if own is None else own
    shared = None
    for name, scheme, form in parsed:
        if (chunk := form_chunk(form)) is not None:
            with scheme_attention(model, scheme):
                cache = make_cache(scheme, model.config)
                yield name, cache, prefill(model, ids, cache, chunk)


@torch.no_grad()
def generate_per_scheme(model, ids: torch.Tensor, schemes: list[str], max_new_tokens: int,
                        stop: Callable[[], StopCheck] | None = None, tick: Callable[[str], None] | None = None,
                        split: int | None = None, shared_chunk: int | None = None) -> dict[str, list[int]]:
    """Greedy answers to ``ids`` ``[1, T]`` through every scheme, as ``model.generate(ids, cache=scheme_cache,
    do_sample=False, max_new_tokens=max_new_tokens)`` gives them: the generated ids, ending at the model's eos
    (included), at ``max_new_tokens``, or where a fresh ``stop()`` check says so.

    Args:
        schemes: scheme names, or ``<scheme>@<form>`` for the other forms (:func:`prefilled_caches`).
        stop: makes one stop check per scheme (checks may keep state); None: eos and length only.
        tick: called after each scheme with its name.
        split: index of the question's first token (question forms, :mod:`.question`).
        shared_chunk: tokens per forward of the shared full-precision prefill (None: one forward).

    Returns:
        ``{scheme: generated token ids}``.
    """
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"one prompt at a time: ids must be [1, T], got {list(ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    answers = {}
    for name, cache, logits in prefilled_caches(model, ids, schemes, split, shared_chunk):
        answers[name] = greedy_continue(model, cache, logits, max_new_tokens, stop() if stop else None)
        del cache
        if tick:
            tick(name)
    return answers


@torch.no_grad()
def greedy_continue(model, cache, logits: torch.Tensor, max_new_tokens: int,
                    check: StopCheck | None = None) -> list[int]:
    """Greedy tokens from ``logits`` ``[1, vocab]`` (the prompt's last position) on, one step at a time through
    ``cache``: ending at the model's eos (included), at ``max_new_tokens``, or where ``check`` says so."""
    eos, device = eos_ids(model), input_device(model)
    tokens: list[int] = []
    while True:
        tokens.append(int(logits[0].argmax()))
        if tokens[-1] in eos or len(tokens) == max_new_tokens or (check and check(tokens)):
            return tokens
        logits = _prefill(model, torch.tensor([[tokens[-1]]], device=device), cache)


@torch.no_grad()
def score_per_scheme(model, context: torch.Tensor, continuation: torch.Tensor,
                     schemes: list[str]) -> dict[str, tuple[float, bool]]:
    """Log-likelihood of ``continuation`` ``[1, n]`` after ``context`` ``[1, T]`` through every scheme.

    The context is the prefill; the continuation is then fed in one call against the scheme's cache (teacher
    forcing), so its second and later tokens read the quantized history as a generated answer would. The first
    continuation token is predicted by the prefill itself: identical in every scheme that shares it.

    Returns:
        ``{scheme: (sum of the continuation's log-probabilities, whether each token is the argmax)}``, the pair
        lm-eval's ``loglikelihood`` requests expect.
    """
    if context.shape[0] != 1 or continuation.shape[0] != 1 or continuation.shape[1] < 1:
        raise ValueError(f"one request at a time, a non-empty continuation: got context {list(context.shape)}, "
                         f"continuation {list(continuation.shape)}")
    scores = {}
    n = continuation.shape[1]
    for name, cache, first in prefilled_caches(model, context, schemes):
        logits = first
        if n > 1:
            tail = model(input_ids=continuation[:, :-1], **cache_kwargs(cache), use_cache=True).logits[0].float()
            logits = torch.cat([first, tail])
        logprobs = logits.log_softmax(-1)
        target = continuation[0].to(logits.device)
        total = float(logprobs.gather(-1, target[:, None]).sum())
        scores[name] = (total, bool((logits.argmax(-1) == target).all()))
        del cache
    return scores
