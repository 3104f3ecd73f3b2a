"""Shared measurement helpers: prompts to ids, caches that share one full-precision prefill, logit damage.

The cache returns tokens exact when it quantizes them within the same call, so damage shows only on tokens
that come *after* the quantization: measurements prefill a prompt minus its last tokens, then feed the tail
(and decode) against the now-quantized history. Prefilling once with ``DynamicCache`` and handing each
quantized cache the same prefix K/V in one ``update`` per layer is exactly what a real prefill leaves behind
(checked in ``scripts/key_format.py --check_prefill``), and saves one long prefill per scheme.
"""

from __future__ import annotations

import copy

import torch

from .layer import AsymKVLayer

__all__ = ["encode_prompt", "cache_from_prefix", "tail_and_decode", "kl_top1", "eos_ids", "compare_continuation"]


def encode_prompt(tokenizer, prompt) -> torch.Tensor:
    """``[1, T]`` ids: the chat template when the tokenizer has one, else a completion prompt (base models)."""
    if tokenizer.chat_template:
        enc = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        return enc["input_ids"]
    text = prompt.messages[0]["content"] + f"\nAnswer: The access code for the {prompt.key} is"
    return tokenizer(text, return_tensors="pt")["input_ids"]


def cache_from_prefix(cache, prefilled):
    """Put ``cache`` in the state a prefill leaves it in, from a ``DynamicCache`` that ran that prefill.

    Quantized layers receive the prefix K/V in one ``update`` (what the real prefill does); every other layer
    becomes a copy of the full-precision layer.
    """
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, AsymKVLayer):
            layer.update(prefilled.layers[i].keys, prefilled.layers[i].values)
        else:
            cache.layers[i] = copy.deepcopy(prefilled.layers[i])
    return cache


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


@torch.no_grad()
def tail_and_decode(model, cache, tail_ids: torch.Tensor, max_new: int = 24) -> tuple[torch.Tensor, list[int]]:
    """Feed ``tail_ids`` (``[1, n]``) in one call, then decode greedily up to ``max_new`` tokens.

    Returns:
        ``(logits [n, vocab] of the tail, generated token ids)``.
    """
    eos = eos_ids(model)
    logits = model(input_ids=tail_ids, past_key_values=cache, use_cache=True).logits[0].float()
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < max_new and tokens[-1] not in eos:
        step = model(input_ids=torch.tensor([[tokens[-1]]], device=tail_ids.device), past_key_values=cache,
                     use_cache=True, logits_to_keep=1).logits
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
