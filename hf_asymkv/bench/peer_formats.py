"""The peers' KV quantizers as pure tensor functions: codes and scales exactly as each format defines them.

Every function here follows one published definition (cited in its docstring, with the file in the peer's
repository); :mod:`hf_asymkv.bench.peers` turns them into transformers cache layers. Each ``*_codes`` function
returns what the engine stores (integer codes and scales in the engine's scale dtype) and each ``dequantize_*``
maps them back to floats, so tests can check the codes and scales themselves, not only the round trip.

Rounding is the peer's own: llama.cpp's q4_0 truncates ``x / d + 8.5`` (round half up), q8_0 rounds to nearest,
KIVI rounds to nearest after ``(x - min) / scale``, vLLM's Triton kernels add 0.5 and truncate.
"""

from __future__ import annotations

import torch

from ..core.quant import FP8_E4M3_MAX
from ..core.rotation import hadamard as block_hadamard

__all__ = [
    "FP8_E4M3_MAX",
    "LLAMA_BLOCK",
    "asym_uniform_codes",
    "dequantize_asym_uniform",
    "dequantize_int4_per_token_head",
    "dequantize_q4_0",
    "dequantize_q8_0",
    "fp8_per_tensor",
    "hadamard",
    "int4_per_token_head_codes",
    "int8_per_token_head_codes",
    "q4_0_codes",
    "q8_0_codes",
    "random_signs",
]

LLAMA_BLOCK = 32
"""llama.cpp ``QK8_0`` / ``QK4_0``: values per block (``ggml/src/ggml-common.h``)."""


