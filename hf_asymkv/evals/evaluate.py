"""Shared measurement helpers: prompts to ids, caches that share one full-precision prefill, logit damage.

The cache returns tokens exact when it quantizes them within the same call, so damage shows only on tokens
that come *after* the quantization: measurements prefill a prompt minus its last tokens, then feed the tail
(and decode) against the now-quantized history. Prefilling once with ``DynamicCache`` and handing each
quantized cache the same prefix K/V in one ``update`` per layer is exactly what a real prefill leaves behind
(checked in ``scripts/studies/key_format.py --check_prefill``), and saves one long prefill per scheme.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..core.compat import DUMMY_LAYER_CLASSES, cache_kwargs
from ..core.sliding_layer import SlidingAsymKVLayer

__all__ = ["cache_from_prefix", "compare_continuation", "encode_prompt", "eos_ids", "kl_top1", "prompt_question_start",
           "tail_and_decode"]


def encode_prompt(tokenizer, prompt) -> torch.Tensor:
    """``[1, T]`` ids: the chat template when the tokenizer has one, else a completion prompt (base models).

    A prompt with an ``answer_prefix`` (the retrieval tasks of :mod:`hf_asymkv.evals.needle`) gets it appended
    after the generation prompt (chat) or after ``"Answer: "`` (base models), so the model's first tokens are
    the answer itself.
    """
    prefix = getattr(prompt, "answer_prefix", None)
    if tokenizer.chat_template:
        enc = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        if not prefix:
            return enc["input_ids"]
        extra = tokenizer(" " + prefix, add_special_tokens=False, return_tensors="pt")["input_ids"]
        return torch.cat([enc["input_ids"], extra.to(enc["input_ids"].dtype)], dim=1)
    answer = prefix or f"The access code for the {prompt.key} is"
    text = prompt.messages[0]["content"] + f"\nAnswer: {answer}"
    return tokenizer(text, return_tensors="pt")["input_ids"]


def prompt_question_start(tokenizer, prompt, ids: torch.Tensor) -> int:
    """Index in ``ids`` (``[1, T]``, :func:`encode_prompt` of ``prompt``) of the first token after the document: the
    newline before the last line of the user's text (the question), as :mod:`hf_asymkv.evals.question` finds it.

    Raises:
        ValueError: the prompt's text has no question line after its document, or its tokens cannot be split there.
    """
    from .question import question_char, question_line, question_start

    content = prompt.messages[-1]["content"]
    where = f"{getattr(prompt, 'task', 'prompt')} prompt of {ids.shape[1]} tokens"
    line = question_line(content, where)
    if tokenizer.chat_template:  # the template's rendering, tokenized as apply_chat_template tokenizes it
        text = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
        document = tokenizer(text[:question_char(text, line, where)], add_special_tokens=False)["input_ids"]
    else:
        document = tokenizer(content[:question_char(content, line, where)])["input_ids"]
    return question_start(ids[0].tolist(), document, where)


# Layers that store what they are given, unquantized: a copy of the full-precision layer is their prefill state.
# Sliding-window layers must be copied (their stored K/V are already trimmed to the window and carry the
# cumulative length); anything else, quantizing or not, receives the prefix K/V in one ``update``.
_PLAIN_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, *DUMMY_LAYER_CLASSES)


def sliding_margin(caches) -> int:
    """Tokens a prefilled sliding-window layer must keep beyond its window so that :func:`cache_from_prefix` can fill
    the quantized sliding-window layers of ``caches``: their largest block size (0: none has one)."""
    return max((layer.block_size for cache in caches for layer in cache.layers
                if isinstance(layer, SlidingAsymKVLayer)), default=0)


def widen_sliding(cache, margin: int):
    """Let the ``DynamicSlidingWindowLayer`` layers of ``cache`` (a full-precision cache about to be prefilled) keep
    ``margin`` tokens more than their window: the model's sliding mask (built from its config) still hides them, so
    the prefill computes the same attention. Returns ``cache``."""
    for layer in cache.layers if margin else ():
        if type(layer) is DynamicSlidingWindowLayer:
            layer.sliding_window += margin
            if hasattr(layer, "_sliding_window_tensor"):
                layer._sliding_window_tensor = torch.tensor(layer.sliding_window, dtype=torch.long)
    return cache


def _copy_plain(layer, source):
    """A copy of the plain prefilled ``source`` for the fresh plain ``layer``: a sliding-window layer kept wider by
    :func:`widen_sliding` is cut back to ``layer``'s window, as its own prefill would have left it."""
    out = copy.deepcopy(source)
    if type(source) is DynamicSlidingWindowLayer and source.sliding_window != layer.sliding_window:
        out.sliding_window = layer.sliding_window
        if hasattr(layer, "_sliding_window_tensor"):
            out._sliding_window_tensor = layer._sliding_window_tensor.to(source.keys.device)
        if getattr(out, "keys", None) is not None and out.keys.numel():
            keep = layer.sliding_window - 1
            out.keys, out.values = out.keys[:, :, -keep:], out.values[:, :, -keep:]
    return out


