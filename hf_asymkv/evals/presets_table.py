"""The presets and the ablations behind them, measured on the same prompts (``scripts/presets_table.py``).

For every preset, every ablation (one ingredient changed from a preset), ``DynamicCache`` and transformers'
``QuantizedCache`` (quanto int4 and int2):

- bytes: real tensor bytes (``memory_footprint()["total"]`` for ours, every referenced tensor for the others,
  capacity included) after a ``length``-token prefill stored in bf16, against a bf16 ``DynamicCache``, on the
  model and on a tiny random head_dim-128 Llama (bytes depend on shapes only);
- damage: needle prompts (RULER-style, :mod:`hf_asymkv.evals.needle`) answered through each cache from one
  shared full-precision prefill: prompts lost / gained against full precision, answers that differ from full
  precision, and the mean KL(full || scheme) of the next-token distributions of the prompt's last tokens,
  which read the quantized history (logit damage).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ..bench.kv_memory import record_kv, replay_bytes
from ..bench.schemes import SCHEMES
from ..core.cache import AsymKVCache
from ..core.fileio import atomic_write_text
from ..core.presets import PRESETS

__all__ = ["ABLATIONS", "BASELINES", "PresetRow", "ablation_schemes", "format_tables", "measure_bytes",
           "measure_damage", "preset_schemes", "tiny_head_dim_128"]

BASELINES = ["dynamic", "hf-quanto-int4", "hf-quanto-int2"]
"""transformers' own caches beside ours (the real thing, not an emulation)."""

# name -> (preset it changes, overrides, what is ablated)
ABLATIONS: dict[str, tuple[str, dict, str]] = {
    "balanced-no-rotation": ("balanced", {"value_rotation": False}, "V rotation off"),
    "balanced-no-sinks": ("balanced", {"sink_tokens": 0}, "sinks off"),
    "balanced-w128": ("balanced", {"residual_length": 128}, "window 128"),
    "balanced-k-rotation": ("balanced", {"key_rotation": True}, "K rotated too"),
    "balanced-v3": ("balanced", {"value_bits": 3}, "V int3"),
    "default": ("balanced", {"value_rotation": False, "sink_tokens": 0, "residual_length": 128},
                "today's default (no rotation, no sinks, window 128)"),
    "compact-no-rotation": ("compact", {"value_rotation": False}, "V rotation off"),
    "compact-no-sinks": ("compact", {"sink_tokens": 0}, "sinks off"),
    "compact-kblock128": ("compact", {"key_block_size": 128}, "K groups of 128 tokens"),
    "compact-ksym": ("compact", {"key_symmetric": True}, "K int4 symmetric"),
    "compact-vgroup32": ("compact", {"value_group_size": 32}, "V groups of 32 channels"),
    "compact-v4": ("compact", {"value_bits": 4}, "V int4"),
    "max-no-rotation": ("max", {"value_rotation": False}, "V rotation off"),
    "max-kblock128": ("max", {"key_block_size": 128}, "K groups of 128 tokens"),
    "max-k3": ("max", {"key_format": "int3", "key_block_size": 128}, "K int3 asymmetric in 128-token groups"),
    "max-k3-b64-w32": ("max", {"key_format": "int3", "key_block_size": 64, "residual_length": 32},
                       "K int3 asymmetric in 64-token groups, window 32"),
}


def preset_schemes() -> list[str]:
    return [f"asymkv-{name}" for name in PRESETS]


def ablation_schemes() -> list[str]:
    """Register every ablation as a scheme ``abl-<name>`` (once) and return the names."""
    names = []
    for name, (preset, overrides, what) in ABLATIONS.items():
        scheme = f"abl-{name}"
        SCHEMES.setdefault(scheme, (f"preset {preset!r} with {what}",
                                    lambda c, p=preset, o=overrides: AsymKVCache.from_preset(p, c, **o)))
        names.append(scheme)
    return names


@dataclass
class PresetRow:
    scheme: str
    ratio: float = float("nan")  # bf16 DynamicCache bytes / this scheme's bytes, after the prefill (model)
    ratio_d128: float = float("nan")  # the same on a tiny random head_dim-128 Llama
    prompts: int = 0
    correct: int = 0
    lost: int = 0  # prompts full precision answered and this scheme did not
    gained: int = 0
    changed: int = 0  # answers whose tokens differ from full precision's
    tail_kl: float = float("nan")  # mean KL(full || scheme) of the prompt tail's next-token distributions, nats


