"""What the interrupt guard costs a decode step (issue 56): SmolLM2-135M, two identical caches stepped in turn, one
with the guard of :mod:`hf_asymkv.core.rollback` (a copy of each layer's attribute dicts before every update, and
of the cache's bookkeeping) and one with the undecorated methods; the step times of the two, interleaved; and the
snapshot of one layer alone (best of 2000), times the layers, against the step.

    OMP_NUM_THREADS=1 python scripts/studies/rollback_overhead.py --out results/rollback/overhead.md
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_asymkv import AsymKVCache, cache_kwargs
from hf_asymkv.core.cache import AsymKVCache as CacheClass
from hf_asymkv.core.fileio import atomic_write_text
from hf_asymkv.core.layer import AsymKVLayer
from hf_asymkv.core.rollback import snapshot
from hf_asymkv.models import load_model

PROMPT = 512  # prompt tokens (a quantized history: balanced quantizes from 196 tokens on)
STEPS = 200  # decode steps per cache
PRESET = "balanced"


def unguarded():
    """Swap the guarded methods for their undecorated bodies; returns a function that puts the guard back."""
    swapped = [(AsymKVLayer, "update", AsymKVLayer.update.__wrapped__), (CacheClass, "update", CacheClass._update)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in swapped]
    for owner, name, plain in swapped:
        setattr(owner, name, plain)
    return lambda: [setattr(owner, name, method) for owner, name, method in saved]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=PROMPT)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, _ = load_model()
    ids = torch.randint(100, 20000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    caches = [AsymKVCache.from_preset(PRESET, model.config) for _ in range(2)]
    token = ids[:, -1:]
    times = {"guarded": [], "unguarded": []}
    with torch.no_grad():
        for cache in caches:
            model(ids, **cache_kwargs(cache))
        for _ in range(args.steps):
            for name, cache in zip(times, caches):
                restore = unguarded() if name == "unguarded" else (lambda: None)
                start = time.perf_counter()
                model(token, **cache_kwargs(cache))
                times[name].append(time.perf_counter() - start)
                restore()
    rows = {name: (min(t) * 1e3, statistics.median(t) * 1e3) for name, t in times.items()}
    ratio = rows["guarded"][1] / rows["unguarded"][1]
    layers = [layer for layer in caches[0].layers if isinstance(layer, AsymKVLayer)]
    one = []
    for _ in range(2000):
        start = time.perf_counter()
        snapshot(layers[0])
        one.append(time.perf_counter() - start)
    per_step = min(one) * len(layers) * 1e3
    text = (f"`OMP_NUM_THREADS=1 python scripts/studies/rollback_overhead.py --prompt {args.prompt} --steps "
            f"{args.steps}`\n\nSmolLM2-135M, `{PRESET}`, {args.prompt}-token prompt, {args.steps} decode steps per cache, "
            "interleaved, one thread.\n\n| decode step | best ms | median ms |\n|---|---:|---:|\n"
            + "".join(f"| {name} | {best:.2f} | {median:.2f} |\n" for name, (best, median) in rows.items())
            + f"\nguarded / unguarded, medians: {ratio:.3f}; one layer's snapshot alone {min(one) * 1e6:.1f} us (best of "
            f"2000), x {len(layers)} layers = {per_step:.2f} ms per step, {per_step / rows['unguarded'][0]:.2%} of the "
            "best unguarded step\n")
    print(text)
    if args.out:
        atomic_write_text(args.out, text)


if __name__ == "__main__":
    main()
