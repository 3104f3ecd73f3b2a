"""The accuracy-per-byte frontier: every one of our settings and every peer format, on the same prompts.

For each scheme we record

- **bytes** for a ``bytes_length``-token prefill of the model's shapes: ours and transformers' caches by
  replaying bf16 K/V of those shapes into a real cache and counting its tensors (capacity included, as
  ``memory_footprint()`` does); the peer emulations by :meth:`hf_asymkv.bench.peers.PeerFormat.engine_nbytes`
  (what the peer's engine stores). ``x_smaller`` = bf16 ``DynamicCache`` bytes / the scheme's bytes.
- **accuracy**: needle retrieval (:func:`.retrieval.run_needle`), prompts lost/gained against full precision,
  and the mean KL of the tail's next-token distributions against full precision (nats);
- **attention damage**: per-layer attention KL vs full precision, averaged over layers, and top-8 overlap
  (:func:`.attention.run_attention`), when ``attention_length`` > 0;
- **perplexity damage**: ``delta_ppl_pct`` = 100 * (ppl - full-precision ppl) / full-precision ppl on
  ``ppl_windows`` windows of ``ppl_length`` tokens of natural text (:func:`.ppl.run_ppl`: the second half of each
  window is scored through the scheme's quantized history; default text: the built-in corpus of :mod:`.haystack`),
  when ``ppl_length`` > 0. It can be slightly negative: quantization noise that happens to help on that text.
- **long-decode damage** (:func:`.long_decode.run_long_decode`), when ``decode_steps`` > 0: the KL of the last
  64-step segment of a ``decode_steps``-token generation teacher-forced through the cache, and the greedy
  agreement (steps before the first token that differs from full precision). The KL counts in the Pareto check
  below as one more damage metric (``decode KL``).

The Pareto check: a peer *passes* (is matched) when one of our settings spends no more bytes
(``x_smaller`` at least the peer's) and is at least as accurate on every measured metric (needle prompts lost,
tail KL, attention KL, Δppl %). Values are compared as measured, except Δppl: ours counts as no worse unless it
exceeds the peer's by more than :data:`PPL_TIE_SE` combined standard errors (``sqrt(se_ours**2 + se_peer**2)``,
from each scheme's per-token NLL differences against full precision, :func:`.ppl.run_ppl`). On one 1k-token
window the 8-bit formats' Δppl are a few hundredths of a percent either side of zero, well inside that error, and
ranking them by sign would be ranking noise. A peer no setting of ours matches is a finding, reported as such.

Our settings are the presets (``asymkv-<name>`` for every entry of ``hf_asymkv.PRESETS``) and named variations
of the default, registered as schemes (:data:`OUR_SCHEMES`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ..bench.memory import cache_nbytes
from ..bench.peers import PEERS
from ..bench.schemes import PRESET_NAMES, SCHEMES, make_cache
from ..core.shapes import layer_shapes
from .attention import run_attention
from .common import progress
from .haystack import load_text
from .long_decode import check_long_decode_args, run_long_decode
from .ppl import check_ppl_args, ppl_rows, score_window, text_windows
from .report import flips, plural
from .retrieval import answer_prompt, check_grid, needle_prompts

__all__ = ["BASELINES", "DEFAULT_SCHEMES", "FrontierProgress", "FrontierRow", "OUR_SCHEMES", "PPL_TIE_SE", "frontier_markdown", "kind_of",
           "pareto_check", "pareto_markdown", "run_frontier", "scheme_nbytes"]

OUR_SCHEMES = (*(f"asymkv-{name}" for name in PRESET_NAMES), "asymkv", "asymkv-sinks4", "asymkv-v2", "asymkv-v8")
"""Our presets (``hf_asymkv.PRESETS``), the default and single-field variations of it."""
BASELINES = ("int8-per-tensor", "k4v4-sym", "k4v8-inverted")
"""Our code path with other people's choices: shown, but neither ours nor a peer in the Pareto check."""
TRANSFORMERS_PEERS = ("hf-quanto-int4", "hf-quanto-int2", "hf-fp8")


