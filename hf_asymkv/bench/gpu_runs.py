"""What ``scripts/gpu_check.py`` measures on a GPU: whole-model decode per cache scheme, the attention kernel alone
against SDPA over bf16 K/V, and the kernel's agreement with the torch fused attention.

The model is a random-weight ``LlamaForCausalLM`` with Llama-3-8B's attention and MLP shapes and a few layers
(nothing is downloaded). Times come from CUDA events around whole loops; on CPU (``--dry-run``, the kernels under
Triton's interpreter) from ``time.perf_counter``, and mean nothing there but that the code runs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from ..core.compat import cache_kwargs
from ..kernels.backend import ENV_VAR
from .memory import cache_nbytes
from .schemes import make_cache, scheme_attention

__all__ = ["COMPILE_MODES", "DRY_SHAPES", "GPU_SCHEMES", "LLAMA3_8B", "DecodeRow", "GPUScheme", "ModelShapes",
           "SchemeUnavailable", "attention_backend_env", "build_model", "compiled_forward", "decode_row",
           "greedy_steps", "make_gpu_cache", "prompt_ids", "scheme_context", "sdpa_backends", "timed_seconds",
           "weight_bytes"]


@dataclass(frozen=True)
class ModelShapes:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


LLAMA3_8B = ModelShapes(layers=4, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256)
"""Llama-3-8B's shapes with 4 of its 32 layers (the bytes per layer, weights and KV, are the real ones)."""
DRY_SHAPES = ModelShapes(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=256)


class SchemeUnavailable(RuntimeError):
    """A scheme that cannot run here (a missing package, a feature not built yet): reported, not fatal."""


def build_model(shapes: ModelShapes, dtype: torch.dtype, device: torch.device):
    """Random-weight ``LlamaForCausalLM`` of ``shapes``, built on ``device`` in ``dtype`` (eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=shapes.layers, hidden_size=shapes.hidden, num_attention_heads=shapes.heads,
                         num_key_value_heads=shapes.kv_heads, head_dim=shapes.head_dim,
                         intermediate_size=shapes.intermediate, vocab_size=shapes.vocab, max_position_embeddings=262144,
                         rope_theta=500000.0, tie_word_embeddings=False)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval().requires_grad_(False)


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: every parameter but the input embedding table (one row per token)."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)


# ------------------------------------------------------------------------------------------------ schemes
@dataclass(frozen=True)
class GPUScheme:
    """A cache and the attention it runs with. ``bench_scheme`` names the cache in :mod:`.schemes`; ``backend``
    is ``HF_ASYMKV_ATTENTION_BACKEND`` while it runs; ``needs`` a module that must be importable; ``flash_sdpa``
    keeps SDPA off cuDNN (flash and memory-efficient kernels only)."""

    label: str
    bench_scheme: str | None
    backend: str | None = None
    needs: str | None = None
    compiled: bool = False
    flash_sdpa: bool = False


GPU_SCHEMES: dict[str, GPUScheme] = {
    "dynamic": GPUScheme("DynamicCache + SDPA (bf16 K/V)", "dynamic"),
    # on the H200 image (torch 2.11) SDPA picked cuDNN, whose host time was 70 ms of a 76 ms DynamicCache step
    # (results/gpu/h200_tune); this row is the same cache with that backend excluded
    "dynamic-flash": GPUScheme("DynamicCache + SDPA, flash/efficient kernels only (bf16 K/V)", "dynamic",
                               flash_sdpa=True),
    "hf-quanto-int4": GPUScheme("transformers QuantizedCache, quanto int4", "hf-quanto-int4", needs="optimum.quanto"),
    "hf-hqq-int4": GPUScheme("transformers QuantizedCache, HQQ int4", None, needs="hqq"),
    "balanced-dense": GPUScheme("ours, balanced, dense read-out + SDPA", "asymkv-balanced"),
    "balanced-triton": GPUScheme("ours, balanced, Triton kernel over the codes", "asymkv-balanced-fused", "triton"),
    "compact-triton": GPUScheme("ours, compact, Triton kernel over the codes", "asymkv-compact-fused", "triton"),
    "max-triton": GPUScheme("ours, max, Triton kernel over the codes", "asymkv-max-fused", "triton"),
    # issue 20: the preallocated AsymKVCache(max_cache_len=...) and transformers' StaticCache, decode step compiled
    "balanced-static-compiled": GPUScheme("ours, balanced, static cache, torch.compile",
                                          "asymkv-balanced-static-compiled", compiled=True),
    "balanced-static-fused-compiled": GPUScheme("ours, balanced, static cache, attention over the codes, torch.compile",
                                                "asymkv-balanced-static-fused-compiled", compiled=True),
    "compact-static-fused-compiled": GPUScheme("ours, compact, static cache, attention over the codes, torch.compile",
                                               "asymkv-compact-static-fused-compiled", compiled=True),
    "hf-static-compiled": GPUScheme("transformers StaticCache (bf16 K/V), torch.compile", "hf-static-compiled",
                                    compiled=True),
}


@contextlib.contextmanager
def attention_backend_env(value: str | None) -> Iterator[None]:
    """``HF_ASYMKV_ATTENTION_BACKEND=value`` inside the block (unchanged for None), restored after."""
    before = os.environ.get(ENV_VAR)
    if value is not None:
        os.environ[ENV_VAR] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = before


def sdpa_backends(flash_only: bool):
    """``torch.nn.attention.sdpa_kernel`` limited to the flash and memory-efficient kernels when ``flash_only``
    (the math kernel stays as the fallback for what they refuse), else a no-op."""
    if not flash_only:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@contextlib.contextmanager
def scheme_context(model, name: str) -> Iterator[GPUScheme]:
    """Everything GPU scheme ``name`` runs under: its attention implementation, ``HF_ASYMKV_ATTENTION_BACKEND`` and
    SDPA's kernels (:func:`sdpa_backends`), each restored after; yields the scheme."""
    scheme = GPU_SCHEMES[name]
    with scheme_attention(model, scheme.bench_scheme or "dynamic"), attention_backend_env(scheme.backend), \
            sdpa_backends(scheme.flash_sdpa):
        yield scheme


