"""Soak: thousands of requests in one process, RSS and every process-wide table printed as they go (issue 56).

A batch job creates and drops a cache per request, or reuses one with ``reset()``; a server adds crops, beam search
and static caches. Each request here is one ``generate`` on a random tiny Llama (built from a config, nothing
downloaded; ``--model default`` uses the embedded SmolLM2 instead), cycling through every preset and these kinds:

- ``new``: a fresh dynamic cache per request;
- ``reuse``: one long-lived cache per preset, ``reset()`` before each request;
- ``crop``: generate, ``crop`` the answer's last tokens away, generate again on the same cache (a second turn);
- ``beam``: beam search (2 beams: ``reorder_cache`` every step);
- ``static``: a static cache (``max_cache_len``) per request;
- ``fused``: the fused attention (``attn_implementation="asymkv_sdpa"``), a fresh dynamic cache;
- ``static_fused``: the fused attention over a static cache (its attention operator).

Prompt and answer lengths are drawn per request (seeded) so that blocks are quantized in prefills and in decode
steps. Every ``--every`` requests (after a garbage collection) it prints the process's resident memory and the size
of every process-wide table the package and transformers keep (:func:`table_sizes`), and at the end the RSS growth
between request ``--baseline`` and the last, against the goal (under 5%), and whether any table grew after the first
cycle of request kinds. ``--out`` writes the same report as markdown.

    OMP_NUM_THREADS=1 python scripts/soak.py --requests 2000 --out results/soak/soak_2000.md
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import os
import resource
import sys
import time

import torch

from hf_asymkv import AsymKVCache, cache_kwargs, register_attention
from hf_asymkv.core.attention import ATTN_IMPLEMENTATION
from hf_asymkv.core.fileio import atomic_write_text
from hf_asymkv.core.registry import PRESET_NAMES

REQUESTS = 2000  # requests in the run
EVERY = 100  # print RSS and the tables every this many requests
BASELINE = 500  # RSS growth is measured from this request on (the allocators have settled by then)
GOAL = 0.05  # largest acceptable RSS growth from the baseline to the end
KINDS = ("new", "reuse", "crop", "beam", "static", "fused", "static_fused")  # request kinds, cycled with the presets
PROMPT_TOKENS = 320  # longest prompt (prompts of 8 tokens up to this, drawn per request)
NEW_TOKENS = 24  # longest answer (answers of 2 tokens up to this, drawn per request)
CROP_TOKENS = 6  # tokens a "crop" request removes before its second turn
SEED = 0  # the request schedule's seed
THREADS = 1  # torch intra-op threads


def rss_bytes() -> int:
    """Resident memory of this process now (``/proc/self/statm``; the peak from ``getrusage`` elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cached(fn) -> int:
    """Entries held by an ``lru_cache`` or :func:`~hf_asymkv.kernels.once.computed_once` function."""
    return fn.cache_info().currsize if hasattr(fn, "cache_info") else fn.cache_size()


def table_sizes() -> dict[str, int]:
    """Entries of every process-wide table the package writes after import (and transformers' registries it writes
    to), plus Python's warning registries and the objects the garbage collector tracks (what a leak would grow)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from hf_asymkv.core import rotation, static_op, wide
    from hf_asymkv.kernels import append, cpu_readout

    sizes = {"rotation._hadamard_cpu": _cached(rotation._hadamard_cpu),
             "rotation._hadamard_on": _cached(rotation._hadamard_on),
             "rotation._signs_cpu": _cached(rotation._signs_cpu), "static_op._parse": _cached(static_op._parse),
             "wide._BIT_TABLES": len(wide._BIT_TABLES), "cpu_readout._library": _cached(cpu_readout._library),
             "cpu_readout._warn_once": _cached(cpu_readout._warn_once), "append._custom_op": _cached(append._custom_op),
             "AttentionInterface": len(AttentionInterface._global_mapping),
             "ALL_MASK_ATTENTION_FUNCTIONS": len(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping)}
    decode = sys.modules.get("hf_asymkv.kernels.decode")  # imports Triton: counted only where something loaded it
    if decode is not None:
        sizes["decode._SPILL_FREE"] = len(decode._SPILL_FREE)
    registries = [vars(m).get("__warningregistry__") for m in list(sys.modules.values()) if hasattr(m, "__dict__")]
    sizes["warning registries"] = sum(len(r) for r in registries if isinstance(r, dict))
    sizes["gc objects"] = len(gc.get_objects())
    return sizes


def tiny_model() -> torch.nn.Module:
    """A random 2-layer Llama (head_dim 16, 2 KV heads), as the tests build it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=1024,
                         initializer_range=0.1)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