DEFAULT_SCHEMES = (*OUR_SCHEMES, "int8-per-tensor", *PEERS, *TRANSFORMERS_PEERS)


def kind_of(name: str) -> str:
    """``"reference"``, ``"ours"``, ``"baseline"`` or ``"peer"``."""
    if name == "dynamic":
        return "reference"
    if name in BASELINES:
        return "baseline"
    if name in PEERS or name.startswith("hf-"):
        return "peer"
    return "ours"


@dataclass
class FrontierRow:
    """One scheme's bytes and accuracy on the frontier prompts."""

    scheme: str
    kind: str
    nbytes: int
    x_smaller: float  # bf16 DynamicCache bytes / nbytes
    needle_accuracy: float
    lost: int
    gained: int
    tail_kl: float  # mean KL(full || scheme) of the needle tails' next-token distributions, nats
    attention_kl: float = float("nan")  # per-layer attention KL vs full precision, mean over layers
    attention_top8: float = float("nan")
    ppl: float = float("nan")  # perplexity through the scheme's cache on the ppl windows
    delta_ppl_pct: float = float("nan")  # 100 * (ppl - full-precision ppl) / full-precision ppl; NaN: not measured
    delta_ppl_se: float = 0.0  # standard error of delta_ppl_pct (per-token NLL differences, .ppl.run_ppl)
    decode_kl: float = float("nan")  # long decode: KL of the last 64-step segment, nats; NaN: not measured
    decode_agreement: float = float("nan")  # long decode: greedy steps equal to full precision's, mean over prompts
    description: str = ""
    extra: dict = field(default_factory=dict)


@torch.no_grad()
def scheme_nbytes(name: str, config, tokens: int, seed: int = 0) -> int:
    """Bytes ``name`` holds after a ``tokens``-token prefill and one decode step of ``config``'s shapes (batch 1,
    bf16 K/V).

    A real cache fed random bf16 K/V of those shapes (the bytes depend on shapes and dtype, not on the values):
    peers count what their engine would store for the tokens each layer holds (:meth:`PeerCache.engine_nbytes`;
    sliding-window layers exact and bounded, as ours), everything else its tensors.
    """
    shapes = layer_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    cache = make_cache(name, config)
    # the prefill, then one decode step: transformers' sliding-window layers keep the whole prefill tensor's storage
    # behind their window view until the next update, which an engine would not count
    for n in (tokens, 1):
        for i, shape in enumerate(shapes):
            if shape.holds_kv:
                k, v = (torch.randn(1, shape.kv_heads, n, shape.head_dim, generator=gen).to(torch.bfloat16)
                        for _ in range(2))
                cache.update(k, v, i)
    return cache.engine_nbytes() if name in PEERS else cache_nbytes(cache)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


