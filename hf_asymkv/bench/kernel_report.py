"""The decode kernels' static report (``scripts/kernel_report.py``): what the Triton decode attention issues per byte
of K/V it reads, on CUDA cards this machine does not have.

For each configuration (preset x query dtype x head_dim x query rows x target) it builds a real cache layer at
Llama-3-8B's KV shapes (8 KV heads, ``context`` tokens), the arguments the launcher builds for one decode step
(:func:`~hf_asymkv.kernels.decode.plan_decode_attention`, with the card's SM count), compiles both kernels for the
target (:mod:`hf_asymkv.kernels.sass`) and records registers, local memory (spills), shared memory, and the main
loop of the partial-attention kernel (its tile loop over the quantized region) by instruction class.

The figure of merit is warp instructions per K/V byte: main-loop instructions x warps / bytes of one tile (codes,
scales, zeros, wide channels' bits and indices of ``TILE`` tokens). A card issues at most ``SMs x 4 schedulers x
clock`` warp instructions per second and reads ``bandwidth`` bytes per second; a kernel above their ratio (the
budget, :data:`CARDS`) is bound by its instructions, not by its bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from dataclasses import dataclass

import torch

__all__ = ["CARDS", "CONTEXT", "DTYPES", "HEAD_DIMS", "QUERY_ROWS", "SHARED_CASES", "TARGETS", "Card", "Config",
           "baseline", "grid", "markdown", "measure", "record_guard", "shared_cases", "target_rows", "token_bytes", "write"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_DIMS = (64, 128, 256)
QUERY_ROWS = {"gqa1-q1": (1, 1), "gqa4-q1": (4, 1), "gqa4-q5": (4, 5)}
"""Query heads per KV head and query tokens: multi-head decode, Llama-3's GQA 4 decode, a 5-token draft."""
WIDEST_ROWS = {"gqa8-q16": (8, 16)}
"""The most query rows one program holds (:data:`~hf_asymkv.kernels.regions.MAX_QUERY_ROWS`)."""
KV_HEADS = 8  # Llama-3-8B
CONTEXT = 32768  # tokens in the cache; the code compiled does not depend on it (strides stay multiples of 16)
SM_COUNT = {"sm_90a": 132, "sm_89": 128, "sm_80": 108}  # H100 SXM / H200, RTX 4090, A100: the split count's card


@dataclass(frozen=True)
class Card:
    """A card's issue rate and bandwidth (nominal datasheet figures): ``budget`` = warp instructions per byte."""

    name: str
    arch: str
    sms: int
    ghz: float
    tbps: float

    @property
    def budget(self) -> float:
        return self.sms * 4 * self.ghz * 1e9 / (self.tbps * 1e12)


CARDS = (Card("H100 SXM", "sm_90a", 132, 1.98, 3.35), Card("H200", "sm_90a", 132, 1.98, 4.8),
         Card("RTX 4090", "sm_89", 128, 2.52, 1.008), Card("A100 80GB", "sm_80", 108, 1.41, 2.039))
TARGETS = {"quality": 0.10, "balanced": 0.10, "lean": 0.15, "compact": 0.15, "tight": 0.25, "max": 0.25}
"""Issue 37's goals: main-loop warp instructions per K/V byte, sm_90a, Llama-3-8B shapes, bf16, GQA 4, 1 token."""
CONVERSION_TARGET = 0.01
"""Issue 37: conversion instructions per byte for int8 and int4 codes (``balanced``, ``lean``)."""