class Requests:
    """The request loop: the shared models, the long-lived caches of ``reuse`` requests, the schedule."""

    def __init__(self, model: torch.nn.Module, presets: tuple[str, ...], kinds: tuple[str, ...], seed: int,
                 max_prompt: int = PROMPT_TOKENS, max_new: int = NEW_TOKENS):
        model.generation_config.eos_token_id = None  # fixed-length answers
        model.generation_config.pad_token_id = 0
        self.models = {False: model}
        if any(kind.endswith("fused") for kind in kinds):
            register_attention()
            fused = copy.deepcopy(model)  # its own config: the attention implementation is read from it
            fused.set_attn_implementation(ATTN_IMPLEMENTATION)
            self.models[True] = fused
        self.schedule = list(itertools.product(kinds, presets))
        self.kept = {preset: AsymKVCache.from_preset(preset, model.config) for preset in presets}
        self.rng = torch.Generator().manual_seed(seed)
        self.vocab = model.config.vocab_size
        self.max_prompt, self.max_new = max_prompt, max_new

    def _draw(self, bounds: tuple[int, int]) -> int:
        return int(torch.randint(bounds[0], bounds[1] + 1, (), generator=self.rng))

    def run(self, i: int) -> None:
        """Request ``i``: its kind and preset from the schedule, its lengths drawn."""
        kind, preset = self.schedule[i % len(self.schedule)]
        prompt = torch.randint(3, self.vocab, (1, self._draw((8, self.max_prompt))), generator=self.rng)
        new = self._draw((2, self.max_new))
        model = self.models[kind.endswith("fused")]
        settings = {"max_cache_len": prompt.shape[1] + new} if kind.startswith("static") else {}
        cache = self.kept[preset] if kind == "reuse" else AsymKVCache.from_preset(preset, model.config, **settings)
        if kind == "reuse":
            cache.reset()
        extra = {"num_beams": 2} if kind == "beam" else {}
        out = _generate(model, prompt, cache, new, **extra)
        if kind == "crop":  # a second turn on the cropped conversation
            cache.crop(-min(CROP_TOKENS, new))
            turn = torch.cat([out[:, : cache.get_seq_length()], prompt[:, :8]], dim=1)
            _generate(model, turn, cache, new)


def _generate(model, prompt: torch.Tensor, cache, new: int, **extra) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, **cache_kwargs(cache), max_new_tokens=new, do_sample=False, **extra)


def soak(requests: int, every: int, presets: tuple[str, ...], kinds: tuple[str, ...], model, seed: int = SEED,
         max_prompt: int = PROMPT_TOKENS, max_new: int = NEW_TOKENS):
    """Run the requests; yields ``(request, seconds, rss bytes, table sizes)`` at request 0, every ``every`` and the
    last."""
    loop = Requests(model, presets, kinds, seed, max_prompt, max_new)
    start = time.perf_counter()
    for i in range(requests + 1):
        if i % every == 0 or i == requests:
            gc.collect()
            yield i, time.perf_counter() - start, rss_bytes(), table_sizes()
        if i < requests:
            loop.run(i)


