"""The limit a decode step is measured against, and caches filled without a prefill (``hf-asymkv bench``).

A decode step reads the model's weights once and the whole K/V history once; on a CPU at long contexts it is bound by
those bytes. :func:`read_bandwidth` measures what this machine reads per second right now (a streaming ``torch.sum``
over a buffer larger than the caches, so that no cache level holds it), and a step's roofline is
``(weight_bytes + K/V bytes as stored) / bandwidth``: the time of those bytes at that rate. A step's distance to its
roofline is then a number.

:func:`fill_random` writes random K/V into every layer of a cache the way a prefill's forward does (one ``update`` per
layer), so that contexts beyond what a model was trained on, or beyond what a CPU prefills in minutes, can be timed: a
decode step's cost does not depend on what the history holds.
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["fill_random", "kv_shape", "median_bandwidth", "read_bandwidth", "weight_bytes"]

_MIN_BUFFER = 256 * 2**20  # far above any CPU's last-level cache


def read_bandwidth(nbytes: int, reads: int = 3) -> float:
    """Bytes per second of a streaming read on the current torch threads: the best of ``reads`` sums over a float32
    buffer of ``max(nbytes, 256 MiB)`` (allocated and touched first, freed after)."""
    buffer = torch.ones(max(nbytes, _MIN_BUFFER) // 4)
    times = []
    for _ in range(reads):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return buffer.numel() * 4 / min(times)


def median_bandwidth(samples: list[float]) -> float:
    """The median of bandwidth samples taken through a run (0.0 without any)."""
    return statistics.median(samples) if samples else 0.0


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage once (tied embeddings count once: the output
    projection reads the whole matrix at every step, the input embedding one row)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def kv_shape(config) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a decoder config (its text config for multimodal ones)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


@torch.no_grad()
def fill_random(cache, config, tokens: int, dtype: torch.dtype, seed: int = 0, device="cpu") -> float:
    """Write ``tokens`` random K/V tokens into every layer of ``cache`` (batch 1, one ``cache.update`` per layer, as a
    prefill's forward writes them); the same K/V for every cache of a seed. Returns the seconds spent in the updates
    (drawing the random tensors is not counted)."""
    layers, kv_heads, head_dim = kv_shape(config)
    gen = torch.Generator().manual_seed(seed)
    spent = 0.0
    for index in range(layers):
        keys, values = torch.randn(2, 1, kv_heads, tokens, head_dim, generator=gen).to(device=device, dtype=dtype)
        start = time.perf_counter()
        cache.update(keys, values, index)
        spent += time.perf_counter() - start
        del keys, values
    return spent