@dataclass(frozen=True)
class Config:
    """One compiled configuration."""

    preset: str
    dtype: str
    head_dim: int
    rows: str
    arch: str

    @property
    def name(self) -> str:
        return f"{self.preset}-{self.dtype}-d{self.head_dim}-{self.rows}-{self.arch}"

    @classmethod
    def parse(cls, name: str) -> Config:
        """The configuration called ``name`` (:attr:`name`'s form, e.g. ``balanced-bf16-d128-gqa4-q1-sm_90a``).

        Raises:
            ValueError: a name not of that form, or naming an unknown preset, dtype, query rows or target.
        """
        from ..core.presets import preset_names

        match = re.fullmatch(r"(\w+)-(\w+)-d(\d+)-(gqa\d+-q\d+)-(sm_\w+)", name)
        if match is None:
            raise ValueError(f"configuration {name!r}: expected PRESET-DTYPE-dHEAD_DIM-gqaN-qM-ARCH, e.g. "
                             "balanced-bf16-d128-gqa4-q1-sm_90a.")
        preset, dtype, head_dim, rows, arch = match.groups()
        for what, value, allowed in (("preset", preset, preset_names()), ("dtype", dtype, list(DTYPES)),
                                     ("query rows", rows, [*QUERY_ROWS, *WIDEST_ROWS]), ("target", arch, list(SM_COUNT))):
            if value not in allowed:
                raise ValueError(f"configuration {name!r}: unknown {what} {value!r}; allowed: {allowed}.")
        return cls(preset, dtype, int(head_dim), rows, arch)


def grid(presets, dtypes=("bf16", "fp16"), head_dims=HEAD_DIMS, rows=tuple(QUERY_ROWS), arches=tuple(SM_COUNT)
         ) -> list[Config]:
    """Every combination, target by target."""
    return [Config(p, d, h, r, a) for a, p, d, h, r in itertools.product(arches, presets, dtypes, head_dims, rows)]


SHARED_CASES = dict(dtypes=("fp32", "bf16"), head_dims=(256,), rows=tuple(WIDEST_ROWS))
"""The launches that ask the most shared memory: the widest operands (float32, head_dim 256) and the most query rows
(``kernel_report.md`` shows the sweep that picked them)."""


def shared_cases(presets, arches=tuple(SM_COUNT)) -> list[Config]:
    return grid(presets, arches=arches, **SHARED_CASES)


@functools.lru_cache(maxsize=4)
def _layer_kv(preset: str, dtype: str, head_dim: int, context: int):
    """A ``preset`` cache layer's ``QuantizedKV`` keys and values after ``context`` random tokens and one decode
    step, Llama-3-8B's KV heads (keys with an outlier channel, as real keys have)."""
    from transformers import LlamaConfig

    from ..core.attention import ATTN_IMPLEMENTATION, register
    from ..core.cache import AsymKVCache

    register()
    config = LlamaConfig(num_hidden_layers=1, hidden_size=KV_HEADS * head_dim, num_attention_heads=KV_HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=head_dim, vocab_size=16, intermediate_size=16)
    config._attn_implementation = ATTN_IMPLEMENTATION
    cache = AsymKVCache.from_preset(preset, config)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, KV_HEADS, context + 1, head_dim, generator=g)
    keys[..., 3] *= 10
    values = torch.randn(1, KV_HEADS, context + 1, head_dim, generator=g)
    cache.update(keys[:, :, :context].to(DTYPES[dtype]), values[:, :, :context].to(DTYPES[dtype]), 0)
    return cache.update(keys[:, :, context:].to(DTYPES[dtype]), values[:, :, context:].to(DTYPES[dtype]), 0)


def token_bytes(region) -> float:
    """Bytes per token of one KV head of a quantized region (codes, scales, zeros, wide channels' bits and indices;
    keys and values): what a program reads per token."""
    total = 0
    for stored in (region.keys, region.values):
        parts = (stored.codes, stored.scale, stored.zero, stored.wide_bits, stored.wide_channels)
        total += sum(t.numel() * t.element_size() for t in parts if t is not None)
    batch, heads = region.keys.codes.shape[:2]
    return total / (batch * heads * region.tokens)