@dataclass
class FrontierProgress:
    """What a frontier run has measured so far, by phase; :meth:`rows` turns it into table rows at any point, so
    that a run stopped midway leaves the rows of what it finished (unmeasured metrics are NaN).

    ``steps``: per phase, ``[done, total]`` units: attention prompts, ppl windows, long-decode prompts, needle
    prompts.
    """

    schemes: list[str]
    nbytes: dict[str, int]
    steps: dict[str, list[int]]
    needle: list = field(default_factory=list)  # NeedleRow of the prompts answered
    attention: dict = field(default_factory=dict)  # scheme -> AttentionRow
    ppl: dict = field(default_factory=dict)  # scheme -> PplRow over the windows scored
    decode: dict = field(default_factory=dict)  # scheme -> LongDecodeRow

    @property
    def complete(self) -> bool:
        return all(done == total for done, total in self.steps.values())

    def status(self) -> str:
        """``"attention prompts 1 of 1, ppl windows 1 of 1, needle prompts 3 of 6"``."""
        return ", ".join(f"{phase} {done} of {total}" for phase, (done, total) in self.steps.items() if total)

    def rows(self) -> list[FrontierRow]:
        flipped = flips([asdict(r) for r in self.needle]) if self.needle else {}
        per_scheme = defaultdict(list)
        for r in self.needle:
            per_scheme[r.scheme].append(r)
        out = []
        for name in self.schemes:
            mine, att, p, d = per_scheme[name], self.attention.get(name), self.ppl.get(name), self.decode.get(name)
            out.append(FrontierRow(
                name, kind_of(name), self.nbytes[name], self.nbytes["dynamic"] / self.nbytes[name],
                _mean([float(r.correct) for r in mine]), *flipped.get(name, (0, 0)), _mean([r.tail_kl for r in mine]),
                att.kl_mean if att else float("nan"), _mean(att.topk["8"]) if att else float("nan"),
                ppl=p.ppl if p else float("nan"), delta_ppl_pct=p.delta_pct if p else float("nan"),
                delta_ppl_se=p.delta_pct_se if p else 0.0, decode_kl=d.segments[-1] if d else float("nan"),
                decode_agreement=d.agreement_mean if d else float("nan"), description=SCHEMES[name][0]))
        return out


def run_frontier(model, tokenizer, schemes: list[str], lengths: list[int], depths: list[float], tasks: list[str],
                 samples: int = 1, attention_length: int = 0, bytes_length: int | None = None, seed: int = 0,
                 ppl_length: int = 0, ppl_windows: int = 1, text: str | None = None, decode_steps: int = 0,
                 decode_prompt_length: int = 2048, show_progress: bool = True,
                 tick: Callable[[str], None] | None = None,
                 on_step: Callable[[FrontierProgress], None] | None = None) -> list[FrontierRow]:
    """Bytes, needle accuracy and damage of every scheme (``schemes[0]`` must be ``dynamic``).

    Measured in this order: bytes (seconds), attention KL (one prompt), Δppl (per window), long decode (one
    prompt), needle prompts (the longest part, one prompt at a time); ``on_step`` receives the :class:`FrontierProgress` after each unit, so a
    caller can save partial results as they come.

    Args:
        lengths, depths, tasks, samples: the needle grid (see :func:`.retrieval.run_needle`).
        attention_length: prompt length of the attention-KL measurement (0: not measured).
        bytes_length: tokens for the byte count (default: the longest needle length).
        ppl_length, ppl_windows: perplexity windows (:func:`.ppl.run_ppl`, default prefix and chunk; 0: not
            measured).
        text: the perplexity and long-decode text (default: the built-in corpus, :func:`.haystack.load_text`).
        decode_steps, decode_prompt_length: the long-decode measurement (one prompt; 0 steps: not measured).
        tick: called after each (unit, scheme) with where the run is (:class:`.common.Heartbeat`).

    Every scheme must be able to build a cache for the model: filter with :func:`.common.schemes_for` first
    (transformers' ``QuantizedCache`` refuses sliding-window models), as the CLI does.

    Raises:
        ValueError: from the measurements (e.g. a length over the model's limit, a text shorter than
            ``ppl_length`` tokens: checked first, before anything runs).
    """
    windows, prefix = [], 0
    text = load_text(None)[0] if text is None and (ppl_length or decode_steps) else text
    if ppl_length:  # first: a text too short for the window fails before anything runs
        prefix = check_ppl_args(model, ppl_length, ppl_windows, None, 64, schemes)
        windows = text_windows(tokenizer, text, ppl_length, ppl_windows)
    if decode_steps:
        check_long_decode_args(model, tokenizer, schemes, text, decode_prompt_length, decode_steps)
    check_grid(model, lengths, depths, tasks, samples)
    prompts = list(needle_prompts(tokenizer, lengths, depths, tasks, samples, "noise", None, seed))
    tokens = bytes_length or max(lengths)
    state = FrontierProgress(schemes, {name: scheme_nbytes(name, model.config, tokens, seed) for name in schemes},
                             {"attention prompts": [0, int(bool(attention_length))], "ppl windows": [0, len(windows)],
                              "long-decode prompts": [0, int(bool(decode_steps))], "needle prompts": [0, len(prompts)]})
    report = on_step or (lambda state: None)
    report(state)
    if attention_length:
        state.attention = {r.scheme: r for r in run_attention(model, tokenizer, schemes, attention_length, samples=1,
                                                               queries=16, seed=seed, show_progress=False, tick=tick)}
        state.steps["attention prompts"][0] = 1
        report(state)
    scored = []
    for w, ids in enumerate(progress(windows, total=len(windows), desc="ppl windows", enabled=show_progress), 1):
        where = _prefixed(tick, f"ppl window {w}/{len(windows)}")
        scored.append(score_window(model, ids, schemes, prefix, tick=where))
        state.ppl = {r.scheme: r for r in ppl_rows(scored, schemes)}
        state.steps["ppl windows"][0] = w
        report(state)
    if decode_steps:
        state.decode = {r.scheme: r for r in run_long_decode(model, tokenizer, schemes, text, decode_prompt_length,
                                                              decode_steps, seed=seed, show_progress=False,
                                                              tick=tick)}
        state.steps["long-decode prompts"][0] = 1
        report(state)
    for n, (sample, task) in enumerate(progress(prompts, total=len(prompts), desc="needle prompts",
                                                enabled=show_progress), 1):
        state.needle += answer_prompt(model, tokenizer, task, schemes, sample,
                                      _prefixed(tick, f"needle prompt {n}/{len(prompts)}"))
        state.steps["needle prompts"][0] = n
        report(state)
    return state.rows()


