"""A long prompt prefilled in chunks: the same K/V and logits as one forward, at the cost of what each chunk sees.

One forward over a ``T``-token prompt builds a ``T x T`` causal mask for every attention layer; on a CPU
transformers' SDPA path then pays for every masked entry as well, which makes the sliding-window layers of Gemma-3
(512 tokens) cost as much as its full-attention ones. Fed in chunks of ``chunk`` tokens into a ``DynamicCache``, each
forward's mask is ``chunk x (history + chunk)`` and a sliding layer's history is its window, so the cost falls to
what the layers really attend to. For a ``DynamicCache`` the result is the same computation regrouped: every query
attends to the same keys with the same values, so K/V and logits equal one forward's up to float rounding (matrix
products of other shapes sum in another order); ``tests/evals/test_prefill.py`` compares them.

For a quantizing cache it is a different computation: the chunks after the first read the history the cache
stores, which is the point of the chunked-prefill form (:mod:`.forms`) and not what a shared full-precision prefill
may do.
"""

from __future__ import annotations

import torch

from ..core.compat import cache_kwargs

__all__ = ["SHARED_PREFILL_CHUNK", "prefill"]

SHARED_PREFILL_CHUNK = 1024
"""Tokens per forward of the shared full-precision prefill of the evaluations. A sliding layer's work per chunk is
``chunk x (chunk + window)``, so smaller chunks save until the per-forward overhead shows; on Gemma-3-270M at 16k
tokens 1024 was the cheapest of one forward, 4096, 2048 and 1024 (``scripts/long_prefill_cost.py``,
docs/long_context.md)."""


@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache, chunk: int | None = None) -> torch.Tensor:
    """Run ``ids`` ``[1, T]`` into ``cache`` in forwards of at most ``chunk`` tokens; the last position's logits.

    Args:
        chunk: tokens per forward; None or 0: one forward.

    Returns:
        ``[1, vocab]`` float32 logits of the prompt's last token (what the first answer token is drawn from).

    Raises:
        ValueError: an empty prompt or a negative ``chunk``.
    """
    if ids.ndim != 2 or ids.shape[1] < 1:
        raise ValueError(f"ids must be [batch, T] with T >= 1, got {list(ids.shape)}")
    if chunk is not None and chunk < 0:
        raise ValueError(f"chunk must be >= 1 tokens (or 0/None: one forward), got {chunk}")
    step = chunk or ids.shape[1]
    for start in range(0, ids.shape[1], step):
        out = model(input_ids=ids[:, start:start + step], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float()