def _launches(config: Config, context: int):
    """``(launches, region)``: what the launcher would launch for ``config``'s decode step."""
    from ..core.backend import kernel_regions
    from ..kernels import sass
    from ..kernels.decode import LaunchConfig, plan_decode_attention

    n_rep, q_len = {**QUERY_ROWS, **WIDEST_ROWS}[config.rows]
    key, value = _layer_kv(config.preset, config.dtype, config.head_dim, context)
    region, segments = kernel_regions(key, value, None, 1)
    query = torch.randn(1, KV_HEADS * n_rep, q_len, config.head_dim).to(DTYPES[config.dtype])
    card = LaunchConfig(sm_count=SM_COUNT[config.arch], capability=sass.ARCHES[config.arch])
    launches, _ = plan_decode_attention(query, config.head_dim**-0.5, quantized=region, exact=segments,
                                        kv_len=key.shape[2], launch=card)
    return launches, region


def measure(configs: list[Config], context: int = CONTEXT, progress=None, lines: int = 0) -> list[dict]:
    """One row per configuration: the partial kernel's :class:`~hf_asymkv.kernels.sass.CompiledStats` with its loop
    per K/V byte, and the merge kernel's registers, spills and shared memory; with ``lines``, also the loop's
    ``lines`` source lines that issue the most (``row["lines"]``: file, line, instructions, opcode counts; see
    :func:`~hf_asymkv.kernels.sass.code_loop_lines`)."""
    from ..kernels import sass
    from ..kernels.decode import settle_spills, spill_alternatives

    rows = []
    for config in sorted(configs, key=lambda c: (c.preset, c.dtype, c.head_dim, c.arch, c.rows)):
        launches, region = _launches(config, context)
        built = {}

        def local_bytes(launch) -> int:
            built[launch.options["num_warps"]] = compiled = sass.compile_launch(launch.kernel, launch.grid,
                                                                                 launch.args, launch.options)
            return sass.stats(compiled).local_bytes

        with sass.cuda_target(sass.ARCHES[config.arch]):
            # the launcher's fallbacks when the planned launch spills (decode.spill_alternatives), as on the card
            candidates = spill_alternatives(launches[0])
            chosen, tried = settle_spills(candidates, local_bytes)
            launches = (candidates[chosen], *launches[1:])
            compiled = [built[launches[0].options["num_warps"]],
                        *(sass.compile_launch(k.kernel, k.grid, k.args, k.options) for k in launches[1:])]
        partial, merge = (sass.stats(c) for c in compiled)
        options = launches[0].options
        tile_bytes = token_bytes(region) * options["TILE"]
        row = {**dataclasses.asdict(config), "name": config.name, "tile": options["TILE"],
               "num_warps": partial.num_warps, "num_stages": options["num_stages"], "tile_bytes": tile_bytes,
               "registers": partial.registers, "local_bytes": partial.local_bytes,
               "spill_instructions": partial.spill_instructions, "shared_bytes": partial.shared_bytes,
               "loop_instructions": partial.loop_instructions, "loop": partial.loop,
               "per_byte": partial.loop_instructions * partial.num_warps / tile_bytes,
               "per_byte_by_class": {k: v * partial.num_warps / tile_bytes for k, v in partial.loop.items()},
               "merge": {"registers": merge.registers, "local_bytes": merge.local_bytes,
                         "spill_instructions": merge.spill_instructions, "shared_bytes": merge.shared_bytes},
               "shared_limit": sass.SHARED_LIMIT_BYTES[sass.ARCHES[config.arch]],
               # the launches tried (planned first, then the launcher's fallbacks): local bytes of each, the one kept
               "spill_tries": tried, "fallback": chosen,
               # two plane sets joined by PTX that needs each thread's bytes in groups of four channels of one token
               "joined_ops": sass.joined_ops(compiled[0].asm["ttgir"]),
               "join_problems": sass.joined_groups_by_token(compiled[0].asm["ttgir"])}
        if lines:
            found = sass.code_loop_lines(compiled[0].asm["cubin"])
            row["lines"] = [{"file": file, "line": line, "instructions": sum(ops.values()), "opcodes": dict(ops)}
                            for (file, line), ops in list(found.items())[:lines]]
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


