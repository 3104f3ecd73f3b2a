"""The native CPU read-out: packed integer codes to float32 K/V in one pass per tensor (``cpu_readout.c``).

The torch read-out of a quantized region unpacks, folds, converts, scales and rotates back in four to six passes
over the region; at 4k tokens on two cores those passes were a fifth of a decode step of ``compact``
(``results/bench/readout_stages.md``). ``cpu_readout.c`` does the same arithmetic per token, with the same roundings:
its output equals torch's bit for bit (``tests/kernels/test_cpu_readout.py``).

The C file ships with the package and is compiled on first use with the system's C compiler (``$CC``, else
``cc``/``gcc``; OpenMP, ``-O3 -march=native``) into a cache directory keyed by the source, the compiler, the flags and
the CPU (``native/`` in ``$HF_ASYMKV_CACHE``, default ``~/.cache/hf_asymkv``), then loaded with :mod:`ctypes`. Writes are
atomic (a temporary file renamed into place), so parallel processes may build it at once.
``HF_ASYMKV_CPU_READOUT`` chooses, read at every call:

- ``auto`` (default): the native read-out when it builds, torch's otherwise (a warning says why, once);
- ``native``: the native read-out or an error that says why it cannot build;
- ``torch``: never the native read-out.

It serves float32 outputs of integer codes (2 to 8 bits, either layout) on CPU tensors; the core decides per call
(:func:`hf_asymkv.core.quant.dequantize`, :func:`hf_asymkv.core.rotation.dequantize_rotated`). This module imports
nothing else from the package.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from . import env_choice
from .once import computed_once

__all__ = ["CHOICES", "ENV_VAR", "SOURCES", "build_problem", "native_library", "read_plain", "read_rotated", "requested",
           "use_native"]

ENV_VAR = "HF_ASYMKV_CPU_READOUT"
CHOICES = ("auto", "native", "torch")
SOURCE = Path(__file__).with_name("cpu_readout.c")
SOURCES = (SOURCE, SOURCE.with_name("cpu_attention.c"))
"""The C files of the native library: this read-out and the fused decode attention (:mod:`.cpu_attention`)."""
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
MAX_HEAD_DIM = 4096  # the C file's per-token buffer
_LOG = logging.getLogger(__name__)


class _Readout(ctypes.Structure):
    """Mirror of ``asymkv_readout`` in ``cpu_readout.c`` (every field 8 bytes: pointers and int64)."""

    _fields_ = [(name, ctypes.c_void_p if kind == "p" else ctypes.c_int64) for name, kind in (
        ("codes", "p"), ("codes_stride_b", "i"), ("codes_stride_h", "i"),
        ("out", "p"), ("out_stride_b", "i"), ("out_stride_h", "i"),
        ("batch", "i"), ("heads", "i"), ("tokens", "i"), ("head_dim", "i"),
        ("bits", "i"), ("tokens_layout", "i"), ("block_size", "i"), ("signed_bytes", "i"), ("offset", "i"),
        ("scale", "p"), ("zero", "p"), ("token_group", "i"), ("channel_group", "i"),
        ("wide_bits", "p"), ("wide_channels", "p"), ("wide_count", "i"), ("wide_bytes", "i"), ("wide_offset", "i"),
        ("row_scale", "p"), ("row_zero", "p"), ("hadamard", "i"), ("threads", "i"))]


def requested() -> str:
    """What ``HF_ASYMKV_CPU_READOUT`` asks for (``auto`` when unset or empty).

    Raises:
        ValueError: a value outside :data:`CHOICES`.
    """
    return env_choice(ENV_VAR, CHOICES, "a read-out")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_signature() -> str:
    """The CPU's model and feature flags (``-march=native`` builds for them), or the machine name."""
    try:
        info = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return platform.machine() + "\n" + "\n".join(sorted(set(lines)))


def _cache_dir() -> Path:
    """``native/`` in the package's cache folder (``$HF_ASYMKV_CACHE`` or ``~/.cache/hf_asymkv``, as the models)."""
    return Path(os.environ.get("HF_ASYMKV_CACHE") or Path.home() / ".cache" / "hf_asymkv").expanduser() / "native"


