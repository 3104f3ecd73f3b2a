"""Quantization primitives: pure tensor functions, no transformers import.

Every scheme the cache can store is one :class:`QuantSpec`: a number format, a granularity that says which
elements share a scale, the group size along ``head_dim`` for per-token groups and the block of tokens that is
quantized (and packed) as one unit. All functions take cache
tensors shaped ``[batch, kv_heads, tokens, head_dim]`` and return codes plus scale/zero tensors shaped for
broadcasting over ``[batch, kv_heads, tokens // token_group, token_group, head_dim // channel_group,
channel_group]``: one view, one multiply(-add), whatever the granularity. That is what keeps dequantization a
single vectorized op per layer.

Granularities (``token_group`` x ``channel_group`` elements share a scale):

- ``"channel"``: one scale per (head, channel) per block of ``spec.block_size`` tokens (KIVI-style keys).
- ``"token"``: one scale per token per ``group_size`` channels (values).
- ``"tensor"``: one scale per block of tokens for all heads and channels (the per-tensor baseline, made
  append-only by giving each block its own scale).

Sub-byte codes (1 to 6 bits) are packed by :mod:`hf_asymkv.core.packing`; :func:`quantize` returns them as
:class:`~hf_asymkv.core.packing.PackedCodes`, which records whether their bytes run along each block's tokens or
along ``head_dim``, so no reader ever infers it.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass

import torch

from ..kernels import cpu_readout
from .packing import PackedCodes, pack_codes, packs_tokens, plane_widths, unpack_codes
from .rounding import round_down, round_up
from .wide import WideBits, add_wide_codes

__all__ = [
    "FORMATS",
    "FP8_E4M3_MAX",
    "GRANULARITIES",
    "QuantSpec",
    "scale_from_absmax",
    "compute_scale_zero",
    "quantize",
    "dequantize",
    "code_levels",
    "decode_codes",
    "integer_codes",
    "native_readout",
    "storage_offset",
    "needs_wider_metadata",
    "sqnr_db",
    "tree_sum",
]

# name -> (bits, is_float). Float formats map onto torch's float8 dtypes.
FORMATS: dict[str, tuple[int, bool]] = {
    "int8": (8, False),
    "int6": (6, False),
    "int5": (5, False),
    "int4": (4, False),
    "int3": (3, False),
    "int2": (2, False),
    "int1": (1, False),
    "fp8_e4m3": (8, True),
    "fp8_e5m2": (8, True),
}
GRANULARITIES = ("channel", "token", "tensor")
_FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
"""Largest finite FP8-E4M3 value (448): vLLM-style per-tensor scales are ``amax / FP8_E4M3_MAX``."""


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor (K or V) is stored.

    Args:
        fmt: one of :data:`FORMATS`.
        granularity: one of :data:`GRANULARITIES`.
        group_size: channels sharing a scale for ``"token"`` granularity (must divide ``head_dim``); ignored
            otherwise.
        symmetric: symmetric (scale only, zero at 0) or asymmetric (scale + zero = group minimum). Float
            formats are always symmetric.
        scale_dtype: storage dtype of scales and zeros. Scales are rounded *up* and zeros *down* into it, and
            codes are computed against the stored values, so rounding the metadata never clips (as long as the
            range fits: a scale or zero beyond ``scale_dtype``'s finite range is clamped to it, e.g. |x| above
            ~65504 * qmax with float16 scales, and the elements past it saturate).
        rotated: the codes hold ``x @ H`` (an orthonormal Hadamard rotation along ``head_dim``, see
            :mod:`hf_asymkv.core.rotation`), not ``x``; whoever stores or reads them applies ``H`` / ``H^T``. The
            functions of this module quantize whatever they are given and ignore it.
        block_size: tokens quantized as one unit: the tokens sharing a scale for ``"channel"`` and ``"tensor"``
            granularity, and the unit of token packing of sub-byte codes (see :mod:`hf_asymkv.core.packing`).
        wide_fraction: the share of each block's channels (per head) whose codes get one more bit, chosen by the
            block's own ranges (:mod:`hf_asymkv.core.wide`; :meth:`wide_count` channels); 0 for none. Needs
            int2/int3/int4 codes per channel, unrotated.
    """

    fmt: str
    granularity: str
    group_size: int | None = None
    symmetric: bool = True
    scale_dtype: torch.dtype = torch.float16
    rotated: bool = False
    block_size: int = 1
    wide_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"Unknown quantization format {self.fmt!r}; allowed: {sorted(FORMATS)}.")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"Unknown granularity {self.granularity!r}; allowed: {list(GRANULARITIES)}.")
        if self.granularity == "token" and (self.group_size is None or self.group_size < 1):
            raise ValueError(f"'token' granularity needs a positive group_size, got {self.group_size!r}.")
        if self.is_float and not self.symmetric:
            raise ValueError(f"Float format {self.fmt!r} is symmetric only; got symmetric=False.")
        if self.bits == 1 and (self.symmetric or self.granularity == "tensor"):
            raise ValueError("int1 codes are asymmetric, per 'token' or 'channel' (two levels fitted to each group); "
                             f"got symmetric={self.symmetric}, granularity={self.granularity!r}.")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}.")
        wide = self.wide_fraction
        if isinstance(wide, bool) or not isinstance(wide, (int, float)) or not 0 <= wide < 1:
            raise ValueError(f"wide_fraction must be a number in [0, 1), got {wide!r}.")
        if wide and (self.is_float or self.bits > 4 or self.granularity != "channel" or self.rotated):
            raise ValueError(f"wide_fraction={wide} needs int2, int3 or int4 codes per 'channel', unrotated; got "
                             f"{self.fmt} per {self.granularity!r}" + (", rotated" if self.rotated else "") + ".")

    @property
    def bits(self) -> int:
        return FORMATS[self.fmt][0]

    @property
    def is_float(self) -> bool:
        return FORMATS[self.fmt][1]

    @property
    def qmax(self) -> float:
        """Largest code magnitude: 448 for E4M3, 57344 for E5M2, 127 for symmetric int8, 15 for asym int4."""
        if self.is_float:
            return float(torch.finfo(_FP8_DTYPES[self.fmt]).max)
        return float(2 ** (self.bits - 1) - 1) if self.symmetric else float(2**self.bits - 1)

    @property
    def code_dtype(self) -> torch.dtype:
        if self.is_float:
            return _FP8_DTYPES[self.fmt]
        return torch.int8 if self.bits == 8 and self.symmetric else torch.uint8

    @property
    def layout(self) -> str:
        """How :func:`quantize` packs whole blocks of codes: ``"tokens"`` or ``"head_dim"``
        (:data:`~hf_asymkv.core.packing.CODE_LAYOUTS`)."""
        return "tokens" if packs_tokens(self.bits, self.block_size) else "head_dim"

    @property
    def token_group(self) -> int:
        """Tokens sharing a scale: ``block_size`` for ``"channel"``/``"tensor"`` granularity, 1 for ``"token"``."""
        return 1 if self.granularity == "token" else self.block_size

    def to_text(self) -> str:
        """The spec as text, ``name=value`` pairs (the scale dtype by name): a constant a compiled graph can carry
        (written with f-strings only, so that it is traced where a store allocates inside a graph), the same in
        every process. :meth:`from_text` reads it back."""
        dtype = str(self.scale_dtype).removeprefix("torch.")
        return (f"fmt={self.fmt!r};granularity={self.granularity!r};group_size={self.group_size!r};"
                f"symmetric={self.symmetric!r};scale_dtype={dtype!r};rotated={self.rotated!r};"
                f"block_size={self.block_size!r};wide_fraction={self.wide_fraction!r}")

    @classmethod
    def from_text(cls, text: str) -> QuantSpec:
        """The spec :meth:`to_text` wrote (validated as any spec is).

        Raises:
            ValueError: text that is not ``name=value`` pairs of the spec's fields.
        """
        try:
            fields = {name: ast.literal_eval(value) for name, value in (pair.split("=", 1) for pair in text.split(";"))}
            fields["scale_dtype"] = getattr(torch, fields["scale_dtype"])
            return cls(**fields)
        except (ValueError, SyntaxError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a QuantSpec written by to_text(): {text!r} ({exc})") from None

    def groups(self, head_dim: int) -> tuple[int, int]:
        """``(token_group, channel_group)``: how many tokens and channels share one scale."""
        if self.granularity == "channel":
            return self.block_size, 1
        if self.granularity == "tensor":
            return self.block_size, head_dim
        if head_dim % self.group_size:
            raise ValueError(f"group_size={self.group_size} does not divide head_dim={head_dim}.")
        return 1, self.group_size

    def wide_count(self, head_dim: int) -> int:
        """Wide channels per block and head: ``wide_fraction`` of ``head_dim``, rounded, at least 1 (0 without)."""
        return max(1, int(head_dim * self.wide_fraction + 0.5)) if self.wide_fraction else 0

    def packed_dim(self, head_dim: int) -> int:
        """Size of the last axis of the stored codes (sub-byte codes are packed along ``head_dim``)."""
        if self.wide_fraction and head_dim > 256:
            raise ValueError(f"wide channels are indexed in bytes: head_dim={head_dim} is above 256.")
        if self.is_float or self.bits == 8:
            return head_dim
        multiple = 8 // min(plane_widths(self.bits))
        if head_dim % multiple:
            raise ValueError(f"head_dim={head_dim} must be a multiple of {multiple} to pack {self.bits}-bit codes.")
        return head_dim * self.bits // 8


def _grouped(x: torch.Tensor, tg: int, cg: int) -> torch.Tensor:
    """View ``[B, H, T, D]`` as ``[B, H, T // tg, tg, D // cg, cg]`` (a true view: splitting axes never copies,
    so writes through the result land in ``x``, slices of a larger buffer included)."""
    b, h, t, d = x.shape
    return x.view(b, h, t // tg, tg, d // cg, cg)


def scale_from_absmax(amax: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Symmetric scale for a given range: ``amax / qmax``, strictly positive, rounded up into ``scale_dtype``.

    Used for measured ranges and for calibrated ones (e.g. a calibrated per-channel K absmax).
    """
    tiny = torch.finfo(spec.scale_dtype).tiny
    return round_up((amax.float() / spec.qmax).clamp(min=tiny), spec.scale_dtype)


def compute_scale_zero(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero for asymmetric specs) for ``x``.

    1-bit codes (``int1``, asymmetric only) get no range: their two levels (``zero`` and ``zero + scale``) are
    fitted to the group by :func:`_two_means`.

    Non-finite elements count as 0 when measuring the range: they never widen it beyond 0, and a group that has
    one always covers 0, so NaN (encoded as the value 0) decodes to within half a step of 0 and +-inf saturate
    to the group's extremes in :func:`quantize`.

    Args:
        x: ``[B, H, T, D]`` floating tensor; ``T`` a multiple of ``spec.block_size`` for block granularities.
        spec: the storage spec.

    Returns:
        ``(scale, zero)`` each ``[B, H, T // tg, D // cg]`` in ``spec.scale_dtype``; ``zero`` is None for
        symmetric specs. ``scale`` is strictly positive.
    """
    tg, cg = spec.groups(x.shape[-1])
    xf = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0)
    g = _grouped(xf, tg, cg)
    tiny = torch.finfo(spec.scale_dtype).tiny
    if spec.symmetric:
        amax = g.abs().amax(dim=(3, 5), keepdim=True)
        if spec.granularity == "tensor":
            amax = amax.amax(dim=1, keepdim=True).expand_as(amax)
        return scale_from_absmax(amax, spec)[:, :, :, 0, :, 0], None
    if spec.bits == 1:
        return _two_means(g, spec)
    lo = g.amin(dim=(3, 5), keepdim=True)
    hi = g.amax(dim=(3, 5), keepdim=True)
    if spec.granularity == "tensor":
        lo = lo.amin(dim=1, keepdim=True).expand_as(lo)
        hi = hi.amax(dim=1, keepdim=True).expand_as(hi)
    zero = round_down(lo, spec.scale_dtype)
    scale = round_up(((hi - zero.float()) / spec.qmax).clamp(min=tiny), spec.scale_dtype)
    return scale[:, :, :, 0, :, 0], zero[:, :, :, 0, :, 0]


TWO_MEANS_STEPS = 3
"""Lloyd steps of the 1-bit encoder (:func:`_two_means`). On Gaussian groups of 64 (what rotated values look like)
the squared error after 3 steps is 0.15% above where 30 steps converge (0.3452 against 0.3447 of the variance; 1
step: 0.3480); a few groups' levels are still moving (by 0.7% of their gap on average, up to 24%)."""


def _two_means(g: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero of 1-bit codes: the two levels of each group (``zero`` and ``zero + scale``) are the means
    of its elements below and above a threshold, the threshold starting at the group mean and moved to the
    levels' midpoint :data:`TWO_MEANS_STEPS` times (Lloyd's algorithm for two levels, the least squared error a
    1-bit code with two free levels can reach from that start). A min-max range would put both levels at the
    extremes and decode every ordinary element a half range off.

    Group sums are taken in one fixed order (:func:`tree_sum`), the one the Triton append kernel
    (:mod:`hf_asymkv.kernels.triton_append`) uses, so that both store the same levels to the bit.

    ``g`` is ``[B, H, N, tg, M, cg]`` float32 (non-finite elements already 0); returns ``[B, H, N, M]`` each, in
    ``spec.scale_dtype``, rounded to nearest (a 1-bit code saturates by design: no range to keep) and clamped to
    its finite range (levels beyond it saturate, as the other formats' ranges do)."""
    b, h, n, tg, m, cg = g.shape
    size = tg * cg  # elements per group
    flat = g.permute(0, 1, 2, 4, 3, 5).reshape(b, h, n, m, size)  # each group's elements in (token, channel) order
    total = tree_sum(flat)
    threshold = total / size
    for _ in range(TWO_MEANS_STEPS):
        upper = flat > threshold
        n_up = upper.sum(dim=-1, keepdim=True)
        sum_up = tree_sum(torch.where(upper, flat, 0.0))
        high = torch.where(n_up > 0, sum_up / n_up.clamp(min=1), threshold)
        low = torch.where(n_up < size, (total - sum_up) / (size - n_up).clamp(min=1), threshold)
        threshold = (low + high) / 2
    finfo = torch.finfo(spec.scale_dtype)
    zero = low.clamp(finfo.min, finfo.max).to(spec.scale_dtype)  # finite: levels past the range saturate
    scale = (high - zero.float()).clamp(finfo.tiny, finfo.max).to(spec.scale_dtype)
    return scale[..., 0], zero[..., 0]


def tree_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis in a fixed order: the first half added to the second half, again and again (zeros pad
    the axis to a power of two): ``[..., n]`` -> ``[..., 1]``. A reduction's order is otherwise the library's
    (vectorized partial sums on a CPU, a tree on a GPU), and float sums in different orders differ in their last
    bits."""
    n = v.shape[-1]
    padded = 1 << max(0, n - 1).bit_length()
    if padded != n:
        v = torch.nn.functional.pad(v, (0, padded - n))
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v


def _bcast(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, G_t, G_c]`` -> ``[B, H, G_t, 1, G_c, 1]``."""
    return t[:, :, :, None, :, None]


def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: QuantSpec) -> PackedCodes:
    """Encode ``x`` with the given scale/zero.

    Values beyond the representable range saturate. +-inf saturate to the group's largest / smallest
    representable value, which is >= 0 / <= 0 (such a group's range covers 0, see :func:`compute_scale_zero`).
    NaN encodes as the value 0, i.e. as the code nearest 0: it decodes to exactly 0 for symmetric specs and to
    within half a step of 0 for asymmetric ones, not to the group minimum.

    Args:
        x: ``[B, H, T, D]``.
        scale, zero: from :func:`compute_scale_zero` (or calibrated), ``[B, H, T // tg, D // cg]``.

    Returns:
        :class:`~hf_asymkv.core.packing.PackedCodes`, data ``[B, H, T, spec.packed_dim(D)]`` of ``spec.code_dtype``:
        whole blocks in ``spec.layout``, other token counts along ``head_dim``.
    """
    y = code_levels(x, scale, zero, spec)
    if spec.is_float or spec.bits == 8:
        return pack_codes(y.to(spec.code_dtype), spec.bits, spec.block_size)
    return pack_codes(y.add_(storage_offset(spec)).to(torch.uint8), spec.bits, spec.block_size)


def code_levels(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """What :func:`quantize` stores, before the storage offset and packing: float32 ``[B, H, T, D]`` holding the
    integer codes (``[-qmax, qmax]`` symmetric, ``[0, qmax]`` asymmetric) or, for float formats, the scaled values
    clamped to ``+-qmax``. NaN and inf as :func:`quantize` documents."""
    tg, cg = spec.groups(x.shape[-1])
    xf = x.float()
    xf = torch.where(torch.isnan(xf), 0.0, xf)  # NaN -> the value 0 (before the zero shift: asymmetric too)
    g = _grouped(xf, tg, cg)
    if zero is not None:
        g = g - _bcast(zero).float()
    y = (g / _bcast(scale).float()).reshape(x.shape)
    y = torch.nan_to_num(y, nan=0.0)
    if spec.is_float:
        return y.clamp(-spec.qmax, spec.qmax)
    lo = -spec.qmax if spec.symmetric else 0.0
    return y.round_().clamp_(lo, spec.qmax)


def storage_offset(spec: QuantSpec) -> int:
    """What is added to a symmetric sub-byte code so that it packs unsigned (``2**(bits-1)``); 0 otherwise."""
    return 2 ** (spec.bits - 1) if spec.symmetric and not spec.is_float and spec.bits < 8 else 0


def dequantize(
    codes: PackedCodes,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    spec: QuantSpec,
    *,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    wide: WideBits | None = None,
) -> torch.Tensor:
    """Decode codes back to ``dtype``: codes are converted straight into the output, then scaled in place.

    Args:
        codes: from :func:`quantize` (``[B, H, T, packed_dim]`` data).
        scale, zero: ``[B, H, T // tg, D // cg]``.
        dtype: output dtype (the model's); arithmetic runs in it.
        out: optional ``[B, H, T, D]`` destination (e.g. a slice of the dense K/V handed to attention).
        wide: the high code bits of the blocks' wide channels (a spec with ``wide_fraction``), folded into the codes.

    Returns:
        ``[B, H, T, D]`` tensor (``out`` when given).

    No temporary of the output's size is made: a mixed-dtype ``codes * scale`` would first copy the codes to
    ``dtype`` and then multiply; converting into ``out`` and multiplying in place does the same in two passes
    over ``out``, without the allocation. Sub-byte codes are unpacked in bytes first (:func:`decode_codes`). In float32 the result is exact to one
    rounding (``code * scale`` is exact for <= 8-bit codes and fp16/bf16 scales; ``+ zero`` rounds once). A float32
    output of integer codes on a CPU is written by the native read-out instead (:func:`native_readout`): one pass,
    the same bits.
    """
    if out is None:
        b, h, t, _ = codes.data.shape
        out = torch.empty(b, h, t, codes.head_dim, dtype=dtype, device=codes.device)
    head_dim = out.shape[-1]
    tg, cg = spec.groups(head_dim)
    if native_readout(out, codes, spec) and (wide is None or codes.layout == "head_dim"
                                             or codes.block_size == spec.block_size):
        offset = storage_offset(spec)  # float32 scale and zero: exactly `_factor`'s for a float32 output
        return cpu_readout.read_plain(
            out, codes.data, bits=spec.bits, tokens_layout=codes.layout == "tokens",
            block_size=codes.block_size if codes.layout == "tokens" else spec.block_size, offset=offset,
            scale=scale.float(), zero=None if zero is None else zero.float(), token_group=tg, channel_group=cg,
            wide_bits=None if wide is None else wide.bits, wide_channels=None if wide is None else wide.channels,
            wide_offset=offset)
    out = decode_codes(codes, spec, dtype=dtype, out=out, wide=wide)
    dest = _grouped(out, tg, cg)
    factor = _bcast(_factor(scale, dtype))
    if zero is None:
        dest.mul_(factor)
    elif cg == 1:  # one scale per channel: a fused multiply-add is one pass (PyTorch's CPU addcmul is slower than
        torch.addcmul(_bcast(_factor(zero, dtype)), dest, factor, out=dest)  # mul + add for row-broadcast scales)
    else:
        dest.mul_(factor).add_(_bcast(_factor(zero, dtype)))
    return out


def native_readout(out: torch.Tensor, codes: PackedCodes, spec: QuantSpec) -> bool:
    """Whether :mod:`hf_asymkv.kernels.cpu_readout` (one native pass, bit-identical to the torch read-out) decodes
    ``codes`` into ``out``: integer codes of ``spec``'s width, a float32 CPU ``out``, eager, and allowed by
    ``HF_ASYMKV_CPU_READOUT``."""
    if torch.compiler.is_compiling() or spec.is_float or codes.bits != spec.bits:
        return False
    return cpu_readout.use_native(out, codes.data, spec.bits, codes.head_dim)


def _factor(meta: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scale or zero as the multiplier for an output of ``dtype``.

    Cast to ``dtype`` (fast, same-dtype arithmetic), unless that would make a nonzero value subnormal, as bf16
    key scales below 6.1e-5 do in float16 (fp8_e5m2 scales of keys with |k| < 3.5, int8 scales of channels
    with |k| < 7.7e-3): then float32, so that the in-place product is computed in float32 and rounded once.
    """
    tiny = torch.finfo(dtype).tiny
    if tiny > torch.finfo(meta.dtype).tiny and (  # a graph cannot look at the values: float32 is right for all
            torch.compiler.is_compiling() or bool(((meta.abs() < tiny) & (meta != 0)).any())):
        return meta.float()
    return meta.to(dtype)


def needs_wider_metadata(x: torch.Tensor, spec: QuantSpec) -> bool:
    """Whether ``x``'s finite range overflows ``spec.scale_dtype`` as scale or zero (``|x|`` beyond half its
    largest finite value, e.g. 32752 for float16 metadata: an asymmetric zero of -1e5 would be clamped to
    -65504 and every value below it would decode wrong)."""
    if spec.scale_dtype == torch.float32:
        return False
    amax = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0).abs().amax()
    return bool(amax > torch.finfo(spec.scale_dtype).max / 2)


def decode_codes(codes: PackedCodes, spec: QuantSpec, *, dtype: torch.dtype = torch.float32,
                 out: torch.Tensor | None = None, wide: WideBits | None = None) -> torch.Tensor:
    """Stored codes -> the integer (or fp8) code values in ``dtype``, before scale and zero: ``[B, H, T, D]``.

    Sub-byte codes are unpacked into bytes (:func:`~hf_asymkv.core.packing.unpack_codes`, in the layout the codes
    carry), symmetric ones get their storage offset removed there, the wide channels' high bits (``wide``) are folded
    in, and one conversion writes ``out``. Integers up to 8 bits are exact in every float dtype.

    Raises:
        ValueError: codes of another width than ``spec``'s.
    """
    if codes.bits != spec.bits:
        raise ValueError(f"codes are {codes.bits}-bit, the spec ({spec.fmt}) reads {spec.bits}-bit codes.")
    b, h, t, _ = codes.data.shape
    if out is None:
        out = torch.empty(b, h, t, codes.head_dim, dtype=dtype, device=codes.device)
    if spec.is_float or spec.bits == 8:
        return out.copy_(codes.data)
    ints = integer_codes(codes, spec)
    return out.copy_(ints if wide is None else add_wide_codes(ints, wide, spec))


def integer_codes(codes: PackedCodes, spec: QuantSpec) -> torch.Tensor:
    """Integer codes of a sub-byte ``spec`` as bytes: ``[B, H, T, D]``, a new tensor, uint8 (asymmetric, codes in
    ``[0, 2**bits)``) or int8 (symmetric, the storage offset removed). Both fit int8 (at most 6 bits)."""
    ints = unpack_codes(codes)
    if spec.symmetric:  # stored with an offset of 2**(bits-1) so that the code packs as unsigned
        ints = ints.view(torch.int8).sub_(2 ** (spec.bits - 1))
    return ints


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(|x|^2 / |x - x_hat|^2)`` (inf when exact)."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum()
    if noise == 0:
        return math.inf
    return float(10 * torch.log10(ref.pow(2).sum() / noise))