def _prefixed(tick: Callable[[str], None] | None, where: str) -> Callable[[str], None] | None:
    return (lambda detail: tick(f"{where}, {detail}")) if tick else None


def _metrics(row: FrontierRow) -> dict[str, float]:
    """Damage metrics, lower is better, that were measured (NaN ones are left out)."""
    lost = float("nan") if math.isnan(row.needle_accuracy) else row.lost  # NaN accuracy: no prompt answered yet
    values = {"needle lost": lost, "tail KL": row.tail_kl, "attention KL": row.attention_kl,
              "Δppl %": row.delta_ppl_pct, "decode KL": row.decode_kl}
    return {k: v for k, v in values.items() if not math.isnan(v)}


PPL_TIE_SE = 2.0
"""Δppl differences within this many combined standard errors count as a tie in :func:`pareto_check`."""


def _no_worse(ours: FrontierRow, peer: FrontierRow, metric: str) -> bool:
    """Whether ``ours`` is at least as good as ``peer`` on ``metric`` (Δppl: up to :data:`PPL_TIE_SE` combined
    standard errors worse, i.e. not distinguishable from measurement noise)."""
    mine, theirs = _metrics(ours).get(metric, math.inf), _metrics(peer)[metric]
    if metric == "Δppl %":
        theirs += PPL_TIE_SE * math.hypot(ours.delta_ppl_se, peer.delta_ppl_se)
    return mine <= theirs


def pareto_check(rows: list[FrontierRow]) -> list[dict]:
    """Per peer: the ours that spend no more bytes and match it on every metric (``witness``), or why none does.

    Returns:
        ``[{"peer", "x_smaller", "passed", "witness", "reached", "metrics": {metric: {"peer", "best_ours", "ok",
        "tie"}}}]``, where ``reached`` says whether any setting of ours is at least as small as the peer,
        ``best_ours`` is the best value among our settings with ``x_smaller >= the peer's``, ``ok`` whether
        one of them is no worse (:func:`_no_worse`) and ``tie`` whether that holds only within the Δppl noise.
    """
    ours = [r for r in rows if r.kind == "ours"]
    out = []
    for peer in (r for r in rows if r.kind == "peer"):
        cheaper = [o for o in ours if o.x_smaller >= peer.x_smaller * (1 - 1e-9)]
        pm = _metrics(peer)
        witness = next((o.scheme for o in sorted(cheaper, key=lambda o: o.tail_kl)
                        if all(_no_worse(o, peer, m) for m in pm)), None) if pm else None  # nothing measured yet
        metrics = {}
        for m, v in pm.items():
            best = min((_metrics(o).get(m, math.inf) for o in cheaper), default=float("nan"))
            ok = any(_no_worse(o, peer, m) for o in cheaper)
            metrics[m] = {"peer": v, "best_ours": best, "ok": ok, "tie": ok and not best <= v}
        out.append({"peer": peer.scheme, "x_smaller": peer.x_smaller, "passed": witness is not None,
                    "witness": witness, "reached": bool(cheaper), "metrics": metrics})
    return out


