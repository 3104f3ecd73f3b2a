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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicLayer

from ..bench.peers import PeerLayer
from ..bench.schemes import ATTENTION, make_cache, scheme_attention
from ..core.compat import DUMMY_LAYER_CLASSES, cache_kwargs
from ..core.layer import AsymKVLayer
from .evaluate import cache_from_prefix, eos_ids

__all__ = ["StopCheck", "generate_per_scheme", "prefilled_caches", "score_per_scheme", "shares_prefill"]

StopCheck = Callable[[list[int]], bool]
"""Called with the tokens generated so far (after each new one); True ends the answer (a stop string appeared)."""


def shares_prefill(name: str, cache) -> bool:
    """Whether scheme ``name``'s fresh ``cache`` can continue from a full-precision prefill's state.

    True when every layer returns the prefill's K/V exact from the update that stores them: transformers' plain
    and quantized layers (all ``DynamicLayer`` subclasses), KIVI's and ours; False for the per-token peer layers
    (they quantize the prefill inside its own update), for any other layer kind, and for schemes that run another
    attention implementation (its prefill may round differently).
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
    """Run ``ids`` ``[1, T]`` into ``cache``; the last position's logits ``[1, vocab]`` (float32)."""
    out = model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float()


def prefilled_caches(model, ids: torch.Tensor, schemes: list[str]):
    """Yield ``(name, cache, last prefill logits [1, vocab])`` for each scheme, each cache in the state the prefill of
    ``ids`` ``[1, T]`` leaves it in, from one shared full-precision prefill where the scheme allows it
    (:func:`shares_prefill`); the model runs under the scheme's attention implementation while the caller uses
    the cache."""
    shared = make_cache("dynamic", model.config)
    shared_logits = _prefill(model, ids, shared)
    for name in schemes:
        with scheme_attention(model, name):
            cache = make_cache(name, model.config)
            if shares_prefill(name, cache):
                yield name, cache_from_prefix(cache, shared), shared_logits
            else:
                yield name, cache, _prefill(model, ids, cache)


@torch.no_grad()
def generate_per_scheme(model, ids: torch.Tensor, schemes: list[str], max_new_tokens: int,
                        stop: Callable[[], StopCheck] | None = None,
                        tick: Callable[[str], None] | None = None) -> dict[str, list[int]]:
    """Greedy answers to ``ids`` ``[1, T]`` through every scheme, as ``model.generate(ids, cache=scheme_cache,
    do_sample=False, max_new_tokens=max_new_tokens)`` gives them: the generated ids, ending at the model's eos
    (included), at ``max_new_tokens``, or where a fresh ``stop()`` check says so.

    Args:
        stop: makes one stop check per scheme (checks may keep state); None: eos and length only.
        tick: called after each scheme with its name.

    Returns:
        ``{scheme: generated token ids}``.
    """
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"one prompt at a time: ids must be [1, T], got {list(ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos = eos_ids(model)
    answers = {}
    for name, cache, logits in prefilled_caches(model, ids, schemes):
        check = stop() if stop else None
        tokens: list[int] = []
        while True:
            tokens.append(int(logits[0].argmax()))
            if tokens[-1] in eos or len(tokens) == max_new_tokens or (check and check(tokens)):
                break
            step = torch.tensor([[tokens[-1]]], device=ids.device)
            logits = _prefill(model, step, cache)
        answers[name] = tokens
        del cache
        if tick:
            tick(name)
    return answers


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
