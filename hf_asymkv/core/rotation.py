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

Reading rotated codes back densely costs a ``[D, D]`` product per token. For per-token codes with one group
per token (the presets), :func:`dequantize_rotated` computes it on the integer codes: with ``H = S / sqrt(b)``
(``S`` has entries -1, 0, +1), ``(s c + z) H^T = (s / sqrt(b)) (c S^T) + z (1 H^T)``; ``c S^T`` is an exact int8 x
int8 -> int32 product (``torch._int_mm``, about 3x faster than the float32 one on a CPU) and ``1 H^T`` is
nonzero only in each block's first column.
"""

from __future__ import annotations

import functools
import math

import torch

from ..kernels import cpu_readout
from .packing import PackedCodes
from .quant import QuantSpec, dequantize, integer_codes, native_readout, storage_offset

__all__ = ["dequantize_rotated", "hadamard", "hadamard_block", "hadamard_transform", "rotate", "unrotate"]


def hadamard_block(dim: int) -> int:
    """Size of the Hadamard blocks used for ``dim``: the largest power of two dividing it (``dim & -dim``)."""
    if dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {dim!r}.")
    return dim & -dim


# Process-wide tables, shared by every thread: each matrix is computed from its arguments alone and never written in
# place after (callers multiply by it or clone it), and lru_cache keeps its table whole under threads, so a race only
# builds the same matrix twice (hf_asymkv.kernels.once says where state is guarded instead).
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
    if torch.compiler.is_compiling():
        # dynamo does not read an lru_cache: it traces the wrapped function into the graph (and warns that this is
        # only right for a pure function, which this is). Calling the construction itself traces the same ops without
        # the warning; a graph holds no cache of its own to guard on (a dict here made dynamo recompile, fe20631).
        h = _hadamard_cpu.__wrapped__(dim, dtype)
        return h if device is None else h.to(device)
    h = _hadamard_cpu(dim, dtype)
    return h if device is None or torch.device(device) == h.device else _hadamard_on(dim, dtype, torch.device(device))


@functools.lru_cache(maxsize=32)  # process-wide, frozen once made (see _hadamard_cpu)
def _hadamard_on(dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _hadamard_cpu(dim, dtype).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` in float32 (what gets quantized): ``[..., D]`` -> ``[..., D]`` float32."""
    return x.float() @ hadamard(x.shape[-1], torch.float32, x.device)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` in float32 by the fast Walsh-Hadamard transform (what the stores quantize): ``[..., D]`` -> ``[..., D]``.

    Butterflies over channel pairs at distance 1, 2, 4, ... within each Hadamard block (``(a, b) -> (a + b, a - b)``),
    then one multiply by ``1 / sqrt(b)`` (``b`` = :func:`hadamard_block`): the same numbers as :func:`rotate` up to
    float rounding (fewer roundings than a matrix product's ``D``-term sums), in the order the Triton append kernel
    (:mod:`hf_asymkv.kernels.triton_append`) computes them in registers, so that both store the same codes to the bit.
    """
    d = x.shape[-1]
    block = hadamard_block(d)
    y, step = x.float(), 1
    while step < block:
        a, b = y.reshape(*y.shape[:-1], d // (2 * step), 2, step).unbind(-2)
        y = torch.stack([a + b, a - b], dim=-2).reshape(x.shape)
        step *= 2
    return y * (1 / math.sqrt(block))


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """``y @ H^T`` in ``y``'s dtype: the inverse of :func:`rotate`. ``[..., D]`` -> ``[..., D]``."""
    return y @ hadamard(y.shape[-1], y.dtype, y.device).T


@functools.lru_cache(maxsize=32)  # process-wide, frozen once made (see _hadamard_cpu)
def _signs_cpu(dim: int) -> torch.Tensor:
    """``S = sqrt(b) H`` as int8 (entries -1, 0, +1; ``b`` the block size), transposed for ``c @ S^T``."""
    block = hadamard_block(dim)
    return (_hadamard_cpu(dim, torch.float64) * math.sqrt(block)).round().to(torch.int8).T.contiguous()


@torch.library.custom_op("hf_asymkv::signs_product", mutates_args=())
def signs_product(ints: torch.Tensor) -> torch.Tensor:
    """``c @ S^T`` for int8 codes ``[N, D]``: the exact int32 ``[N, D]`` product (``torch._int_mm``).

    An operator of its own so that a compiled graph calls this kernel: inductor lowers ``_int_mm`` on a CPU to
    generated code ~15x slower at these shapes (3968 tokens x 3 heads, head_dim 64: 4.1 ms against 0.26 ms, one
    thread; a float32 product in the graph was no faster).
    """
    return torch._int_mm(ints, _signs_cpu(ints.shape[-1]))


@signs_product.register_fake
def _(ints: torch.Tensor) -> torch.Tensor:
    return ints.new_empty(ints.shape, dtype=torch.int32)


def _int8_token_codes(codes: PackedCodes, spec: QuantSpec) -> bool:
    """Per-token integer codes that fit int8, on a CPU with int8 matmuls (what both integer read-outs need)."""
    return (codes.device.type == "cpu" and hasattr(torch, "_int_mm") and not spec.is_float and spec.bits <= 7
            and spec.granularity == "token")


def _integer_path(codes: PackedCodes, spec: QuantSpec, head_dim: int) -> bool:
    """Per-token codes, one group per token, that fit int8, on a CPU with int8 matmuls."""
    return _int8_token_codes(codes, spec) and spec.group_size == head_dim


def _grouped_integer_path(codes: PackedCodes, spec: QuantSpec, head_dim: int) -> bool:
    """Per-token codes in several groups per token (Gemma's head_dim 256 in groups of 128), each group a power of two
    within one Hadamard block, that fit int8, on a CPU with int8 matmuls, outside a compiled graph."""
    group = spec.group_size
    return (_int8_token_codes(codes, spec) and 16 <= group < head_dim and group & (group - 1) == 0
            and hadamard_block(head_dim) % group == 0 and not torch.compiler.is_compiling())


def _dequantize_rotated_groups(codes: PackedCodes, scale: torch.Tensor, zero: torch.Tensor | None,
                               spec: QuantSpec, out: torch.Tensor | None = None) -> torch.Tensor:
    """``dequantize(...) @ H^T`` float32 ``[B, H, T, D]`` for codes with one scale per group of ``G`` channels.

    The Sylvester block ``H_b`` (``b`` the Hadamard block, a multiple of ``G``) is ``H_n (x) H_G / sqrt(b)`` with
    ``n = b / G`` and ``H_n``, ``H_G`` of +-1 entries, so a block's ``y @ H_b^T`` is, for its output group ``j``,
    ``sum_i H_n[i, j] (y_i @ H_G) / sqrt(b)``. Each group's codes go through ``H_G`` as one exact int8 product
    (``c_i @ S_G``), are scaled by their own scale, get their zero's share (``z_i G`` on the group's first column:
    ``ones @ H_G`` is ``G e_0``), and are then combined across the ``n`` groups of a block in float32 by
    butterflies. The generic path (``dequantize`` then :func:`unrotate`) computes the same numbers with a float
    product, about twice as slowly (Gemma-3's values at 32k tokens). ``out``: a float32 ``[B, H, T, D]`` destination
    (rows contiguous) that the last butterflies write into."""
    (b, h, t), d = codes.data.shape[:3], codes.head_dim
    group, block = spec.group_size, hadamard_block(d)
    n = block // group
    ints = integer_codes(codes, spec).view(torch.int8).reshape(-1, group)
    mixed = torch._int_mm(ints, _signs_cpu(group)).view(b, h, t, d // group, group).float()
    mixed.mul_(scale.float().reshape(b, h, t, d // group, 1) / math.sqrt(block))
    if zero is not None:
        mixed[..., 0].add_(zero.float().reshape(b, h, t, d // group) * (group / math.sqrt(block)))
    step = 1
    while step < n:  # H_n by butterflies over groups at distance 1, 2, ... (a, b) -> (a + b, a - b), into a new buffer
        shape = (d // (2 * step * group), 2, step, group)
        pairs = mixed.view(b, h, t, *shape)
        last = step * 2 >= n and out is not None
        combined = out.unflatten(-1, shape) if last else torch.empty_like(pairs)
        torch.add(pairs[..., 0, :, :], pairs[..., 1, :, :], out=combined[..., 0, :, :])
        torch.sub(pairs[..., 0, :, :], pairs[..., 1, :, :], out=combined[..., 1, :, :])
        mixed, step = combined, step * 2
    if out is None:
        return mixed.reshape(b, h, t, d)
    return out if n > 1 else out.copy_(mixed.view(b, h, t, d))


def dequantize_rotated(codes: PackedCodes, scale: torch.Tensor, zero: torch.Tensor | None, spec: QuantSpec, *,
                       dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode codes of ``x @ H`` back to ``x``: ``dequantize(...) @ H^T``, ``[B, H, T, D]`` in ``dtype``.

    Args: as :func:`~hf_asymkv.core.quant.dequantize` (``out``: an optional ``[B, H, T, D]`` destination).
    """
    b, h, t, _ = codes.data.shape
    head_dim = codes.head_dim
    if _grouped_integer_path(codes, spec, head_dim):
        direct = out is not None and out.dtype == torch.float32
        grouped = _dequantize_rotated_groups(codes, scale, zero, spec, out=out if direct else None)
        if direct:
            return out
        return grouped.to(dtype) if out is None else out.copy_(grouped)
    if not _integer_path(codes, spec, head_dim):
        region = dequantize(codes, scale, zero, spec, dtype=dtype)
        rotated_back = unrotate(region)
        return rotated_back if out is None else out.copy_(rotated_back)
    block = hadamard_block(head_dim)
    if out is None and dtype == torch.float32:
        out = torch.empty(b, h, t, head_dim, dtype=dtype, device=codes.device)
    if out is not None and native_readout(out, codes, spec):  # one native pass, the same arithmetic as below
        return cpu_readout.read_rotated(
            out, codes.data, bits=spec.bits, tokens_layout=codes.layout == "tokens", block_size=codes.block_size,
            offset=storage_offset(spec), row_scale=(scale.float() / math.sqrt(block))[..., 0],
            row_zero=None if zero is None else (zero.float() * math.sqrt(block))[..., 0], hadamard=block)
    ints = integer_codes(codes, spec).view(torch.int8).view(-1, head_dim)
    # exact; eagerly ATen's kernel is called directly (the operator's Python dispatch adds ~15 us per call)
    product = signs_product(ints) if torch.compiler.is_compiling() else torch._int_mm(ints, _signs_cpu(head_dim))
    product = product.view(b, h, t, head_dim)
    # float32 arithmetic (half-precision outputs get one final rounding: the zero term and the product's first
    # column nearly cancel, which a half-precision intermediate would turn into a large relative error); a float32
    # ``out`` is the work tensor itself
    direct = out is not None and out.dtype == torch.float32
    work = out.copy_(product) if direct else product.float()
    work.mul_(scale.float() / math.sqrt(block))
    if zero is not None:  # 1 H^T: sqrt(b) in each block's first column, 0 elsewhere
        work[..., ::block].add_(zero.float() * math.sqrt(block))
    if direct:
        return out
    return work.to(dtype) if out is None else out.copy_(work)