def tiny_head_dim_128() -> LlamaForCausalLM:
    """A random 2-layer Llama with head_dim 128 (GQA 4/2): bytes depend on shapes only."""
    config = LlamaConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                         num_hidden_layers=2, intermediate_size=128, vocab_size=512, max_position_embeddings=16384)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


def _bytes(cache) -> int:
    from ..bench.memory import cache_nbytes

    return cache.memory_footprint()["total"] if isinstance(cache, AsymKVCache) else cache_nbytes(cache)


@torch.no_grad()
def measure_bytes(model, schemes: list[str], length: int, seed: int = 0) -> dict[str, float]:
    """``{scheme: x smaller than a bf16 DynamicCache}`` after a ``length``-token prefill (same K/V for all)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=gen).to(model.device)
    kv = record_kv(model, ids)
    out, base = {}, None
    for name in ["dynamic", *[s for s in schemes if s != "dynamic"]]:
        cache = SCHEMES[name][1](model.config)
        replay_bytes(cache, kv, length, torch.bfloat16)
        nbytes = _bytes(cache)
        base = nbytes if base is None else base
        out[name] = base / nbytes
    return out


def measure_damage(model, tokenizer, schemes: list[str], length: int, depths: list[float], tasks: list[str],
                   samples: int, show_progress: bool = True) -> tuple[dict[str, dict], list]:
    """Needle prompts through every scheme: ``({scheme: counts and mean tail KL}, rows)``."""
    from .retrieval import run_needle

    rows = run_needle(model, tokenizer, ["dynamic", *[s for s in schemes if s != "dynamic"]], [length], depths,
                      tasks, samples, show_progress=show_progress)
    full = {(r.task, r.depth, r.sample): r.correct for r in rows if r.scheme == "dynamic"}
    stats: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for r in rows:
        s, ref = stats[r.scheme], full[(r.task, r.depth, r.sample)]
        s["prompts"] += 1
        s["correct"] += r.correct
        s["lost"] += ref and not r.correct
        s["gained"] += r.correct and not ref
        s["changed"] += not r.same_as_full
        s["kl_sum"] += r.tail_kl
    return {k: dict(v) for k, v in stats.items()}, rows


def build_rows(schemes: list[str], ratios: dict, ratios_d128: dict, damage: dict) -> list[PresetRow]:
    rows = []
    for name in schemes:
        d = damage.get(name, {})
        n = int(d.get("prompts", 0))
        rows.append(PresetRow(name, ratios.get(name, float("nan")), ratios_d128.get(name, float("nan")), n,
                              int(d.get("correct", 0)), int(d.get("lost", 0)), int(d.get("gained", 0)),
                              int(d.get("changed", 0)), d["kl_sum"] / n if n else float("nan")))
    return rows


def _describe(scheme: str) -> str:
    if scheme.startswith("abl-"):
        preset, _, what = ABLATIONS[scheme[4:]]
        return f"{preset} with {what}"
    return SCHEMES[scheme][0]


def format_tables(rows: list[PresetRow], length: int) -> str:
    """Two markdown tables: presets beside transformers' caches, then the ablations."""
    head = (f"| scheme | x smaller than bf16 ({length} tok, head_dim 64) | x smaller (head_dim 128) | needle correct | "
            "lost / gained vs full | answers changed | tail KL (nats) | settings |\n|---|---:|---:|---:|---:|---:|---:|---|")

    def line(r: PresetRow) -> str:
        return (f"| {r.scheme} | {r.ratio:.2f} | {r.ratio_d128:.2f} | {r.correct}/{r.prompts} | {r.lost} / {r.gained} | "
                f"{r.changed} | {r.tail_kl:.2e} | {_describe(r.scheme)} |")

    main = [line(r) for r in rows if not r.scheme.startswith("abl-")]
    ablations = [line(r) for r in rows if r.scheme.startswith("abl-")]
    text = "### Presets and transformers' caches\n\n" + head + "\n" + "\n".join(main) + "\n"
    if ablations:
        text += "\n### Ablations (one ingredient changed from a preset)\n\n" + head + "\n" + "\n".join(ablations) + "\n"
    return text


def save(rows: list[PresetRow], needle_rows: list, meta: dict, json_path, md_path, length: int) -> None:
    payload = {"meta": meta, "rows": [asdict(r) for r in rows], "needle": [asdict(r) for r in needle_rows]}
    atomic_write_text(json_path, json.dumps(payload, indent=2))
    atomic_write_text(md_path, f"<!-- {meta.get('command')} -->\n\n" + format_tables(rows, length))
