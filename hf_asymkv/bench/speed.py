"""Prefill and decode speed, KV bytes and peak RSS per cache scheme, beside DynamicCache (``hf-asymkv bench``).

Everything is measured in one process, with the schemes interleaved inside every repeat: on a shared, noisy
machine slow periods then hit all schemes alike, and the ratios (the claims) stay meaningful while absolute
milliseconds drift. DynamicCache's own worst/median step ratio is the noise floor for the flush-spike check.

Beside each step is its roofline (:mod:`.roofline`): the bytes a step reads (weights and K/V as stored) at the read
bandwidth measured in the same run, once per repeat. Long contexts may be filled with random K/V instead of a prefill
(``fill_from``): a decode step's cost does not depend on what the history holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.compat import cache_kwargs
from .memory import cache_nbytes
from .roofline import fill_random, median_bandwidth, read_bandwidth, weight_bytes
from .schemes import COMPILED, make_cache, scheme_attention, scheme_forward, with_baseline

__all__ = ["PeakRSS", "SpeedRow", "bandwidth_line", "format_speed_table", "measure_decode_speed", "plot_speed"]


class PeakRSS:
    """``with PeakRSS() as p: ...; p.growth``: peak resident-set growth (bytes) of this process inside the block.

    A thread samples ``/proc/self/statm`` every ``interval`` seconds (and once at exit); freed heap is handed
    back to the OS first (glibc ``malloc_trim``) so that the starting point is not inflated by earlier runs.
    On systems without ``/proc`` the growth is reported as ``-1``.
    """

    _libc = None

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.start = self.peak = self.growth = 0
        self._stop = threading.Event()

    @staticmethod
    def rss() -> int | None:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return None

    @classmethod
    def _trim(cls) -> None:
        if cls._libc is None:
            name = ctypes.util.find_library("c")
            cls._libc = ctypes.CDLL(name) if name else False
        if cls._libc and hasattr(cls._libc, "malloc_trim"):
            cls._libc.malloc_trim(0)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.rss() or 0)

    def __enter__(self) -> PeakRSS:
        self._trim()
        self.start = self.peak = self.rss() or 0
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        end = self.rss()
        self.peak = max(self.peak, end or 0)
        self.growth = self.peak - self.start if end is not None else -1


@dataclass
class SpeedRow:
    scheme: str
    context: int
    decode_ms_median: float
    decode_ms_max: float
    steps: int
    repeats: int
    ratio_vs_dynamic: float = 0.0  # this scheme's median / DynamicCache's median
    prefill_s_median: float = 0.0  # one forward pass over the whole context into this cache
    prefill_ratio_vs_dynamic: float = 0.0
    kv_bytes: int = 0  # real bytes the cache holds after the prefill and all decode steps (model dtype)
    kv_ratio_vs_dynamic: float = 0.0  # DynamicCache bytes / this scheme's bytes
    peak_rss_growth_mib: float = 0.0  # largest peak-RSS growth over the repeats (prefill + decode)
    filled: bool = False  # the context was written as random K/V (roofline.fill_random): prefill_s is that fill
    decode_rss_growth_mib: float = 0.0  # largest peak-RSS growth over the timed decode steps alone
    step_bytes: int = 0  # what a step reads: the weights once and kv_bytes
    bandwidth_gbs: float = 0.0  # median read bandwidth measured in this run at this context, GB/s
    roofline_ms: float = 0.0  # step_bytes at that bandwidth

    @property
    def spike_ratio(self) -> float:
        """Worst decode step / median decode step."""
        return self.decode_ms_max / self.decode_ms_median

    @property
    def x_roofline(self) -> float:
        """Median decode step / its roofline (1.0: as fast as its bytes allow; 0.0 when not measured)."""
        return self.decode_ms_median / self.roofline_ms if self.roofline_ms else 0.0


@dataclass
class _Run:
    prefill_s: float
    steps_s: list[float]
    kv_bytes: int
    rss_growth: int
    decode_rss_growth: int = 0


@torch.no_grad()
def _run_once(model, name: str, ids: torch.Tensor, new_tokens: int, backend: str = "inductor",
              room: int | None = None, fill: bool = False) -> _Run:
    """Fresh cache, timed prefill, one untimed warm-up step, ``new_tokens`` timed single-token steps. A compiled
    scheme runs all of them, prefill included, through its compiled forward (transformers' recipe for a
    ``StaticCache``: the whole forward compiled; ``generate``'s own compile leaves the prefill eager). A static cache
    is sized for the prompt, the warm-up step and ``room`` steps (default ``new_tokens``): a warm-up run gives the
    timed runs' ``room`` so that it compiles their shapes. ``fill``: the prompt's length of random K/V is written into
    the cache instead of a prefill (timed as the prefill)."""
    with scheme_attention(model, name), PeakRSS() as rss:
        cache = make_cache(name, model.config, max_cache_len=ids.shape[1] + 1 + (room or new_tokens))
        forward = scheme_forward(model, name, backend)
        if fill:
            prefill = fill_random(cache, model.config, ids.shape[1], model.dtype, device=model.device)
            token = ids[:, -1:]
        else:
            start = time.perf_counter()
            out = forward(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
            prefill = time.perf_counter() - start
            token = out.logits[:, -1:].argmax(-1)
        token = forward(input_ids=token, **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
        steps = []
        with PeakRSS() as step_rss:
            for _ in range(new_tokens):
                start = time.perf_counter()
                out = forward(input_ids=token, **cache_kwargs(cache), use_cache=True)
                steps.append(time.perf_counter() - start)
                token = out.logits[:, -1:].argmax(-1)
        kv = cache_nbytes(cache)
    return _Run(prefill, steps, kv, rss.growth, step_rss.growth)


def measure_decode_speed(model, schemes: list[str], lengths: list[int], *, new_tokens: int = 32, repeats: int = 3,
                         seed: int = 0, progress=None, compile_backend: str = "inductor",
                         fill_from: int | None = None) -> list[SpeedRow]:
    """Prefill seconds, decode ms/token, KV bytes, peak RSS and the roofline per scheme for each context length.

    After one untimed warm-up run per length, each repeat runs every scheme in turn (``dynamic`` first) on the
    same random prompt, then measures the read bandwidth (:func:`~.roofline.read_bandwidth`, over a buffer larger
    than any of the caches); the medians over all repeats' steps are reported with the worst step, and every ratio
    is against DynamicCache in this run. Peak RSS growth is the largest over the repeats; it is only
    comparable between schemes because the warm-up has grown the heap first (freed memory is reused).

    Args:
        model: a causal LM (its attention is switched for schemes that need it, then restored).
        schemes: names from :mod:`hf_asymkv.bench.schemes` (static ones too: each is built for the prompt and
            every decode step; compiled ones compile in the untimed warm-up).
        lengths: context lengths (prefill tokens).
        new_tokens: timed decode steps per repeat.
        progress: optional ``callable(str)`` told what runs next.
        compile_backend: ``torch.compile``'s backend for the compiled schemes (tests use ``"eager"``: fast).
        fill_from: contexts of at least this many tokens are written as random K/V (one cache update per layer,
            timed in the prefill column) instead of a prompt's prefill; None: every context is prefilled.
    """
    schemes = with_baseline(schemes)
    gen = torch.Generator().manual_seed(seed)
    weights = weight_bytes(model)
    rows = []
    for length in lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, length), generator=gen).to(model.device)
        fill = fill_from is not None and length >= fill_from
        runs: dict[str, list[_Run]] = {name: [] for name in schemes}
        # Untimed: the first run at a new size pays one-time costs (allocator growth, kernel set-up) that would
        # otherwise land on whichever scheme happens to run first, in time and in RSS.
        if progress:
            progress(f"context {length}: warm-up (untimed)")
        # Compiled schemes compile here, at the first step of each length (dynamic=False: one graph per shape).
        for name in [schemes[0], *(s for s in schemes if s in COMPILED)]:
            _run_once(model, name, ids, 1, compile_backend, room=new_tokens, fill=fill)
        bandwidth = []
        for rep in range(repeats):
            for name in schemes:
                if progress:
                    progress(f"context {length}, repeat {rep + 1}/{repeats}: {name}")
                runs[name].append(_run_once(model, name, ids, new_tokens, compile_backend, fill=fill))
            largest = max(r[-1].kv_bytes for r in runs.values())
            bandwidth.append(read_bandwidth(max(weights, largest) * 5 // 4))  # larger than any cache of the run
        rows += _rows(runs, length, new_tokens, repeats, fill, weights, median_bandwidth(bandwidth))
    return rows


def _rows(runs: dict[str, list[_Run]], length: int, new_tokens: int, repeats: int, filled: bool = False,
          weights: int = 0, bandwidth: float = 0.0) -> list[SpeedRow]:
    rows = []
    for name, rs in runs.items():
        steps = [t for r in rs for t in r.steps_s]
        kv = rs[-1].kv_bytes
        rows.append(SpeedRow(name, length, statistics.median(steps) * 1e3, max(steps) * 1e3, new_tokens, repeats,
                             prefill_s_median=statistics.median(r.prefill_s for r in rs), kv_bytes=kv,
                             peak_rss_growth_mib=max(r.rss_growth for r in rs) / 2**20, filled=filled,
                             decode_rss_growth_mib=max(r.decode_rss_growth for r in rs) / 2**20,
                             step_bytes=weights + kv, bandwidth_gbs=bandwidth / 1e9,
                             roofline_ms=(weights + kv) / bandwidth * 1e3 if bandwidth else 0.0))
    base = rows[0]
    for r in rows:
        r.ratio_vs_dynamic = r.decode_ms_median / base.decode_ms_median
        r.prefill_ratio_vs_dynamic = r.prefill_s_median / base.prefill_s_median
        r.kv_ratio_vs_dynamic = base.kv_bytes / r.kv_bytes
    return rows


def format_speed_table(rows: list[SpeedRow]) -> str:
    """Markdown table: the ratios against DynamicCache first, then the absolute figures, the roofline (the step's
    bytes at the run's read bandwidth) and the peak RSS growth of the whole run and of the decode steps alone. A
    context written as random K/V has its fill time in the prefill column, marked "(fill)"."""
    lines = [
        "| scheme | context | decode x DynamicCache | decode ms/token (median) | roofline ms | x roofline | "
        "MB read/step | worst step / median | prefill x DynamicCache | prefill s | KV MiB | KV x smaller | "
        "peak RSS growth MiB | decode RSS growth MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        prefill = f"{r.prefill_s_median:.2f}" + (" (fill)" if r.filled else "")
        lines.append(f"| {r.scheme} | {r.context} | {r.ratio_vs_dynamic:.2f} | {r.decode_ms_median:.1f} | "
                     f"{r.roofline_ms:.1f} | {r.x_roofline:.2f} | {r.step_bytes / 1e6:.0f} | {r.spike_ratio:.2f} | "
                     f"{r.prefill_ratio_vs_dynamic:.2f} | {prefill} | {r.kv_bytes / 2**20:.1f} | "
                     f"{r.kv_ratio_vs_dynamic:.2f} | {r.peak_rss_growth_mib:.0f} | {r.decode_rss_growth_mib:.0f} |")
    return "\n".join(lines)


def bandwidth_line(rows: list[SpeedRow]) -> str:
    """One line: the read bandwidth each context's roofline used."""
    seen = dict.fromkeys((r.context, r.bandwidth_gbs) for r in rows)
    return "read bandwidth (median of one streaming read per repeat): " + ", ".join(
        f"{context} tokens {gbs:.1f} GB/s" for context, gbs in seen)


def plot_speed(rows: list[SpeedRow], path: str | Path, title: str = "") -> Path:
    """PNG: decode ms/token and KV MiB against context length, one line per scheme."""
    from ..plots import require_matplotlib, save_figure

    plt = require_matplotlib()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r.scheme for r in rows):
        mine = sorted((r for r in rows if r.scheme == name), key=lambda r: r.context)
        x = [r.context for r in mine]
        axes[0].plot(x, [r.decode_ms_median for r in mine], marker="o", label=name)
        axes[1].plot(x, [r.kv_bytes / 2**20 for r in mine], marker="o", label=name)
    for ax, label in zip(axes, ("decode ms/token (median)", "KV cache MiB (model dtype)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, Path(path))