def _kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def _flags(row: dict) -> str:
    """What is wrong with a row's resources, in words ('' when nothing is)."""
    from ..kernels.sass import REGISTER_CAP

    problems = []
    if len(row.get("spill_tries", ())) > 1:
        problems.append(f"planned launch spilled {row['spill_tries'][0]} B, fell back to {row['num_warps']} warps")
    if row["local_bytes"] or row["spill_instructions"]:
        problems.append(f"spills ({row['local_bytes']} B local, {row['spill_instructions']} LDL/STL)")
    if row["registers"] >= REGISTER_CAP:
        problems.append("at the register cap")
    problems.extend(row.get("join_problems", ()))
    for kernel, item in (("partial", row), ("merge", row["merge"])):
        if item["shared_bytes"] > row["shared_limit"]:
            problems.append(f"{kernel} shared {_kib(item['shared_bytes'])} KiB > {_kib(row['shared_limit'])}")
    return "; ".join(problems)


def target_rows(rows: list[dict]) -> list[dict]:
    """The rows issue 37's goals are about (sm_90a, bf16, head_dim 128, GQA 4, 1 query token), preset order."""
    chosen = {r["preset"]: r for r in rows
              if (r["arch"], r["dtype"], r["head_dim"], r["rows"]) == ("sm_90a", "bf16", 128, "gqa4-q1")}
    return [chosen[p] for p in TARGETS if p in chosen]