def report(rows: list, baseline: int, cycle: int, command: str) -> tuple[str, dict]:
    """The markdown report and its verdicts: RSS growth from ``baseline`` to the end, tables grown after request
    ``cycle`` (every request kind has run once by then)."""
    names = list(rows[0][3])
    lines = [f"`{command}`", "", "| request | s | RSS MiB | " + " | ".join(names) + " |",
             "|---:|---:|---:|" + "---:|" * len(names)]
    lines += [f"| {i} | {s:.0f} | {rss / 2**20:.1f} | " + " | ".join(str(t[n]) for n in names) + " |"
              for i, s, rss, t in rows]
    base = next((r for r in rows if r[0] >= baseline), rows[0])
    warm = next((r for r in rows if r[0] >= cycle), rows[-1])
    growth = rows[-1][2] / base[2] - 1
    grown = {n: (warm[3][n], rows[-1][3][n]) for n in names if n != "gc objects" and rows[-1][3][n] > warm[3][n]}
    objects = (warm[3]["gc objects"], rows[-1][3]["gc objects"])
    verdict = {"rss_growth": growth, "grown_tables": grown, "gc_objects": objects}
    lines += ["", f"RSS growth from request {base[0]} to {rows[-1][0]}: {growth:+.2%} (goal: under {GOAL:.0%}); "
              f"tables grown after request {warm[0]} (every kind ran once): {grown or 'none'}; objects the garbage "
              f"collector tracks: {objects[0]} at request {warm[0]}, {objects[1]} at the end."]
    return "\n".join(lines) + "\n", verdict


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=REQUESTS)
    p.add_argument("--every", type=int, default=EVERY, help="print RSS and tables every this many requests")
    p.add_argument("--baseline", type=int, default=BASELINE, help="RSS growth is measured from this request")
    p.add_argument("--presets", default=",".join(PRESET_NAMES), help="comma-separated presets to cycle through")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated request kinds, of {list(KINDS)}")
    p.add_argument("--max-prompt", type=int, default=PROMPT_TOKENS, help="longest prompt, in tokens (>= 8)")
    p.add_argument("--max-new", type=int, default=NEW_TOKENS, help="longest answer, in tokens (>= 2)")
    p.add_argument("--model", choices=("tiny", "default"), default="tiny",
                   help="tiny: a random 2-layer Llama; default: the embedded SmolLM2-135M")
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--out", help="also write the report (markdown) here")
    args = p.parse_args(argv)
    presets, kinds = tuple(args.presets.split(",")), tuple(args.kinds.split(","))
    for name, given, allowed in (("--presets", presets, PRESET_NAMES), ("--kinds", kinds, KINDS)):
        if not set(given) <= set(allowed):
            p.error(f"{name} takes values of {list(allowed)}, got {list(given)}")
    if args.requests < 1 or args.every < 1 or args.max_prompt < 8 or args.max_new < 2:
        p.error(f"--requests and --every must be >= 1, --max-prompt >= 8 and --max-new >= 2, got {args.requests}, "
                f"{args.every}, {args.max_prompt} and {args.max_new}")
    torch.set_num_threads(args.threads)
    if args.model == "tiny":
        model = tiny_model()
    else:
        from hf_asymkv.models import load_model

        model = load_model()[0]
    rows = []  # warnings keep Python's default filters: their registries are among the tables watched
    for row in soak(args.requests, args.every, presets, kinds, model, max_prompt=args.max_prompt, max_new=args.max_new):
        rows.append(row)
        i, s, rss, tables = row
        print(f"request {i:5d}  {s:7.0f} s  RSS {rss / 2**20:8.1f} MiB  " + "  ".join(
            f"{k}={v}" for k, v in tables.items()), flush=True)
    command = "OMP_NUM_THREADS=1 python scripts/soak.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text, verdict = report(rows, args.baseline, len(presets) * len(kinds), command.strip())
    print(text.splitlines()[-1])
    if args.out:
        atomic_write_text(args.out, text)
    return verdict


if __name__ == "__main__":
    main()
