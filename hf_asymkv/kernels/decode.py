"""Decode attention over stored codes on a GPU (or CPU tensors under ``TRITON_INTERPRET=1``): the launcher.

:func:`decode_attention` splits the key sequence (one quantized region, up to two exact segments) into runs of
tiles, launches :func:`~hf_asymkv.kernels.triton_decode.partial_attention_kernel` once over all of them (one
program per batch row, KV head and split) and :func:`~hf_asymkv.kernels.triton_decode.merge_partials_kernel`
once to merge the splits: two launches per layer and step. :func:`plan_decode_attention` builds those launches
without making them (:class:`KernelLaunch`): the kernel report compiles them for a GPU it does not have
(:mod:`hf_asymkv.kernels.sass`). Importing this module imports Triton.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from dataclasses import dataclass

import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from .regions import (
    MAX_EXACT_SEGMENTS,
    MAX_TILE,
    MIN_TILE,
    ExactSegment,
    QuantizedRegion,
    StoredCodes,
    plane_sets,
    tile_tokens,
    unsupported,
)
from .triton_decode import (
    FP8_E4M3,
    FP8_E5M2,
    INT8,
    MASK_ADDITIVE,
    MASK_BOOL,
    MASK_CAUSAL,
    MASK_NONE,
    PACKED_HEAD_DIM,
    PACKED_TOKENS,
    merge_partials_kernel,
    partial_attention_kernel,
)

__all__ = ["INTERPRETED", "KernelLaunch", "LaunchConfig", "decode_attention", "launch_decode_attention",
           "pipeline_stages", "plan_decode_attention", "settle_spills", "spill_alternatives", "two_key_blocks"]

FAST_MAX_TILE = 128  # tokens per tile on the fast path: a key block of balanced and quality
MERGE_ELEMENTS = 4096  # a merge program holds (splits x channels) of one row: at most this many floats
MERGE_WARPS = 4
PROGRAMS_PER_SM = 4  # splits aim at this many programs per streaming multiprocessor: enough to hide latency
# Measured on one H200 (results/gpu/h200_tune, docs/gpu.md): with Triton's default of 3 pipeline stages the
# 64-token tile of float32 queries needs 264 KiB of shared memory (the card has 227) and bf16 runs 1.2-1.9x slower
# than the best of the sweep; 1 stage was fastest for 64-token tiles, 2 for 32-token tiles, both fit float32.
# 128-token tiles (the fast path's, quality and balanced; not measured on a GPU) take 1 stage like 64: with 2, the
# exact segments' bf16 tiles ask 129 KiB of shared memory (results/gpu/kernel_report.md), over sm_89's 99 KiB.
_STAGES_BY_TILE = {128: 1, 64: 1, 32: 2}
INTERPRETER_PROGRAMS = 1  # on CPU tensors (the interpreter runs programs one by one): one split per region
_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
INTERPRETED = not isinstance(partial_attention_kernel, JITFunction)
"""Whether the kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` when they were defined)."""


def decode_attention(query: torch.Tensor, scaling: float, *, quantized: QuantizedRegion | None = None,
                     exact: tuple[ExactSegment, ...] | list[ExactSegment] = (),
                     attention_mask: torch.Tensor | None = None, kv_len: int | None = None,
                     tiles_per_split: int | None = None) -> torch.Tensor:
    """Softmax attention of ``query`` over a quantized region and exact segments; returns ``[B, q, Hq, D]``.

    Args:
        query: ``[B, Hq, q, D]`` (any strides), float16, bfloat16 or float32; ``Hq`` a multiple of the KV heads.
        scaling: the softmax scale (``D ** -0.5`` for most models).
        quantized: the quantized K/V (codes as stored), or None.
        exact: at most :data:`~hf_asymkv.kernels.regions.MAX_EXACT_SEGMENTS` exact K/V segments (empty ones are
            skipped).
        attention_mask: ``[B|1, 1|Hq, q, kv_len]`` bool (True attends) or additive float; each region reads its
            columns ``[start, start + n)`` unless it has its own ``mask``. None: causal, query token ``i`` sees
            columns up to ``kv_len - q + i``.
        kv_len: the key axis length (default: the end of the last region).
        tiles_per_split: tiles one program reads (default: enough splits to fill the device).

    Raises:
        ValueError: a request the kernel cannot serve (:func:`~hf_asymkv.kernels.regions.unsupported` says what,
            more than two exact segments included), or no key at all.
    """
    segments = tuple(seg for seg in exact if seg.tokens)
    problem = unsupported(query, quantized, segments)
    if problem is not None:
        raise ValueError(f"the Triton decode attention cannot serve {problem}.")
    return launch_decode_attention(query, scaling, quantized=quantized, exact=segments, attention_mask=attention_mask,
                                   kv_len=kv_len, tiles_per_split=tiles_per_split)


def launch_decode_attention(query: torch.Tensor, scaling: float, *, quantized: QuantizedRegion | None,
                            exact: tuple[ExactSegment, ...], attention_mask: torch.Tensor | None = None,
                            kv_len: int | None = None, tiles_per_split: int | None = None,
                            launch: LaunchConfig | None = None) -> torch.Tensor:
    """:func:`decode_attention` for a request :func:`~hf_asymkv.kernels.regions.unsupported` has passed already
    (the core's glue checks once per call, to choose the backend): no second check on the decode step's path.
    ``launch`` overrides the launch settings (warps, pipeline stages, tile, programs per SM): for tuning."""
    launches, out = plan_decode_attention(query, scaling, quantized=quantized, exact=exact,
                                          attention_mask=attention_mask, kv_len=kv_len,
                                          tiles_per_split=tiles_per_split, launch=launch)
    partial, merge = launches
    if launch is None or launch.num_warps is None:
        partial = _spill_free(partial)
    for kernel_launch in (partial, merge):
        kernel_launch.kernel[kernel_launch.grid](*kernel_launch.args, **kernel_launch.options)
    return out


_SPILL_FREE: dict[tuple, int] = {}
"""Per process: a partial launch's options (as planned) -> the index, in :func:`spill_alternatives`, of the settings
its launches take (the first that compiled without spilling on this device). Process-wide and written after import:
guarded by :data:`_SPILL_LOCK` (one thread compiles a new entry's candidates, the others wait; reads need no lock).
Its keys are constexprs and launch settings, never lengths: it holds one entry per kernel variant the process ran."""
_SPILL_LOCK = threading.Lock()


def spill_alternatives(launch: KernelLaunch) -> tuple[KernelLaunch, ...]:
    """The partial-attention launch as planned, then what the launcher falls back to, in order, when the compiled
    kernel spills registers to local memory on the card: twice the warps, then 8 (the tile spread over more threads,
    fewer registers each). The kernel report measured the planned settings to issue the fewest instructions per byte
    where they do not spill (kernel_report.md); the fallbacks cover what its grid cannot foresee (other Triton
    versions, shapes it does not compile)."""
    warps = launch.options["num_warps"]
    found = [launch]
    for more in (2 * warps, 8):
        if more > found[-1].options["num_warps"] and more <= 8:
            found.append(dataclasses.replace(launch, options={**launch.options, "num_warps": more}))
    return tuple(found)


def settle_spills(candidates: tuple[KernelLaunch, ...], local_bytes) -> tuple[int, list[int]]:
    """``(index of the launch to keep, local bytes of each candidate tried)``: the first of ``candidates`` whose
    ``local_bytes(launch)`` (spilled bytes per thread of its compiled kernel) is 0, else the one that spills least."""
    tried = []
    for candidate in candidates:
        tried.append(local_bytes(candidate))
        if tried[-1] == 0:
            break
    return tried.index(min(tried)), tried


def _compiled_spills(candidate: KernelLaunch) -> int:
    """Local bytes per thread that ``candidate``'s compiled kernel spills on this device. Compiled without a launch
    (``warmup``; the launch that follows finds it in Triton's cache) and loaded to read the count the driver reports
    (``n_spills``, set when Triton loads a kernel; ``_init_handles`` is how it loads one before a launch). A Triton
    without either launches the candidate instead: the partial kernel writes all its outputs, so the launch that
    follows with the kept settings leaves the same result."""
    warmup = getattr(candidate.kernel, "warmup", None)
    compiled = None if warmup is None else warmup(*candidate.args, grid=candidate.grid, **candidate.options)
    if hasattr(compiled, "_init_handles"):
        compiled._init_handles()
    else:
        compiled = candidate.kernel[candidate.grid](*candidate.args, **candidate.options)
    return int(getattr(compiled, "n_spills", 0) or 0)


def _spill_free(partial: KernelLaunch) -> KernelLaunch:
    """``partial`` with the settings :data:`_SPILL_FREE` holds for it; for new options, the candidates of
    :func:`spill_alternatives` are compiled in turn until one does not spill (:func:`_compiled_spills`). Under the
    interpreter nothing compiles."""
    if INTERPRETED:
        return partial
    key = tuple(partial.options.items())
    index = _SPILL_FREE.get(key)
    if index == 0:  # the planned settings do not spill (the usual case): nothing to build per step
        return partial
    candidates = spill_alternatives(partial)
    if index is None:
        with _SPILL_LOCK:
            index = _SPILL_FREE.get(key)  # another thread may have settled it while this one waited
            if index is None:
                index, _ = settle_spills(candidates, _compiled_spills)
                _SPILL_FREE[key] = index
    return candidates[index]


@dataclass(frozen=True)
class KernelLaunch:
    """One launch: ``kernel[grid](*args, **options)`` (``options``: the constexprs, ``num_warps``, ``num_stages``)."""

    kernel: object
    grid: tuple[int, ...]
    args: tuple
    options: dict


def plan_decode_attention(query: torch.Tensor, scaling: float, *, quantized: QuantizedRegion | None,
                          exact: tuple[ExactSegment, ...], attention_mask: torch.Tensor | None = None,
                          kv_len: int | None = None, tiles_per_split: int | None = None,
                          launch: LaunchConfig | None = None) -> tuple[tuple[KernelLaunch, ...], torch.Tensor]:
    """The launches :func:`launch_decode_attention` makes, in order, and the ``[B, q, Hq, D]`` output the last one
    writes (allocated, not yet written). Same arguments."""
    segments = tuple(seg for seg in exact if seg.tokens)
    quantized = quantized if quantized is not None and quantized.tokens else None
    regions = ([quantized] if quantized is not None else []) + list(segments)
    if not regions:
        raise ValueError("decode_attention needs at least one key (the quantized region and segments are empty).")
    b, hq, q_len, head_dim = query.shape
    heads = (quantized.keys.codes if quantized is not None else segments[0].keys).shape[1]
    rows = hq // heads * q_len
    kv_len = max(r.start + r.tokens for r in regions) if kv_len is None else kv_len
    launch = launch or _DEFAULT_LAUNCH
    # query rows pad to 4, not to a product's 16: Triton pads the product itself, and every row-wise step of the
    # online softmax (max, exp2, sums, rescaling) then runs on 4 rows, not 16 (kernel_report.md)
    d_pad, r_pad = _pow2(head_dim), _pow2(rows, least=4)
    fast = quantized is not None and fast_path(quantized, d_pad)
    tile = launch.tile_for(quantized, FAST_MAX_TILE if fast else MAX_TILE, r_pad if fast else None)
    fast = fast and fast_path(quantized, d_pad, tile)
    counts = [-(-r.tokens // tile) for r in regions]
    if tiles_per_split is None:
        tiles_per_split = max(1, -(-sum(counts) * b * heads // _target_programs(query.device, launch)))
    splits = [-(-c // tiles_per_split) for c in counts]
    n_splits = sum(splits)
    acc = torch.empty(b * heads, n_splits, rows, head_dim, dtype=torch.float32, device=query.device)
    m, l_ = torch.empty(2, b * heads, n_splits, rows, dtype=torch.float32, device=query.device)
    small = d_pad * r_pad <= 4096  # query rows x channels: the accumulator a program holds
    capability = launch.capability or _capability(query.device)
    num_warps = launch.num_warps or ((fast_warps(tile, quantized, capability, r_pad) if fast else 4) if small else 8)
    stages = launch.num_stages or pipeline_stages(tile)
    has_quant = quantized is not None
    exact_args = [_exact_args(seg, attention_mask, q_len, hq) for seg in segments]
    exact_args += [_exact_args(None, None, q_len, hq, query)] * (MAX_EXACT_SEGMENTS - len(segments))  # dummy slots
    quant_args, constants = _quant_args(quantized, attention_mask, q_len, hq, query, fast)
    rotated = has_quant and quantized.values.rotated
    block = head_dim & -head_dim
    partial = KernelLaunch(partial_attention_kernel, (b * heads, n_splits), (
        query, *query.stride(), acc, m, l_,
        *quant_args, splits[0] if has_quant else 0,
        *exact_args[0][:-1], splits[1 if has_quant else 0] if segments else 0,
        *exact_args[1][:-1],
        tiles_per_split, n_splits, heads, hq // heads, q_len, kv_len, scaling * math.log2(math.e),
        1 / math.sqrt(block)), dict(
        HEAD_DIM=head_dim, D_PAD=d_pad, R_PAD=r_pad, TILE=tile, DOT=_dot_dtype(query),
        HAS_QUANT=has_quant, N_EXACT=len(segments), A_MASK=exact_args[0][-1], B_MASK=exact_args[1][-1],
        ASM=not INTERPRETED, QDOT=_code_dot_dtype(query), ROTATED=rotated, LOG2_BLOCK=block.bit_length() - 1,
        num_warps=num_warps, num_stages=stages, **constants, **codes_left(quantized, tile, num_warps, fast, capability),
        K_WIDE_LOAD=wide_query_loads(quantized, r_pad, capability)))
    out = torch.empty(b, q_len, hq, head_dim, dtype=query.dtype, device=query.device)
    s_pad = max(2, _pow2(n_splits, least=1))
    chunk = max(16, min(d_pad, MERGE_ELEMENTS // s_pad))
    merge = KernelLaunch(merge_partials_kernel, (b * heads * rows, -(-head_dim // chunk)), (
        acc, m, l_, out, *out.stride(), n_splits, heads, hq // heads, q_len), dict(
        HEAD_DIM=head_dim, S_PAD=s_pad, CHUNK=chunk, num_warps=MERGE_WARPS))
    return (partial, merge), out




@dataclass(frozen=True)
class LaunchConfig:
    """Launch settings of the partial-attention kernel; None keeps the default (what the launcher picks)."""

    num_warps: int | None = None  # default: 4 (fast path: fast_warps), 8 for more than 4096 query rows x channels
    num_stages: int | None = None  # software-pipeline depth; default: pipeline_stages(tile)
    tile: int | None = None  # tokens per tile: a power of two >= 16 dividing the default (the key scale group's,
    # or two of lean's 32-token groups)
    programs_per_sm: int | None = None  # splits aim at this many programs per SM; default PROGRAMS_PER_SM
    sm_count: int | None = None  # streaming multiprocessors to fill; default: the device's (a card's, for the report)
    capability: int | None = None  # the card's compute capability, major * 10 + minor; default: the device's

    def tile_for(self, quantized: QuantizedRegion | None, limit: int = MAX_TILE, fast_rows: int | None = None) -> int:
        """Tokens per tile for ``quantized``: the default (at most ``limit``; on the fast path, for ``fast_rows``
        padded query rows, two key blocks where :func:`two_key_blocks` allows), or the override if it divides the
        default."""
        default = tile_tokens(quantized, limit)
        if fast_rows is not None and two_key_blocks(quantized, 2 * default, fast_rows):
            default *= 2
        if self.tile is None:
            return default
        if self.tile < MIN_TILE or self.tile & (self.tile - 1) or default % self.tile:
            raise ValueError(f"tile of {self.tile} tokens: a power of two >= {MIN_TILE} dividing {default} expected.")
        return self.tile


_DEFAULT_LAUNCH = LaunchConfig()  # made once: the decode step's path builds nothing it does not need


def fast_warps(tile: int, region: QuantizedRegion | None = None, capability: int | None = None, rows: int = 4) -> int:
    """Warps per program on the fast path: at least 16 tokens of a tile per warp, at most 4 for 128-token tiles and 2
    for shorter ones, except 4 for 64-token tiles of keys with wide channels (``compact``, ``max``) beyond head_dim
    128 (with 2 warps they take 254-255 registers) and for 64-token tiles on cards before sm_89 (``capability``,
    major * 10 + minor; None: sm_90's rule), where ``tight`` with 2 warps takes 255 registers on sm_80; but not, up
    to head_dim 128, for ``lean``'s tiles of two key blocks (:func:`two_key_blocks`: 168 registers and 0.139 warp
    instructions per byte on sm_80 with 2, 0.184 with 4; at head_dim 256, 255 registers with 2) nor for wide
    channels (``compact`` on sm_80: 227 registers, 0.226 with 2, 0.288 with 4). Fewer warps hold more of
    a tile each, and the per-tile steps shared by all warps (row max and sums across warps, barriers) are paid fewer
    times: on sm_90a ``tight`` issues 0.31 warp instructions per byte with 2 warps, 0.39 with 4 (kernel_report.md).
    One warp would issue less still (``lean``'s 32-token tiles: 0.148 at 255 registers, 0.141 and 248 with one
    pipeline stage; its 64-token tiles of two key blocks issue 0.144 with two warps at 168) but leaves
    half the warps resident and none prefetching: not taken before a GPU times it (``gpu_tune.GRID`` sweeps 1, 2 and 4
    warps). More than 8 padded query ``rows`` (GQA 4
    with 5 query tokens pads 20 to 32) take 4 warps for 64-token tiles: ``tight`` spilled 320 B so with 2."""
    wide = region is not None and region.keys.wide_bits is not None
    small_head = region is not None and region.keys.head_dim <= 128
    old_card = (capability is not None and capability < 89
                and not ((wide or two_key_blocks(region, tile, rows)) and small_head))
    four = tile >= 128 or (tile == 64 and ((wide and not small_head) or rows > 8 or old_card))
    return max(1, min(4 if four else 2, tile // 16))


def codes_left(region: QuantizedRegion | None, tile: int, num_warps: int, fast: bool,
               capability: int | None = None) -> dict[str, bool]:
    """The fast path's ``K_LEFT`` and ``V_LEFT``: whether the key and value codes are the left operand of their matrix
    products (tokens or channels on the product's M side, query rows on N), chosen by what compiles to fewer
    instructions per byte on sm_90a without spilling (kernel_report.md). Values always, the product ``V^T @ P^T``: its
    4 query rows pad to an 8-wide fragment instead of a 16-row one. Keys when every warp holds a whole 16-token
    fragment of the tile (their wide channels' product, ``compact``'s and ``max``'s, turns with them: ``max`` 0.63 ->
    0.55 warp instructions per byte), except 32-token tiles on sm_89 (``capability`` 89), where ``lean``'s turned keys
    spill 8 B."""
    fast = fast and region is not None
    keys = fast and tile >= 16 * num_warps and not (capability == 89 and tile <= 32)
    return {"K_LEFT": keys, "V_LEFT": fast}


def wide_query_loads(region: QuantizedRegion | None, rows: int = 4, capability: int | None = None) -> bool:
    """The fast path's ``K_WIDE_LOAD``: whether each tile takes its wide key channels' query columns from memory (the
    query's and the chosen channels' scales, loads that hit the cache) rather than gathering them across the lanes
    that hold them (:func:`~hf_asymkv.kernels.triton_codes._wide_scores`): fewer instructions, where the registers
    allow. On sm_90a (kernel_report.md; ``compact``/``max``, GQA 4, one query token) head_dim 128 at 2 warps 0.240 ->
    0.222 / 0.376 -> 0.347 warp instructions per byte, head_dim 256 at 4 warps 0.263 -> 0.234 / 0.412 -> 0.366. Not
    at head_dim 256 on cards before sm_90 (``capability``, major * 10 + minor; None: sm_90's rule), where ``compact``
    reaches the 255-register cap, nor below head_dim 128 (padded), where ptxas holds ``max`` to 128 registers and it
    spilled 8 B (gathered: 0.560 at 2 warps, 0.657 at 4 before), nor for more than 8 padded query ``rows``, where
    ``max`` spilled 16 B (GQA 4 with 5 query tokens, head_dim 128)."""
    if region is None or region.keys.wide_bits is None or rows > 8:
        return False
    d_pad = _pow2(region.keys.head_dim)
    return d_pad == 128 or (d_pad > 128 and (capability is None or capability >= 90))


def pipeline_stages(tile: int) -> int:
    """Software-pipeline depth of the partial-attention kernel for ``tile`` tokens per tile (see _STAGES_BY_TILE;
    16-token tiles, not measured, take the 32-token setting)."""
    return _STAGES_BY_TILE.get(tile, 2)


def _pow2(n: int, least: int = 16) -> int:
    """Block extent for ``n``: a power of two, at least ``least`` (16: a matrix-product operand's least size)."""
    return max(least, 1 << (n - 1).bit_length())


def _dot_dtype(query: torch.Tensor):
    # the interpreter multiplies bfloat16 as raw integers: keep its products in float32
    return tl.float32 if INTERPRETED else _DOT_DTYPES[query.dtype]


def _code_dot_dtype(query: torch.Tensor):
    """Operand dtype of the products over codes on the fast path: float16 for half-precision queries (codes become
    fp16 by bit operations, see :mod:`.triton_codes`; bfloat16's 8-bit mantissa cannot hold an 8-bit code), float32
    for float32 queries. The interpreter multiplies float16 operands exactly and sums in float32, as the GPU does, so
    the CPU tests run the GPU's roundings."""
    return tl.float32 if query.dtype == torch.float32 else tl.float16


@functools.lru_cache(maxsize=8)  # process-wide, immutable: a race computes the same int twice (lru_cache stays whole)
def _capability(device: torch.device) -> int | None:
    """``major * 10 + minor`` of a CUDA device; None for other devices (the interpreter's CPU tensors)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


@functools.lru_cache(maxsize=8)  # process-wide, immutable (as _capability)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _target_programs(device: torch.device, launch: LaunchConfig) -> int:
    if launch.sm_count is None and device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return (launch.programs_per_sm or PROGRAMS_PER_SM) * (launch.sm_count or _sm_count(device))


def _mask_args(mask: torch.Tensor | None, q_len: int, hq: int, fallback: torch.Tensor, start: int
               ) -> tuple[list, int, int]:
    """``([tensor, 4 strides], mode, first column)`` for a region's ``[B|1, 1|Hq, q, n]`` mask (size-1 axes
    broadcast): the kernel reads the mask at columns ``first + token`` (0 for this region-local slice), or
    applies the causal rule at ``start + token`` when there is no mask."""
    if mask is None:
        return [fallback, 0, 0, 0, 0], MASK_NONE if q_len == 1 else MASK_CAUSAL, start
    if mask.dim() != 4 or mask.shape[1] not in (1, hq) or mask.shape[2] != q_len:
        raise ValueError(f"attention mask of shape {tuple(mask.shape)}; expected [B|1, 1|{hq}, {q_len}, kv].")
    strides = [0 if size == 1 else stride for size, stride in zip(mask.shape, mask.stride())]
    if mask.dtype == torch.bool:
        return [mask.view(torch.uint8), *strides], MASK_BOOL, 0
    return [mask, *strides], MASK_ADDITIVE, 0


def _region_mask(region, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    if region.mask is not None or attention_mask is None:
        return region.mask
    if attention_mask.shape[-1] < region.start + region.tokens:
        raise ValueError(f"attention mask of {attention_mask.shape[-1]} columns for keys up to column "
                         f"{region.start + region.tokens}.")
    return attention_mask[..., region.start : region.start + region.tokens]


def _exact_args(seg: ExactSegment | None, attention_mask, q_len: int, hq: int, dummy: torch.Tensor | None = None
                ) -> list:
    """Pointer and stride arguments of one exact-segment slot, then its mask mode (a dummy slot when None)."""
    if seg is None:
        return [dummy, 0, 0, 0, 0, dummy, 0, 0, 0, 0, dummy, 0, 0, 0, 0, 0, 0, MASK_NONE]
    mask, mode, column = _mask_args(_region_mask(seg, attention_mask), q_len, hq, seg.keys, seg.start)
    return [seg.keys, *seg.keys.stride(), seg.values, *seg.values.stride(), *mask, seg.tokens, column, mode]


def _code_args(stored: StoredCodes, prefix: str) -> tuple[list, dict]:
    """Pointer/stride arguments and constexprs of one quantized tensor (see ``_codes`` in the kernels; ``FLIP`` and
    the offset of int8 codes are what the fast path reads, :mod:`.triton_codes`)."""
    codes, widths, block, flip = stored.codes, (0, 0), 1, 0
    if codes.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        kind = FP8_E4M3 if codes.dtype == torch.float8_e4m3fn else FP8_E5M2
        codes = codes.view(torch.uint8)
    elif stored.bits == 8:
        kind, flip = INT8, 0x80 if codes.dtype == torch.int8 else 0
    else:
        kind = PACKED_TOKENS if stored.layout == "tokens" else PACKED_HEAD_DIM
        widths = (*plane_sets(stored.bits), 0)[:2]
        block = stored.block_size if kind == PACKED_TOKENS else 1
    zero = stored.zero if stored.zero is not None else stored.scale
    offset = 2 ** (stored.bits - 1) if stored.bits < 8 and stored.symmetric else 0
    constants = dict(KIND=kind, W0=widths[0], W1=widths[1], OFFSET=offset, PB=block, TG=stored.token_group,
                     CG=stored.channel_group, ZERO=stored.zero is not None, FLIP=flip)
    args = [codes, *codes.stride(), stored.scale, zero, *stored.scale.stride()]
    return args, {f"{prefix}_{name}": value for name, value in constants.items()}


TWO_BLOCK_GROUP = 32
"""Key scale groups of this many tokens are read two per tile on the fast path (:func:`two_key_blocks`)."""


def two_key_blocks(region: QuantizedRegion | None, tile: int, rows: int = 4) -> bool:
    """Whether the fast path reads ``region``'s keys in tiles of ``tile`` tokens holding two key blocks
    (``triton_codes._two_block_scores``): keys of one token-packed plane set (4 or 2 bits) without wide channels,
    in blocks of :data:`TWO_BLOCK_GROUP` tokens (``lean``'s), one scale group per block, values whose packing blocks
    the tile divides or spans whole (else the fast path could not take the tile), at most 8 query ``rows`` (the
    product takes each twice; padded to a power of two or not, the same bound). Per-tile work (the query scaled per
    block, the softmax's row steps, the loop's own) then spreads over twice the bytes: ``lean`` 0.188 -> 0.144 warp
    instructions per byte on sm_90a (kernel_report.md); with 5 query tokens x GQA 4 (32 padded rows) the doubled rows
    spilled (8-120 B) and issued more (0.56 -> 0.97 per byte at head_dim 128), so those keep one block per tile."""
    if region is None or rows > 8 or tile != 2 * TWO_BLOCK_GROUP or region.keys.token_group != TWO_BLOCK_GROUP:
        return False
    keys, values = region.keys, region.values
    return (keys.bits < 8 and keys.codes.dtype in (torch.int8, torch.uint8) and len(plane_sets(keys.bits)) == 1
            and keys.layout == "tokens" and keys.block_size == keys.token_group and keys.wide_bits is None
            and _blocks_fit(values, tile))


def _blocks_fit(stored: StoredCodes, tile: int) -> bool:
    """Whether tiles of ``tile`` tokens read ``stored`` on the fast path: 8-bit codes, or sub-byte codes packed along
    tokens in blocks the tile divides or spans whole."""
    return stored.bits == 8 or (stored.layout == "tokens" and not (stored.block_size % tile
                                                                   and tile % stored.block_size))


def fast_path(region: QuantizedRegion, d_pad: int, tile: int | None = None) -> bool:
    """Whether the kernel reads ``region`` on its fast path (:mod:`.triton_codes`): int8 or token-packed codes,
    keys with one scale per channel (or per head) per block, values with one scale per token and head, or per token
    and half head of at least 16 channels (head_dim 256 with the default 128-channel groups), tiles inside a key
    block (or of two, :func:`two_key_blocks`), packing blocks made of whole tiles or tiles of whole blocks (``tile``,
    default the fast path's own), a power-of-two head_dim."""
    keys, values = region.keys, region.values
    tile = tile or tile_tokens(region, FAST_MAX_TILE)
    if keys.token_group % tile and not two_key_blocks(region, tile):
        return False
    if keys.head_dim != d_pad or keys.channel_group not in (1, keys.head_dim):
        return False
    halves = values.channel_group == values.head_dim // 2 and values.channel_group >= 16
    if values.token_group != 1 or (values.channel_group != values.head_dim and not halves):
        return False
    for stored in (keys, values):
        if stored.codes.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return False
        if not _blocks_fit(stored, tile):
            return False
    return True


def _quant_args(region: QuantizedRegion | None, attention_mask, q_len: int, hq: int, dummy: torch.Tensor,
                fast: bool) -> tuple[list, dict]:
    """Arguments of the quantized-region slot (up to its split count) and every K_*/V_*/Q_MASK/FAST constexpr."""
    if region is None:
        fake = StoredCodes(dummy.new_zeros(1, 1, 1, 1, dtype=torch.int8), dummy.new_zeros(1, 1, 1, 1), None, 8, True)
        keys, key_constants = _code_args(fake, "K")
        values, value_constants = _code_args(fake, "V")
        wide, wide_constants = _wide_args(fake, dummy)
        return ([*keys, *values, *wide, dummy, 0, 0, 0, 0, 0, 0, dummy],
                {**key_constants, **value_constants, **wide_constants, "Q_MASK": MASK_NONE, "FAST": False,
                 "Q_FILL": False})
    keys, key_constants = _code_args(region.keys, "K")
    values, value_constants = _code_args(region.values, "V")
    wide, wide_constants = _wide_args(region.keys, dummy)
    mask, mode, column = _mask_args(_region_mask(region, attention_mask), q_len, hq, dummy, region.start)
    if fast:  # flipped int8 codes read 128 above their value
        key_constants["K_OFFSET"] += 128 if key_constants["K_FLIP"] else 0
        value_constants["V_OFFSET"] += 128 if value_constants["V_FLIP"] else 0
    filled = region.filled
    if filled is not None and (filled.dim() != 0 or filled.dtype.is_floating_point or filled.device != dummy.device):
        raise ValueError(f"the quantized region's filled count must be a 0-d integer tensor on {dummy.device}, got "
                         f"{filled.dtype} of shape {tuple(filled.shape)} on {filled.device}.")
    return ([*keys, *values, *wide, *mask, region.tokens, column, dummy if filled is None else filled],
            {**key_constants, **value_constants, **wide_constants, "Q_MASK": mode, "FAST": fast,
             "Q_FILL": filled is not None})


def _wide_args(keys: StoredCodes, dummy: torch.Tensor) -> tuple[list, dict]:
    """Pointer/stride arguments and constexprs of the keys' wide channels (dummies and ``K_WIDE=0`` without)."""
    if keys.wide_bits is None:
        return [dummy, 0, 0, 0, 0, dummy, 0, 0, 0, 0], dict(K_WIDE=0, K_WIDE_PAD=1, K_WIDE_BYTES=1)
    count = keys.wide_channels.shape[-1]
    constants = dict(K_WIDE=count, K_WIDE_PAD=_pow2(count), K_WIDE_BYTES=keys.wide_bits.shape[-1])  # >= 16: a product
    return [keys.wide_bits, *keys.wide_bits.stride(), keys.wide_channels, *keys.wide_channels.stride()], constants
