"""Orthonormal Hadamard rotation along ``head_dim``: spreads a few large channels over all of them.

A token's values often have one or two channels far larger than the rest; a per-token scale then leaves the
ordinary channels few effective levels. Rotating by an orthonormal Hadamard matrix ``H`` (entries ``+-1/sqrt(n)``)
mixes every channel into every other, so the rotated vector is flat and low-bit codes lose less (QuaRot,
SpinQuant, llama.cpp's quantized caches, vLLM's ``turboquant_k8v4``). Because ``H`` is orthonormal, nothing is
lost: ``(x H) H^T = x``, and attention can work on rotated values and rotate only its output back:
``softmax(q k^T) (V H) H^T = softmax(q k^T) V``.

``head_dim`` that is not a power of two gets a block-diagonal ``H``: Hadamard blocks of the largest power of two
that divides it (80 -> 5 blocks of 16), still orthonormal. The Sylvester construction is symmetric, so
``H^T = H``; the code still writes the transpose where the math has one.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["hadamard", "hadamard_block", "rotate", "unrotate"]


def hadamard_block(dim: int) -> int:
    """Size of the Hadamard blocks used for ``dim``: the largest power of two dividing it (``dim & -dim``)."""
    if dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {dim!r}.")
    return dim & -dim


@functools.lru_cache(maxsize=32)
def _hadamard_cpu(dim: int, dtype: torch.dtype) -> torch.Tensor:
    block = hadamard_block(dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:  # Sylvester: [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(block)
    return torch.block_diag(*[h] * (dim // block)).to(dtype)


def hadamard(dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The orthonormal ``[dim, dim]`` (block-)Hadamard matrix, in ``dtype`` on ``device`` (cached per device)."""
    h = _hadamard_cpu(dim, dtype)
    return h if device is None or torch.device(device) == h.device else _hadamard_on(dim, dtype, torch.device(device))


@functools.lru_cache(maxsize=32)
def _hadamard_on(dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _hadamard_cpu(dim, dtype).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` in float32 (what gets quantized): ``[..., D]`` -> ``[..., D]`` float32."""
    return x.float() @ hadamard(x.shape[-1], torch.float32, x.device)


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """``y @ H^T`` in ``y``'s dtype: the inverse of :func:`rotate`. ``[..., D]`` -> ``[..., D]``."""
    return y @ hadamard(y.shape[-1], y.dtype, y.device).T