def _fmt(x: float, digits: int = 4) -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else f"{x:.{digits}g}"


def _ppl_cell(r: FrontierRow) -> str:
    if math.isnan(r.delta_ppl_pct) or not r.delta_ppl_se:
        return _fmt(r.delta_ppl_pct, 3)
    return f"{r.delta_ppl_pct:.3g} ± {r.delta_ppl_se:.2g}"


def _verdict(d: dict) -> str:
    return "WORSE" if not d["ok"] else "tie (within noise)" if d.get("tie") else "ok"


def frontier_markdown(rows: list[FrontierRow], prompts: int, skipped: dict[str, str] | None = None) -> str:
    """One row per scheme, sorted by compression."""
    lines = ["| scheme | kind | KV bytes | x smaller than bf16 | needle acc | lost / gained | tail KL | "
             "attention KL | top-8 overlap | decode KL, last 64 | greedy agreement | Δppl % (± s.e.) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: r.x_smaller):
        asked = not math.isnan(r.needle_accuracy)
        needle = f"{100 * r.needle_accuracy:.0f}% | {r.lost} / {r.gained}" if asked else "- | -"
        lines.append(f"| {r.scheme} | {r.kind} | {r.nbytes:,} | {r.x_smaller:.2f} | {needle} | {_fmt(r.tail_kl)} | "
                     f"{_fmt(r.attention_kl)} | {_fmt(r.attention_top8, 3)} | {_fmt(r.decode_kl)} | "
                     f"{_fmt(r.decode_agreement, 3)} | {_ppl_cell(r)} |")
    text = f"Frontier: bytes and damage per scheme ({plural(prompts, 'needle prompt')})\n\n" + "\n".join(lines)
    if skipped:
        text += "\n\nNot run on this model: " + "; ".join(f"`{s}` ({why})" for s, why in skipped.items())
    return text


def pareto_markdown(checks: list[dict]) -> str:
    """Pass/fail per peer: is one of our settings at least as small and at least as accurate?"""
    lines = ["| peer | x smaller | result | our witness | per metric: peer vs best of ours at >= its compression |",
             "|---|---:|---|---|---|"]
    for c in sorted(checks, key=lambda c: c["x_smaller"]):
        detail = "; ".join(f"{m}: {_fmt(d['peer'], 3)} vs {_fmt(d['best_ours'], 3)} {_verdict(d)}"
                           for m, d in c["metrics"].items())
        # files written before "reached" existed: no setting of ours was that small when every best is NaN
        if not c.get("reached", any(not math.isnan(d["best_ours"]) for d in c["metrics"].values())):
            detail = "no setting of ours reaches this compression"
        elif not c["metrics"]:  # partial results, before any measurement
            detail = "nothing measured yet"
        lines.append(f"| {c['peer']} | {c['x_smaller']:.2f} | {'pass' if c['passed'] else 'FAIL'} | "
                     f"{c['witness'] or '-'} | {detail} |")
    passed = sum(c["passed"] for c in checks)
    return (f"Pareto check: {passed} of {len(checks)} peers matched by a setting of ours that spends no more bytes "
            f"and is at least as accurate on every metric (Δppl: within {PPL_TIE_SE:g} combined standard errors counts "
            "as a tie)\n\n" + "\n".join(lines))
