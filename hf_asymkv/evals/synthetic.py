"""The reference article's synthetic attention head, re-measured with this package's quantizers.

One head, ``d = 128``, 4096 cached tokens, Gaussian K/V and query, keys with three channel-consistent
outlier channels (7, 23, 88) scaled x20. Each scheme quantizes K and/or V; we report the relative error of
the attention output and the largest logit error against the exact head, over several seeds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..core.quant import QuantSpec, compute_scale_zero, dequantize, quantize

__all__ = ["ARTICLE_TABLE", "SYNTHETIC_SCHEMES", "SyntheticRow", "run_synthetic", "format_synthetic"]

T, D, OUTLIERS, FACTOR = 4096, 128, (7, 23, 88), 20.0

# The article's table (relative output error, max logit error), single seed.
ARTICLE_TABLE = {
    "K+V per-tensor INT8": (0.1049, 0.862),
    "K per-channel, V per-token INT8": (0.0192, 0.099),
    "V per-token only INT8 (K exact)": (0.0070, 0.000),
    "K per-tensor only INT8 (V exact)": (0.1044, 0.862),
}

_PT = QuantSpec("int8", "tensor")  # one scale for the whole block; block = all T tokens -> per tensor
_PC = QuantSpec("int8", "channel")
_PTOK = QuantSpec("int8", "token", D)
# name -> (key spec, key block, value spec, value block); None = kept exact
SYNTHETIC_SCHEMES = {
    "K+V per-tensor INT8": (_PT, T, _PT, T),
    "K per-channel, V per-token INT8": (_PC, T, _PTOK, 1),
    "V per-token only INT8 (K exact)": (None, 0, _PTOK, 1),
    "K per-tensor only INT8 (V exact)": (_PT, T, None, 0),
    "ours: K int8 per-channel/128-block, V int4 per-token": (_PC, 128, QuantSpec("int4", "token", D, False), 1),
    "K fp8-e4m3 per-channel/128-block, V int4 per-token": (
        QuantSpec("fp8_e4m3", "channel"), 128, QuantSpec("int4", "token", D, False), 1),
    "K int4 per-channel/128-block, V int4 per-token (sym K4V4)": (
        QuantSpec("int4", "channel"), 128, QuantSpec("int4", "token", D, True), 1),
}


@dataclass
class SyntheticRow:
    scheme: str
    out_err_mean: float
    out_err_std: float
    max_logit_err_mean: float
    max_logit_err_std: float
    seeds: int


def _roundtrip(x: torch.Tensor, spec: QuantSpec | None, block: int) -> torch.Tensor:
    """``[T, D]`` through quantize/dequantize with ``spec`` (None: exact)."""
    if spec is None:
        return x
    x4, spec = x[None, None], dataclasses.replace(spec, block_size=block)
    scale, zero = compute_scale_zero(x4, spec)
    return dequantize(quantize(x4, scale, zero, spec), scale, zero, spec)[0, 0]


def _head(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, D, generator=g)
    k[:, list(OUTLIERS)] *= FACTOR
    return k, torch.randn(T, D, generator=g), torch.randn(D, generator=g)


def _attend(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (k.double() @ q.double()) / math.sqrt(D)
    return torch.softmax(logits, dim=-1) @ v.double(), logits


def run_synthetic(seeds: int = 5) -> list[SyntheticRow]:
    """Every scheme of :data:`SYNTHETIC_SCHEMES` on ``seeds`` random heads (seeds 0 .. seeds-1)."""
    errs: dict[str, list[tuple[float, float]]] = {name: [] for name in SYNTHETIC_SCHEMES}
    for seed in range(seeds):
        k, v, q = _head(seed)
        ref, ref_logits = _attend(k, v, q)
        for name, (k_spec, k_block, v_spec, v_block) in SYNTHETIC_SCHEMES.items():
            out, logits = _attend(_roundtrip(k, k_spec, k_block), _roundtrip(v, v_spec, v_block), q)
            errs[name].append((float((out - ref).norm() / ref.norm()), float((logits - ref_logits).abs().max())))
    rows = []
    for name, values in errs.items():
        o = torch.tensor([e[0] for e in values], dtype=torch.float64)
        m = torch.tensor([e[1] for e in values], dtype=torch.float64)
        std = (lambda t: float(t.std()) if len(t) > 1 else 0.0)
        rows.append(SyntheticRow(name, float(o.mean()), std(o), float(m.mean()), std(m), seeds))
    return rows


def format_synthetic(rows: list[SyntheticRow]) -> str:
    """Markdown table: ours (mean ± std over seeds) beside the article's single-seed numbers."""
    lines = ["| scheme | relative output error | max logit error | article: output error | article: max logit |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        art = ARTICLE_TABLE.get(r.scheme)
        art_cells = f"{art[0]:.4f} | {art[1]:.3f}" if art else "- | -"
        lines.append(f"| {r.scheme} | {r.out_err_mean:.4f} ± {r.out_err_std:.4f} | "
                     f"{r.max_logit_err_mean:.3f} ± {r.max_logit_err_std:.3f} | {art_cells} |")
    return "\n".join(lines)