def _fill_sliding(cache, i: int, layer: SlidingAsymKVLayer, source) -> None:
    """Layer ``i``, a quantized sliding-window layer, in the state one prefill of the prefix leaves it in, from a
    prefilled ``DynamicSlidingWindowLayer`` that kept at least its window plus a block (:func:`widen_sliding`): the
    blocks the window has left behind dropped, the tokens from the first block still held on given in one update.
    Blocks are quantized each on its own, so those are the blocks (and the exact tail) the full prefill stores."""
    total, held = int(source.cumulative_length), source.keys.shape[-2]
    start = layer.kept_from(total)
    if total - held > start:
        raise ValueError(f"layer {i}: the prefilled sliding-window layer kept its last {held} of {total} tokens; this "
                         f"quantized one needs the last {total - start} (widen_sliding(prefilled, margin) before "
                         "the prefill, sliding_margin(caches) gives the margin)")
    layer.start_at(start)
    if cache.reuse_watch.layer_idx == i:  # the layer's length is set on purpose, as by a crop
        cache.reuse_watch.rewound(start)
    cache.update(source.keys[:, :, held - (total - start):], source.values[:, :, held - (total - start):], i)


def cache_from_prefix(cache, prefilled):
    """Put ``cache`` in the state a prefill leaves it in, from a ``DynamicCache`` that ran that prefill.

    Every layer of a storage type other than transformers' plain ones (``DynamicLayer``,
    ``DynamicSlidingWindowLayer``, ``DummyLayer``; exact types, not subclasses: ``QuantizedCache`` layers
    subclass ``DynamicLayer``) receives the prefix K/V in one ``cache.update``, exactly what the real prefill does:
    our ``AsymKVLayer`` and transformers' quanto/fp8 ``QuantizedLayer`` quantize it there, and our cache's reuse check
    takes it as the prefill (the tail that follows raises no :class:`~hf_asymkv.core.reuse.CacheReuseWarning`).
    Plain layers become copies of the full-precision layer.

    A quantized sliding-window layer (``quantize_sliding=True``) is filled from the prefilled sliding layer, which
    must have kept its window plus a block (:func:`widen_sliding` with :func:`sliding_margin` before the prefill):
    :func:`_fill_sliding`.

    Raises:
        ValueError: a quantizing layer where the prefilled layer only kept a sliding window (its K/V are not
            the whole prefix), or a quantized sliding layer whose prefilled twin was not kept wide enough.
    """
    for i, layer in enumerate(cache.layers):
        source = prefilled.layers[i]
        if type(layer) in _PLAIN_LAYERS:
            cache.layers[i] = _copy_plain(layer, source)
            continue
        if isinstance(layer, SlidingAsymKVLayer) and type(source) is DynamicSlidingWindowLayer:
            _fill_sliding(cache, i, layer, source)
            continue
        if type(source) is not DynamicLayer:
            raise ValueError(f"layer {i}: cannot prefill a {type(layer).__name__} from a {type(source).__name__} "
                             "(needs the full prefix K/V of a DynamicLayer)")
        cache.update(source.keys, source.values, i)  # through the cache, as the model's prefill calls it
    return cache


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


@torch.no_grad()
def tail_and_decode(model, cache, tail_ids: torch.Tensor, max_new: int = 24,
                    start: int | None = None) -> tuple[torch.Tensor, list[int]]:
    """Feed ``tail_ids`` (``[1, n]``) in one call, then decode greedily up to ``max_new`` tokens.

    Args:
        start: the position of the tail's first token, passed as ``position_ids`` (as kvpress's pipeline does: a
            press leaves fewer tokens in the cache than came before the tail); None: the cache's length.

    Returns:
        ``(logits [n, vocab] of the tail, generated token ids)``.
    """
    def at(first: int, n: int) -> dict:
        return {} if start is None else {"position_ids": torch.arange(first, first + n, device=tail_ids.device)[None]}

    eos = eos_ids(model)
    n = tail_ids.shape[1]
    logits = model(input_ids=tail_ids, **cache_kwargs(cache), use_cache=True, **at(start or 0, n)).logits[0].float()
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < max_new and tokens[-1] not in eos:
        step = model(input_ids=torch.tensor([[tokens[-1]]], device=tail_ids.device), **cache_kwargs(cache),
                     use_cache=True, logits_to_keep=1, **at((start or 0) + n + len(tokens) - 1, 1)).logits
        tokens.append(int(step[0, -1].argmax()))
    return logits, tokens


def kl_top1(ref: torch.Tensor, q: torch.Tensor) -> tuple[list[float], float]:
    """Per-position KL(ref || q) in nats and the top-1 agreement of two ``[n, vocab]`` logit tensors."""
    lp, lq = ref.float().log_softmax(-1), q.float().log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return kl.tolist(), float((ref.argmax(-1) == q.argmax(-1)).float().mean())


def compare_continuation(model, tokenizer, cache, tail_ids: torch.Tensor, ref_logits: torch.Tensor,
                         ref_tokens: list[int], expected: str, max_new: int = 24) -> dict:
    """Continue ``cache`` with the tail and a greedy answer; compare with the full-precision reference.

    Returns:
        ``kl_mean``/``kl_max`` (nats) and ``top1`` of the tail logits, the decoded ``answer``, whether it is
        ``correct`` (string match of ``expected``) and whether its tokens are the reference's (``same_tokens``).
    """
    from .tasks import score_answer

    logits, tokens = tail_and_decode(model, cache, tail_ids, max_new)
    kl, top1 = kl_top1(ref_logits, logits)
    answer = tokenizer.decode(tokens, skip_special_tokens=True).strip()
    return {"kl_mean": sum(kl) / len(kl), "kl_max": max(kl), "top1": top1, "answer": answer,
            "correct": score_answer(answer, expected), "same_tokens": tokens == ref_tokens}
