"""Calibration: record post-RoPE K/V ranges during chunked prefill of long samples, by position bucket.

:class:`ObservingCache` is a full-precision `DynamicCache` (attention must see the exact history) that
records, for every layer with KV, per-(head, channel) key statistics and per-head value statistics, overall
and per position bucket. Its statistics are bounded: ``[kv_heads, head_dim]`` per bucket, plus a top-k buffer
per channel when a percentile is asked for (k = the number of tokens above the percentile).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from ..core.compat import cache_kwargs

__all__ = ["BUCKETS", "LayerStats", "ObservingCache", "bucket_report", "calibrate_model", "format_report",
           "percentile_top_k", "scales_from_stats"]

# (name, first position, end position): the first tokens (attention sinks), short context, mid, long.
BUCKETS = (("sinks", 0, 4), ("<512", 4, 512), ("<4k", 512, 4096), (">=4k", 4096, math.inf))


class LayerStats:
    """Running statistics of one layer. Shapes: K ``[kv_heads, head_dim]``, V ``[kv_heads]``.

    Args:
        top_k: keep the ``top_k`` largest ``|K|`` per channel (for percentiles); 0 for absmax only.
    """

    def __init__(self, heads: int, head_dim: int, top_k: int = 0):
        self.k_absmax = torch.zeros(heads, head_dim)
        self.v_absmax = torch.zeros(heads)
        self.k_bucket = {name: torch.zeros(heads, head_dim) for name, *_ in BUCKETS}
        self.v_bucket = {name: torch.zeros(heads) for name, *_ in BUCKETS}
        self.tokens = {name: 0 for name, *_ in BUCKETS}
        self.top_k = top_k
        self.k_top = torch.zeros(heads, head_dim, 0)
        self.observed = 0  # (batch x token) rows seen per channel

    def observe(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Record ``[B, H, n, D]`` keys/values at positions ``start .. start + n``."""
        k_abs = k.detach().float().abs().nan_to_num(posinf=0.0).cpu()
        v_abs = v.detach().float().abs().nan_to_num(posinf=0.0).cpu()
        n = k_abs.shape[2]
        self.observed += k_abs.shape[0] * n
        self.k_absmax = torch.maximum(self.k_absmax, k_abs.amax(dim=(0, 2)))
        self.v_absmax = torch.maximum(self.v_absmax, v_abs.amax(dim=(0, 2, 3)))
        for name, lo, hi in BUCKETS:
            a, b = max(lo - start, 0), min(hi - start, n)
            if a >= b:
                continue
            self.tokens[name] += b - a
            self.k_bucket[name] = torch.maximum(self.k_bucket[name], k_abs[:, :, a:b].amax(dim=(0, 2)))
            self.v_bucket[name] = torch.maximum(self.v_bucket[name], v_abs[:, :, a:b].amax(dim=(0, 2, 3)))
        if self.top_k:
            rows = k_abs.permute(1, 3, 0, 2).reshape(k_abs.shape[1], k_abs.shape[3], -1)  # [H, D, B*n]
            both = torch.cat([self.k_top, rows], dim=-1)
            self.k_top = both.topk(min(self.top_k, both.shape[-1]), dim=-1).values

    def k_percentile(self, percentile: float) -> torch.Tensor:
        """Per-channel ``percentile`` of ``|K|`` over every observed row, ``[kv_heads, head_dim]``.

        Same definition as ``torch.quantile`` (linear interpolation between the two nearest order statistics),
        computed from the kept top-k values; :func:`percentile_top_k` says how many must be kept.
        """
        if not 0 < percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        if self.observed == 0:
            raise ValueError("no keys observed yet")
        n = self.observed
        pos = percentile / 100.0 * (n - 1)  # ascending rank, as torch.quantile
        lo = min(math.floor(pos), n - 1)
        hi = min(lo + 1, n - 1)
        frac = pos - lo
        d_lo, d_hi = n - 1 - lo, n - 1 - hi  # the same ranks counted from the top (k_top is descending)
        if d_lo >= self.k_top.shape[-1]:
            raise ValueError(f"percentile {percentile} needs the top {d_lo + 1} values per channel, "
                             f"only {self.k_top.shape[-1]} were kept")
        lower, upper = self.k_top[..., d_lo], self.k_top[..., d_hi]
        return lower + frac * (upper - lower)


