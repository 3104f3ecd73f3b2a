"""What storing one flushed block costs on each append backend (``HF_ASYMKV_APPEND_BACKEND``): torch operations (on
a GPU, each one a kernel launch), Triton launches, host synchronizations, and time per flush.

A flush is :meth:`~hf_asymkv.core.store.QuantizedBlocks.append` of one block of ``block_size`` tokens (keys and
values each: the presets' specs at ``head_dim``), what a decode step that closes a block runs per tensor kind and
layer. Operations are counted with :class:`~hf_asymkv.bench.op_count.OpCounter`; the Triton launch is counted apart
and the interpreter's own tensor copies (CPU runs the kernel under ``TRITON_INTERPRET=1``) are not counted. Times:
CUDA events on a GPU (``scripts/gpu_check.py --append-cost``), wall time on CPU, where the kernel's time means
nothing (the interpreter is numpy).

    python scripts/studies/append_cost.py --out results/append/append_cost_cpu.md    # counts on CPU
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..core.config import Growth
from ..core.presets import PRESETS
from ..core.store import QuantizedBlocks
from ..kernels import append as kernel_append
from ..kernels.append import APPEND_ENV_VAR
from .gpu_runs import timed_seconds
from .op_count import OpCounter

__all__ = ["append_cost_rows", "write_report"]


@contextlib.contextmanager
def _backend(name: str) -> Iterator[None]:
    old = os.environ.get(APPEND_ENV_VAR)
    os.environ[APPEND_ENV_VAR] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(APPEND_ENV_VAR)
        else:
            os.environ[APPEND_ENV_VAR] = old


@contextlib.contextmanager
def _counted_launches() -> Iterator[list[int]]:
    """Count the append kernel's launches; what the launch itself does (the interpreter copies tensors to numpy and
    back) is kept out of any operation counter."""
    launches, original = [0], kernel_append._launch

    def launch(*args, **kwargs):
        launches[0] += 1
        with _disable_current_modes():
            return original(*args, **kwargs)

    kernel_append._launch = launch
    try:
        yield launches
    finally:
        kernel_append._launch = original


@torch.no_grad()
def append_cost_rows(presets: list[str], device: torch.device, dtype: torch.dtype, *, batch: int = 1, heads: int = 8,
                     head_dim: int = 128, flushes: int = 20, backends: tuple[str, ...] = ("torch", "triton")
                     ) -> list[dict]:
    """Per preset, tensor kind and backend: ``{preset, kind, backend, ops, triton_launches, syncs, us_per_flush,
    same_bits}`` for one flush of one block ``[batch, heads, block_size, head_dim]`` in ``dtype``: the counts from
    the second flush (past first allocations), the time the mean of ``flushes`` flushes after as many untimed, and
    whether everything stored (codes, scales, zeros, wide channels) equals the first backend's bit for bit."""
    rows = []
    growth = Growth(1.25, 4096)
    for preset in presets:
        resolved = PRESETS[preset].resolved([head_dim])
        for kind, spec in (("keys", resolved.key_spec()), ("values", resolved.value_spec())):
            g = torch.Generator(device="cpu").manual_seed(0)
            block = torch.randn(batch, heads, spec.block_size, head_dim, generator=g).to(device, dtype)
            block[..., 3] *= 20  # an outlier channel, as keys have
            first = None
            for backend in backends:
                with _backend(backend), _counted_launches() as launches:
                    blocks = QuantizedBlocks(spec, growth)
                    blocks.append(block)
                    before = launches[0]
                    with OpCounter() as counter:
                        blocks.append(block)
                    n_launches = launches[0] - before

                    def run(blocks=blocks) -> None:
                        for _ in range(flushes):
                            blocks.append(block)

                    run()  # growth of the buffers and the kernel's compilation out of the timing
                    seconds, _ = timed_seconds(run, device)
                stored = [buf.live.view(torch.uint8) if buf.live.element_size() == 1 else buf.live
                          for buf in blocks.buffers().values() if buf.data is not None]
                first = stored if first is None else first
                rows.append({"preset": preset, "kind": kind, "backend": backend, "ops": counter.launches,
                             "triton_launches": n_launches, "syncs": counter.syncs,
                             "us_per_flush": seconds / flushes * 1e6,
                             "same_bits": len(stored) == len(first) and all(map(torch.equal, stored, first))})
    return rows


def write_report(rows: list[dict], out: Path, meta: dict) -> str:
    """``out`` (.md) and the same name .json: a table per backend of operations, launches, syncs and time per flush."""
    lines = [f"Storing one flushed block per tensor kind and layer ({meta['device']}, {meta['dtype']}, batch "
             f"{meta['batch']}, {meta['heads']} KV heads, head_dim {meta['head_dim']}); command: `{meta['command']}`", "",
             "| preset | kind | backend | torch ops | Triton launches | host syncs | us per flush | same bits |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['kind']} | {r['backend']} | {r['ops']} | {r['triton_launches']} | "
                     f"{r['syncs']} | {r['us_per_flush']:.1f} | {'yes' if r['same_bits'] else 'NO'} |")
    text = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return text