def hadamard(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix ``[n, n]`` (``H @ H.T = I``, symmetric), ``n`` a power of two: the
    core's matrix (:func:`hf_asymkv.core.rotation.hadamard`), limited to the sizes the peers' rotations take (the
    core's block-diagonal form for other sizes is not theirs).

    Raises:
        ValueError: ``n`` is not a power of two.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {n}")
    return block_hadamard(n, dtype)


def random_signs(n: int, seed: int = 0) -> torch.Tensor:
    """A fixed ``[n]`` vector of +-1 (float64): the diagonal of a randomized Hadamard transform ``H @ diag(s)``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` -> ``[..., n / 32, 32]`` float32 (llama.cpp quantizes float32 rows)."""
    if x.shape[-1] % LLAMA_BLOCK:
        raise ValueError(f"llama.cpp blocks need a row length divisible by {LLAMA_BLOCK}, got {x.shape[-1]}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // LLAMA_BLOCK, LLAMA_BLOCK)


def q8_0_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp ``q8_0``: ``d = amax / 127`` per 32-value block stored as fp16, ``q = round(x / d)`` int8.

    Defined by ``quantize_row_q8_0_ref`` in ``ggml/src/ggml-quants.c`` (``block_q8_0`` in ``ggml-common.h``:
    one ``ggml_half d`` and 32 ``int8_t``, 34 bytes per 32 values = 8.5 bits/value).

    Args:
        x: ``[..., n]`` with ``n`` divisible by 32.

    Returns:
        ``(codes int8 [..., n/32, 32], d float16 [..., n/32])``.
    """
    b = _blocks(x)
    d = b.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = torch.round(b * inv[..., None]).to(torch.int8)
    return codes, d.to(torch.float16)


def dequantize_q8_0(codes: torch.Tensor, d: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``codes * d`` back to float32 ``shape`` (``dequantize_row_q8_0``)."""
    return (codes.float() * d.float()[..., None]).reshape(shape)


def q4_0_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp ``q4_0``: per 32-value block, ``d = max / -8`` where ``max`` is the value of largest magnitude
    *with its sign*; codes ``min(15, trunc(x / d + 8.5))`` in 0..15 (offset 8), ``d`` stored as fp16.

    Defined by ``quantize_row_q4_0_ref`` in ``ggml/src/ggml-quants.c`` (``block_q4_0``: one ``ggml_half d`` and
    16 bytes of nibbles, 18 bytes per 32 values = 4.5 bits/value). The signed ``max / -8`` puts the extreme
    value exactly on code 0 (``-8 * d = max``), so the asymmetric code range -8..7 loses no level on it.

    Returns:
        ``(codes uint8 in [0, 15] [..., n/32, 32], d float16 [..., n/32])``.
    """
    b = _blocks(x)
    idx = b.abs().argmax(-1, keepdim=True)
    d = torch.gather(b, -1, idx).squeeze(-1) / -8
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    # C's (int8_t) cast truncates toward zero; x / d + 8.5 >= 0.5 > 0 here, so trunc == floor.
    codes = torch.clamp(torch.trunc(b * inv[..., None] + 8.5), max=15).to(torch.uint8)
    return codes, d.to(torch.float16)


def dequantize_q4_0(codes: torch.Tensor, d: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``(codes - 8) * d`` back to float32 ``shape`` (``dequantize_row_q4_0``)."""
    return ((codes.float() - 8) * d.float()[..., None]).reshape(shape)


def int8_per_token_head_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``int8_per_token_head``: symmetric int8 with one float32 scale ``max(amax / 127, 1e-6)`` per
    (token, head) over head_dim; codes ``round(x / scale)`` clamped to [-128, 127].

    Defined by the Triton per-token-head reshape-and-cache kernel
    (``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py``) and its reference in
    ``tests/quantization/test_per_token_kv_cache.py`` (``INT8_CONFIG``: int8 cache, float32 scales).

    Args:
        x: ``[..., head_dim]``.

    Returns:
        ``(codes int8 [..., head_dim], scale float32 [...])``.
    """
    scale = (x.float().abs().amax(-1) / 127).clamp_min(1e-6)
    codes = torch.round(x.float() / scale[..., None]).clamp(-128, 127).to(torch.int8)
    return codes, scale


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """The Triton kernels' ``where(x >= 0, trunc(x + 0.5), trunc(x - 0.5))``."""
    return torch.where(x >= 0, torch.trunc(x + 0.5), torch.trunc(x - 0.5))


def int4_per_token_head_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``int4_per_token_head`` (on already rotated input): asymmetric 4-bit per (token, head) over head_dim.

    ``scale = max((max - min) / 15, 1e-6)``, zero point ``zp = clamp(round(-min / scale), 0, 15)``, codes
    ``clamp(round(x / scale + zp), 0, 15)`` (round half away from zero). The zero point is stored in the
    low 4 mantissa bits of the float32 scale (``(bits & ~0xF) | zp``), so each (token, head) costs
    head_dim / 2 bytes of nibbles + 4 bytes. Defined by ``_reshape_cache_int4_kernel`` in
    ``vllm/v1/attention/ops/int4_per_token_head.py``.

    Returns:
        ``(codes uint8 in [0, 15] [..., head_dim], packed scale float32 [...])``.
    """
    x = x.float()
    lo, hi = x.amin(-1), x.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-6)
    zp = _round_half_away(-lo / scale).clamp(0, 15)
    codes = _round_half_away(x / scale[..., None] + zp[..., None]).clamp(0, 15).to(torch.uint8)
    bits = scale.view(torch.int32)
    packed = ((bits & -16) | zp.to(torch.int32)).view(torch.float32)
    return codes, packed


def dequantize_int4_per_token_head(codes: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``(codes - zp) * scale`` with ``zp`` and the truncated scale unpacked from the float32 word."""
    bits = packed.view(torch.int32)
    zp = (bits & 0xF).float()
    scale = (bits & -16).view(torch.float32)
    return (codes.float() - zp[..., None]) * scale[..., None]


def asym_uniform_codes(x: torch.Tensor, bits: int, dim: int, *, half_up: bool = False, eps: float = 0.0
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min-max asymmetric uniform codes over ``dim`` (KIVI's groups, TurboQuant's values).

    ``scale = (max - min) / (2^bits - 1)`` (at least ``eps``), codes ``clamp(round((x - min) / scale))``;
    ``half_up`` rounds as ``trunc(. + 0.5)`` (vLLM's Triton store) instead of to nearest even (torch, KIVI).

    Returns:
        ``(codes uint8, scale, min)`` with ``scale``/``min`` keeping ``dim`` as size 1, float32.
    """
    x = x.float()
    levels = 2**bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / levels).clamp_min(eps)
    scaled = (x - lo) / torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.trunc(scaled + 0.5) if half_up else torch.round(scaled)
    return codes.clamp(0, levels).to(torch.uint8), scale, lo


def dequantize_asym_uniform(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale + lo


def fp8_per_tensor(x: torch.Tensor, scale: float) -> torch.Tensor:
    """vLLM ``fp8`` / ``fp8_e4m3`` with a per-tensor scale: ``e4m3(clamp(x / scale, +-448)) * scale``, float32.

    The scale is the dequant multiplier (``amax / 448`` of calibration data; ``k_scale``/``v_scale`` in a
    checkpoint or ``--calculate-kv-scales``, ``vllm/config/cache.py``). Values beyond the calibrated range
    saturate at +-448 (vLLM's scaled FP8 conversion clamps to the format's range).
    """
    y = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return y.to(torch.float8_e4m3fn).float() * scale