def percentile_top_k(percentile: float, rows: int) -> int:
    """Top-k buffer size that :meth:`LayerStats.k_percentile` needs for ``percentile`` over ``rows`` observed
    (batch x token) rows per channel (with a margin for rounding)."""
    return min(rows, math.ceil((1 - percentile / 100.0) * rows) + 2)


class ObservingCache(DynamicCache):
    """A full-precision `DynamicCache` that records K/V statistics of every update.

    Args:
        config: the model config.
        top_k: per-channel top-k buffer size for percentile statistics (0: absmax only).
    """

    def __init__(self, config, stats: dict[int, LayerStats] | None = None, top_k: int = 0):
        super().__init__(config=config)
        self.stats: dict[int, LayerStats] = {} if stats is None else stats
        self.top_k = top_k

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        start = self.get_seq_length(layer_idx) if layer_idx < len(self.layers) else 0
        if layer_idx not in self.stats:
            self.stats[layer_idx] = LayerStats(key_states.shape[1], key_states.shape[-1], self.top_k)
        self.stats[layer_idx].observe(key_states, value_states, start)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@dataclass
class CalibrationResult:
    stats: dict[int, LayerStats]
    num_samples: int
    seq_len: int
    seconds: float


@torch.no_grad()
def calibrate_model(model, samples: list[torch.Tensor], *, chunk_size: int = 2048, top_k: int = 0,
                    progress: bool = True, tick: Callable[[str], None] | None = None) -> dict[int, LayerStats]:
    """Run chunked prefill over ``samples`` (each ``[1, seq_len]`` token ids) and return per-layer stats.

    Each sample gets a fresh observing cache (the statistics carry over); logits are computed for one
    position per chunk only (``logits_to_keep=1``), so memory is the KV cache of one sample plus one chunk.
    The model may be spread over devices by an accelerate device map: each layer's K/V arrive on (and its
    cache stays on) that layer's device, and the statistics are gathered on the CPU. ``tick`` is called after
    each chunk with where the run is (the CLI's once-a-minute line, whatever ``progress`` says).
    """
    from tqdm.auto import tqdm

    from ..core.scales import config_fingerprint
    from ..models import input_device

    config_fingerprint(model.config)  # a config the scales file cannot describe fails here, before any model pass
    device = input_device(model)  # not model.device: that is `meta` when a device map offloads the embeddings
    stats: dict[int, LayerStats] = {}
    total = sum(math.ceil(s.shape[-1] / chunk_size) for s in samples)
    bar = tqdm(total=total, desc="calibrating", unit="chunk", disable=not progress)
    for n, ids in enumerate(samples, 1):
        cache = ObservingCache(model.config, stats, top_k)
        for start in range(0, ids.shape[-1], chunk_size):
            chunk = ids[:, start : start + chunk_size].to(device)
            model(input_ids=chunk, use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
            bar.update(1)
            if tick:
                tick(f"sample {n}/{len(samples)}, {start + chunk.shape[-1]} of {ids.shape[-1]} tokens")
        del cache
    bar.close()
    return stats


def scales_from_stats(stats: dict[int, LayerStats], config, *, statistic: str = "absmax",
                      percentile: float = 99.99, metadata: dict | None = None):
    """Build :class:`~hf_asymkv.core.scales.KVScales` from observed statistics.

    Args:
        statistic: ``"absmax"`` or ``"percentile"`` (per-channel ``percentile`` of ``|K|``; V keeps absmax).
    """
    import json

    from ..core.scales import KVScales, config_fingerprint
    from ..version import __version__

    if statistic not in ("absmax", "percentile"):
        raise ValueError(f"statistic must be one of ['absmax', 'percentile'], got {statistic!r}")
    tiny = torch.finfo(torch.float32).tiny  # an all-zero channel still needs a positive range
    k_abs, v_abs = {}, {}
    for i, s in sorted(stats.items()):
        k = s.k_absmax if statistic == "absmax" else s.k_percentile(percentile)
        k_abs[i] = k.clamp(min=tiny)
        v_abs[i] = s.v_absmax.clamp(min=tiny)
    meta = {"fingerprint": json.dumps(config_fingerprint(config)), "statistic": statistic,
            "tool_version": __version__, **(metadata or {})}
    if statistic == "percentile":
        meta["percentile"] = str(percentile)
    return KVScales(k_abs, v_abs, {k: str(v) for k, v in meta.items()})


def bucket_report(stats: dict[int, LayerStats], tolerance: float = 1.10) -> dict:
    """Key/value ranges by position bucket, per layer, and where short context under-estimates long context.

    For each layer: the K absmax (max over heads and channels) and V absmax per bucket, and the fraction of
    (head, channel) pairs whose range in a later bucket exceeds what the first 512 positions showed by more
    than ``tolerance``. ``warnings`` lists those layers: scales calibrated on short samples would overflow.
    """
    layers, warnings = {}, []
    for i, s in sorted(stats.items()):
        short = torch.maximum(s.k_bucket["sinks"], s.k_bucket["<512"])
        row = {"tokens": dict(s.tokens),
               "k_absmax": {b: float(s.k_bucket[b].max()) for b, *_ in BUCKETS if s.tokens[b]},
               "v_absmax": {b: float(s.v_bucket[b].max()) for b, *_ in BUCKETS if s.tokens[b]},
               "sink_vs_rest_k": None, "channels_beyond_short": {}}
        rest = torch.maximum(torch.maximum(s.k_bucket["<512"], s.k_bucket["<4k"]), s.k_bucket[">=4k"])
        if s.tokens["sinks"] and float(rest.max()) > 0:
            row["sink_vs_rest_k"] = float(s.k_bucket["sinks"].max() / rest.max())
        for b in ("<4k", ">=4k"):
            if not s.tokens[b]:
                continue
            ratio = s.k_bucket[b] / short.clamp(min=1e-12)
            frac = float((ratio > tolerance).float().mean())
            row["channels_beyond_short"][b] = {"fraction": frac, "worst_ratio": float(ratio.max())}
            if frac > 0:
                warnings.append(f"layer {i}: {frac:.1%} of K channels exceed their first-512-token range by "
                                f">{tolerance - 1:.0%} in bucket {b} (worst x{float(ratio.max()):.2f})")
        layers[str(i)] = row
    return {"buckets": [b for b, *_ in BUCKETS], "tolerance": tolerance, "layers": layers, "warnings": warnings}


def format_report(report: dict) -> str:
    """Plain-text table: layer x bucket K absmax, and the share of channels beyond the short-context range."""
    buckets = report["buckets"]
    lines = ["layer " + " ".join(f"{'K ' + b:>12}" for b in buckets) + f" {'>short <4k':>11} {'>short >=4k':>11}"]
    for i, row in report["layers"].items():
        cells = " ".join(f"{row['k_absmax'][b]:12.3f}" if b in row["k_absmax"] else f"{'-':>12}" for b in buckets)
        beyond = [row["channels_beyond_short"].get(b, {}).get("fraction") for b in ("<4k", ">=4k")]
        extra = " ".join(f"{'-':>11}" if f is None else f"{f:11.1%}" for f in beyond)
        lines.append(f"{i:>5} {cells} {extra}")
    flagged = [i for i, row in report["layers"].items()
               if any(c["fraction"] > 0 for c in row["channels_beyond_short"].values())]
    if report["warnings"]:  # one warning per (layer, bucket): count the layers
        lines.append(f"WARNING: {len(flagged)} layers see larger keys beyond 512 tokens than within them; "
                     "scales calibrated on short samples would overflow there (see the JSON report).")
    else:
        lines.append("No layer's long-context key range exceeds its short-context range by more than "
                     f"{report['tolerance'] - 1:.0%}.")
    return "\n".join(lines)