def prompt_ids(model, batch: int, context: int, seed: int = 0) -> torch.Tensor:
    """``[batch, context]`` random token ids on the model's device (seeded): the prompts every scheme prefills."""
    return torch.randint(0, model.config.vocab_size, (batch, context), device=model.device,
                         generator=torch.Generator(model.device).manual_seed(seed))


def greedy_steps(forward: Callable, cache, token: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` greedy decode steps from ``token`` (``[B, 1]``) through ``forward`` (the model or its compiled forward)
    and ``cache``; returns the last chosen tokens."""
    for _ in range(n):
        token = forward(input_ids=token, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
    return token


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def make_gpu_cache(name: str, model, max_tokens: int):
    """GPU scheme ``name``'s cache for ``model`` (a static one sized for ``max_tokens``); raises
    :class:`SchemeUnavailable` when the package it needs is not installed."""
    scheme = GPU_SCHEMES[name]
    if scheme.needs and not _importable(scheme.needs):
        raise SchemeUnavailable(f"{scheme.needs} is not installed")
    if name == "hf-hqq-int4":
        from transformers.cache_utils import QuantizedCache

        return QuantizedCache("hqq", model.config, nbits=4)
    return make_cache(scheme.bench_scheme, model.config, max_cache_len=max_tokens if scheme.compiled else None)


COMPILE_MODES = ("reduce-overhead", "default", "max-autotune-no-cudagraphs")
"""``torch.compile`` modes for the compiled schemes on a GPU; the first is what ``generate`` uses when it compiles
a static cache by itself (transformers' ``CompileConfig``: CUDA graphs)."""


def compiled_forward(model, mode: str = COMPILE_MODES[0]) -> Callable:
    """``torch.compile(model.forward, fullgraph=True, dynamic=False, mode=mode)`` with a clean compile cache (each
    (batch, context) is new shapes: one graph per row, no recompile limit reached over the rows); inductor on a GPU,
    the eager backend on CPU, where ``mode`` does not apply (the dry run checks that the step traces as one graph,
    not what inductor makes of it)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r}; expected one of {list(COMPILE_MODES)}")
    torch._dynamo.reset()
    if model.device.type != "cuda":
        return torch.compile(model.forward, fullgraph=True, dynamic=False, backend="eager")
    return torch.compile(model.forward, fullgraph=True, dynamic=False, backend="inductor", mode=mode)


def _prefill(model, cache, ids: torch.Tensor, chunk: int | None):
    """The prompt ``ids`` ``[B, n]`` into ``cache``, in forwards of ``chunk`` tokens (all at once for None): the
    last forward's output (logits of its last token)."""
    chunk = chunk or ids.shape[1]
    for begin in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, begin : begin + chunk], **cache_kwargs(cache), logits_to_keep=1)
    return out


# ------------------------------------------------------------------------------------------------ timing
def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_seconds(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """``(seconds, fn())``: wall time on CPU, CUDA events (device time, queue drained) on a GPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        result = fn()
        return time.perf_counter() - start, result
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _synchronize(device)
    begin.record()
    result = fn()
    end.record()
    _synchronize(device)
    return begin.elapsed_time(end) / 1e3, result


@dataclass
class DecodeRow:
    scheme: str
    batch: int
    context: int
    status: str = "ok"  # or why it was skipped / failed
    prefill_ms: float = 0.0
    decode_ms: float = 0.0  # per step (one token per sequence)
    kv_bytes: int = 0
    peak_gib: float = 0.0
    launches_per_step: float | None = None  # counted when asked (.launch_count): host launches, kernels, ours
    kernels_per_step: float | None = None
    attention_kernels_per_step: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def decode_row(model, name: str, batch: int, context: int, steps: int, warmup: int, seed: int = 0,
               compile_mode: str = COMPILE_MODES[0], prefill_chunk: int | None = None,
               count_launches: bool = False) -> DecodeRow:
    """Prefill ``batch`` random prompts of ``context`` tokens into scheme ``name``'s cache (eagerly, as ``generate``
    does, in forwards of ``prefill_chunk`` tokens when given: long batched prompts stay within memory), then time
    ``steps`` greedy decode steps after ``warmup`` untimed ones (kernel compilation, CUDA-graph capture, first
    allocations); a compiled scheme's steps run under ``torch.compile(mode=compile_mode)``. ``count_launches``: two
    more steps under the profiler give the launches per step (:mod:`.launch_count`)."""
    device = model.device
    row = DecodeRow(name, batch, context)
    ids = prompt_ids(model, batch, context, seed)
    counted = 2 if count_launches else 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with scheme_context(model, name) as scheme:
            cache = make_gpu_cache(name, model, context + warmup + steps + counted + 1)
            forward = compiled_forward(model, compile_mode) if scheme.compiled else model
            prefill_s, out = timed_seconds(lambda: _prefill(model, cache, ids, prefill_chunk), device)
            token = greedy_steps(forward, cache, out.logits[:, -1:].argmax(-1), warmup)
            decode_s, token = timed_seconds(lambda: greedy_steps(forward, cache, token, steps), device)
            if count_launches:
                from .launch_count import count_launches as count

                step = [token]
                counts = count(lambda: step.__setitem__(0, greedy_steps(forward, cache, step[0], 1)), device, counted)
                row.launches_per_step = counts["launches_per_step"]
                row.kernels_per_step = counts["kernels_per_step"]
                row.attention_kernels_per_step = counts["attention_kernels_per_step"]
    except SchemeUnavailable as exc:
        row.status = f"skipped: {exc}"
        return row
    except torch.OutOfMemoryError:
        row.status = "out of memory"
        return row
    except Exception as exc:  # one failing scheme must not cost the others' figures on a borrowed GPU
        traceback.print_exc()
        row.status = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
        return row
    row.prefill_ms, row.decode_ms = prefill_s * 1e3, decode_s * 1e3 / steps
    row.kv_bytes = cache_nbytes(cache)
    row.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return row