def _build(compiler: str) -> Path:
    """Compile :data:`SOURCES` into the cache (once per source, compiler, flags and CPU); returns the library.

    Raises:
        RuntimeError: the compiler failed (its message included) or the cache directory is not writable.
    """
    source = b"\0".join(path.read_bytes() for path in SOURCES)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(FLAGS).encode(),
                                      _cpu_signature().encode()])).hexdigest()[:20]
    directory = _cache_dir()
    target = directory / f"cpu_readout-{key}.so"
    if target.exists():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(suffix=".so", dir=directory)
    except OSError as error:
        raise RuntimeError(f"cannot write the compiled read-out into {directory}: {error}") from error
    os.close(handle)
    try:
        done = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", temporary, "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode:  # (the compiler's message names the C file)
            raise RuntimeError(f"{compiler} failed to compile {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target


@computed_once  # process-wide, guarded: one thread builds and loads, the others wait (hf_asymkv.kernels.once)
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """``(library, None)``, or ``(None, why not)``: built and loaded once per process (processes building at once
    each write a temporary file and rename it into place: :func:`_build`)."""
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler found (set $CC, or install gcc)"
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        return None, str(error)
    library.asymkv_readout_run.argtypes = [ctypes.POINTER(_Readout)]
    library.asymkv_readout_run.restype = ctypes.c_int
    return library, None


def build_problem() -> str | None:
    """Why the native read-out cannot be used in this process (None when it can); builds it on first call."""
    return _library()[1]


def native_library() -> ctypes.CDLL | None:
    """The native library built from :data:`SOURCES` (None when :func:`build_problem` says why not)."""
    return _library()[0]


@computed_once  # process-wide, guarded: said once, whichever thread meets the problem first
def _warn_once(problem: str) -> None:
    _LOG.warning("hf_asymkv: the native CPU read-out is unavailable (%s); the torch read-out runs instead. Set "
                 "%s=torch to silence this.", problem, ENV_VAR)


def use_native(out: torch.Tensor, codes: torch.Tensor, bits: int, head_dim: int) -> bool:
    """Whether the native read-out serves this call: CPU tensors, a float32 ``out`` with contiguous rows, integer codes (uint8/int8) of
    2 to 8 bits, outside a compiled graph, and ``HF_ASYMKV_CPU_READOUT`` allows it (and it builds).

    Raises:
        ValueError: an unknown ``HF_ASYMKV_CPU_READOUT``.
        RuntimeError: ``HF_ASYMKV_CPU_READOUT=native`` and it cannot build or cannot serve the call.
    """
    choice = requested()
    if choice == "torch":
        return False
    servable = (out.device.type == "cpu" and codes.device.type == "cpu" and out.dtype == torch.float32
                and codes.dtype in (torch.uint8, torch.int8) and 1 <= bits <= 8 and head_dim <= MAX_HEAD_DIM
                and _contiguous_rows(out) and not torch.compiler.is_compiling())
    if not servable:
        if choice == "native" and not torch.compiler.is_compiling():
            raise RuntimeError(f"{ENV_VAR}=native serves float32 outputs of 2- to 8-bit integer codes on CPU tensors "
                               f"(head_dim <= {MAX_HEAD_DIM}); got {out.dtype} out, {codes.dtype} codes on "
                               f"{codes.device.type}, {bits} bits, head_dim {head_dim}.")
        return False
    problem = build_problem()
    if problem is not None:
        if choice == "native":
            raise RuntimeError(f"{ENV_VAR}=native, but the native read-out cannot be built: {problem}")
        _warn_once(problem)
        return False
    return True


def _contiguous_rows(t: torch.Tensor) -> bool:
    """Whether each ``[b, h]`` of ``t`` holds contiguous rows (a slice of a larger buffer along tokens does)."""
    return t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if _contiguous_rows(t) else t.contiguous()


def _fill(out: torch.Tensor, codes: torch.Tensor, bits: int, tokens_layout: bool, block_size: int, offset: int,
          keep: list, **fields) -> _Readout:
    """The shared fields; ``keep`` holds every tensor whose pointer is passed until the call returns."""
    b, h, t, d = out.shape
    keep += [out, codes]
    return _Readout(codes=codes.data_ptr(), codes_stride_b=codes.stride(0), codes_stride_h=codes.stride(1),
                    out=out.data_ptr(), out_stride_b=out.stride(0), out_stride_h=out.stride(1), batch=b, heads=h,
                    tokens=t, head_dim=d, bits=bits, tokens_layout=int(tokens_layout), block_size=block_size,
                    signed_bytes=int(codes.dtype == torch.int8), offset=offset, threads=torch.get_num_threads(),
                    **fields)


def _pointer(t: torch.Tensor | None, keep: list) -> int | None:
    if t is None:
        return None
    t = t.contiguous()
    keep.append(t)
    return t.data_ptr()


def _run(args: _Readout) -> None:
    if _library()[0].asymkv_readout_run(ctypes.byref(args)):
        raise ValueError("the native read-out refused its arguments (a bug in its caller: please report it).")


def read_plain(out: torch.Tensor, codes: torch.Tensor, *, bits: int, tokens_layout: bool, block_size: int,
               offset: int, scale: torch.Tensor, zero: torch.Tensor | None, token_group: int, channel_group: int,
               wide_bits: torch.Tensor | None = None, wide_channels: torch.Tensor | None = None,
               wide_offset: int = 0) -> torch.Tensor:
    """``out = code * scale (+ zero)`` per element, codes unpacked and wide high bits folded in. Returns ``out``.

    Args:
        out: ``[B, H, T, D]`` float32 whose ``[b, h]`` rows are contiguous (a token slice of a buffer is fine;
            :func:`use_native` checks it).
        codes: ``[B, H, T, D * bits / 8]`` packed bytes (uint8, or int8 8-bit codes).
        bits, tokens_layout, block_size: how they are packed (``PackedCodes``).
        offset: subtracted from every code (the symmetric storage offset of sub-byte codes, else 0).
        scale, zero: float32 ``[B, H, T // token_group, D // channel_group]`` (zero None: symmetric).
        wide_bits, wide_channels: ``[B, H, T, ceil(R / 8)]`` and ``[B, H, T // block_size, R]`` uint8, or None.
        wide_offset: subtracted once more for each wide channel (the symmetric offset, else 0).
    """
    keep: list = []
    wide = dict(wide_bits=_pointer(wide_bits, keep), wide_channels=_pointer(wide_channels, keep),
                wide_count=0 if wide_channels is None else wide_channels.shape[-1],
                wide_bytes=0 if wide_bits is None else wide_bits.shape[-1], wide_offset=wide_offset)
    _run(_fill(out, _rows(codes), bits, tokens_layout, block_size, offset, keep,
               scale=_pointer(scale, keep), zero=_pointer(zero, keep), token_group=token_group,
               channel_group=channel_group, **wide))
    return out


def read_rotated(out: torch.Tensor, codes: torch.Tensor, *, bits: int, tokens_layout: bool, block_size: int,
                 offset: int, row_scale: torch.Tensor, row_zero: torch.Tensor | None, hadamard: int) -> torch.Tensor:
    """Rotated per-token codes back: ``out = (code S^T) * row_scale``, then ``row_zero`` added to the first column of
    each Hadamard block (``S``: Sylvester signs in blocks of ``hadamard``). Returns ``out``.

    Args:
        out, codes, bits, tokens_layout, block_size, offset: as :func:`read_plain`.
        row_scale, row_zero: float32 ``[B, H, T]`` (``scale / sqrt(hadamard)``, ``zero * sqrt(hadamard)``; zero None:
            symmetric).
        hadamard: the Hadamard block size (a power of two dividing ``D``).
    """
    keep: list = []
    _run(_fill(out, _rows(codes), bits, tokens_layout, block_size, offset, keep, row_scale=_pointer(row_scale, keep),
               row_zero=_pointer(row_zero, keep), hadamard=hadamard, token_group=1, channel_group=1))
    return out