def markdown(report: dict) -> str:
    """The report as markdown: the budget, the goals' configurations, every configuration by target, the
    largest shapes' shared memory."""
    meta, rows = report["meta"], report["rows"]
    lines = ["# Decode kernel report (compiled for the card, counted without one)", "",
             f"`{meta['command']}` (triton {meta['triton']}, torch {meta['torch']}, commit {meta['commit']}, "
             f"{meta['context']} tokens of context, {KV_HEADS} KV heads). Written by "
             "`hf_asymkv/bench/kernel_report.py`: each configuration is compiled through Triton's JIT for the target "
             "with the launch settings the launcher picks for that card, and disassembled with the wheel's "
             "`cuobjdump`. Figures: main-loop warp instructions (the tile loop over the quantized region) x warps / "
             "K/V bytes of one tile (codes, scales, zeros, wide channels' bits and indices).", "",
             "**Budget.** A card issues at most SMs x 4 schedulers x clock warp instructions per second; at its "
             "bandwidth that is the budget below per byte read. A kernel above it is bound by what it issues, not by "
             "its bytes; real kernels need well under it (latency, dependencies): aim at half.", "",
             "| card | target | SMs | GHz | TB/s | budget (warp instr / byte) | half |", "|---|---|---:|---:|---:|---:|---:|"]
    for card in CARDS:
        lines.append(f"| {card.name} | {card.arch} | {card.sms} | {card.ghz} | {card.tbps} | {card.budget:.3f} | "
                     f"{card.budget / 2:.3f} |")
    budgets = {c.name: c.budget for c in CARDS if c.arch == "sm_90a"}
    goal = target_rows(rows)
    baseline = report.get("baseline")  # {"meta": ..., "per_byte": {name: figure}} of an earlier report, or None
    if goal:
        before = "" if baseline is None else f" The before column is `{baseline['meta']['command']}` at commit " \
            f"{baseline['meta']['commit']} (triton {baseline['meta']['triton']})."
        lines += ["", "## Issue 37's goals: sm_90a, Llama-3-8B shapes, bf16, GQA 4, 1 query token", "",
                  "Per KV byte: all main-loop warp instructions, then by class. Per tile and warp: the loop's "
                  "instruction count." + before, "",
                  "| preset | tile | warps | stages | bytes / tile | instr / byte | before | goal | x H100 budget | "
                  "x H200 budget | global | conversion | integer | float | mma | shared+sync | other | per tile per warp "
                  "| registers | shared KiB | problems |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
                  "---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in goal:
            c = r["per_byte_by_class"]
            was = None if baseline is None else baseline["per_byte"].get(r["name"])
            lines.append(
                f"| {r['preset']} | {r['tile']} | {r['num_warps']} | {r['num_stages']} | {r['tile_bytes']:.0f} | "
                f"**{r['per_byte']:.3f}** | {'-' if was is None else f'{was:.3f}'} | {TARGETS[r['preset']]:.2f} | "
                f"{r['per_byte'] / budgets['H100 SXM']:.2f} | "
                f"{r['per_byte'] / budgets['H200']:.2f} | {c['global']:.4f} | {c['conversion']:.4f} | "
                f"{c['integer']:.4f} | {c['float']:.4f} | {c['mma']:.4f} | {c['shared_sync']:.4f} | {c['other']:.4f} | "
                f"{r['loop_instructions']} | {r['registers']} | {_kib(r['shared_bytes'])} | {_flags(r) or '-'} |")
    for arch in sorted({r["arch"] for r in rows}, key=list(SM_COUNT).index):
        budget = {c.arch: c.budget for c in CARDS}[arch]
        lines += ["", f"## {arch}: every configuration (budget {budget:.3f} warp instr / byte, "
                      f"shared memory limit {_kib(_limit(arch))} KiB)", "",
                  "| configuration | tile | warps | stages | instr / byte | conversion / byte | per tile per warp | "
                  "registers | shared KiB | merge registers | merge shared KiB | problems |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in (r for r in rows if r["arch"] == arch):
            lines.append(f"| {r['name']} | {r['tile']} | {r['num_warps']} | {r['num_stages']} | {r['per_byte']:.3f} | "
                         f"{r['per_byte_by_class']['conversion']:.4f} | {r['loop_instructions']} | {r['registers']} | "
                         f"{_kib(r['shared_bytes'])} | {r['merge']['registers']} | "
                         f"{_kib(r['merge']['shared_bytes'])} | {_flags(r) or '-'} |")
    return "\n".join(lines) + "\n"


def _limit(arch: str) -> int:
    from ..kernels.sass import ARCHES, SHARED_LIMIT_BYTES

    return SHARED_LIMIT_BYTES[ARCHES[arch]]


def write(out_dir, report: dict) -> list:
    """Write ``kernel_report.json`` and ``kernel_report.md`` into ``out_dir``; returns their paths."""
    import json
    from pathlib import Path

    from ..core.fileio import atomic_write_text

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [atomic_write_text(out_dir / "kernel_report.json", json.dumps(report, indent=1) + "\n"),
            atomic_write_text(out_dir / "kernel_report.md", markdown(report))]


def baseline(path) -> dict:
    """An earlier report's (``kernel_report.json`` at ``path``) command and instructions per byte by configuration,
    for the before column of :func:`markdown`."""
    import json
    from pathlib import Path

    try:
        earlier = json.loads(Path(path).read_text())
        return {"meta": earlier["meta"], "per_byte": {r["name"]: r["per_byte"] for r in earlier["rows"]}}
    except (ValueError, KeyError, TypeError) as error:  # not JSON, or JSON of another shape (e.g. the guard file)
        raise ValueError(f"{path}: not a kernel_report.json (expected 'meta' and 'rows' with each configuration's "
                         f"'name' and 'per_byte'): {error!r}") from None


def record_guard(path, report: dict):
    """Merge ``report``'s instructions per byte (by configuration) into the guard file at ``path`` under its Triton
    version, keeping other versions' figures: ``{"figures": {version: {name: per_byte}}, "commands": {version: ...}}``.
    The CI guard compares a fresh compile with the figure of its own Triton version."""
    import json
    from pathlib import Path

    from ..core.fileio import atomic_write_text

    path = Path(path)
    guard = json.loads(path.read_text()) if path.exists() else {"figures": {}, "commands": {}}
    version = report["meta"]["triton"]
    guard["figures"][version] = {r["name"]: round(r["per_byte"], 5) for r in report["rows"]}
    guard["commands"][version] = report["meta"]["command"]
    return atomic_write_text(path, json.dumps(guard, indent=1, sort_keys=True) + "\n")
