"""Launch-setting sweep of the Triton decode attention and a profile of whole-model decode steps, for
``scripts/gpu_check.py --parts tune,profile``: what to measure when the kernel is slower than its bytes say.

The sweep times the attention alone (one layer, one query token; CUDA-graph replay on a GPU) over the same codes
for every :class:`~hf_asymkv.kernels.decode.LaunchConfig` of a small grid (warps x pipeline stages x tile) and
splits per SM, next to the default launch; the profile lists the operators a few decode steps spend their time
in (``torch.profiler``), per scheme.
"""

from __future__ import annotations

import itertools
import time
import traceback

import torch

from ..core.attention import fused_attention
from ..core.backend import kernel_regions
from ..core.quant import sqnr_db
from .gpu_attention import graph_seconds, quantized_kv
from .gpu_runs import cache_kwargs, greedy_steps, make_gpu_cache, prompt_ids, scheme_context, timed_seconds

__all__ = ["GRID", "PROGRAMS_PER_SM", "best_rows", "launch_rows", "markdown", "profile_rows"]

GRID = {"num_warps": (1, 2, 4), "num_stages": (1, 2), "tile": (32, 64)}
"""The launch settings swept (each combination is one kernel compile per preset and dtype): the fast path's
2 and 4 warps (``fast_warps``) and 1, which issued fewest instructions per byte for ``lean``'s 32-token tiles (0.141
with one stage, kernel report) at the price of resident warps, the trade only a timing can settle; 1 and 2 stages
(the launcher's; 3 asked more shared memory than the card has for float32 queries); 32 and 64 tokens (``lean``'s
default tile holds two 32-token key blocks, ``decode.two_key_blocks``: both sizes are swept for it). 12 compiles, as
many as the sweep before."""
PROGRAMS_PER_SM = (1, 2, 4, 8)
"""Split counts swept for each compiled combination (no new compile)."""


def _launcher(query, region, segments, kv_len: int, scale: float, launch, programs_per_sm: int | None = None):
    from dataclasses import replace

    from ..kernels.decode import launch_decode_attention

    launch = launch if programs_per_sm is None else replace(launch, programs_per_sm=programs_per_sm)
    return lambda: launch_decode_attention(query, scale, quantized=region, exact=segments, kv_len=kv_len,
                                           launch=launch)


@torch.no_grad()
def launch_rows(model, presets: list[str], batches: list[int], context: int, iters: int, dtypes: list[torch.dtype],
                deadline: float | None = None) -> list[dict]:
    """One row per (preset, dtype, batch, launch setting, programs per SM): microseconds per call (graph replay,
    else eager) and SQNR against the torch fused attention; a setting that fails to compile or launch is recorded
    with its error. Stops starting new presets/batches after ``deadline`` (``time.monotonic()``)."""
    from ..kernels.decode import LaunchConfig, two_key_blocks
    from ..kernels.regions import tile_tokens

    scale = model.config.head_dim**-0.5
    rows = []
    for preset, dtype, batch in itertools.product(presets, dtypes, batches):
        label = str(dtype).replace("torch.", "")
        if deadline is not None and time.monotonic() > deadline:
            rows.append({"preset": preset, "dtype": label, "batch": batch, "status": "skipped: time budget"})
            continue
        key, value, query = quantized_kv(model, preset, batch, context, dtype)
        want = fused_attention(query, key, value, None, scale)
        region, segments = kernel_regions(key, value, None, query.shape[2])  # once: every setting reads the same
        default_tile = tile_tokens(region)
        grid = [LaunchConfig(**dict(zip(GRID, values))) for values in itertools.product(*GRID.values())]
        query_rows = query.shape[1] // region.keys.codes.shape[1] * query.shape[2]
        # tiles inside a key scale group, or of two (lean's, at few query rows)
        configs = [LaunchConfig()] + [c for c in grid if default_tile % c.tile == 0
                                      or two_key_blocks(region, c.tile, query_rows)]
        for launch in configs:
            for per_sm in (None,) if launch == LaunchConfig() else PROGRAMS_PER_SM:
                row = {"preset": preset, "dtype": label, "batch": batch, "context": context,
                       "num_warps": launch.num_warps, "num_stages": launch.num_stages, "tile": launch.tile,
                       "programs_per_sm": per_sm, "default": launch == LaunchConfig()}
                try:
                    fn = _launcher(query, region, segments, key.shape[2], scale, launch, per_sm)
                    row["sqnr_db"] = sqnr_db(want, fn())
                    graph = graph_seconds(fn, iters, model.device)
                    if graph is None:
                        graph, _ = timed_seconds(lambda: [fn() for _ in range(iters)], model.device)  # noqa: B023
                        graph /= iters
                    row["us"] = graph * 1e6
                except Exception as exc:  # a setting that does not fit this GPU (shared memory, registers)
                    row["status"] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
                    break  # the other split counts of this setting compile the same kernel
                finally:
                    rows.append(row)
        print(f"tune {preset} {dtype} batch {batch}: {len(configs)} settings", flush=True)
    return rows


def best_rows(rows: list[dict]) -> list[dict]:
    """Per (preset, dtype, batch): the default launch's row and the fastest row, with the speed-up."""
    out = []
    keys = dict.fromkeys((r["preset"], r["dtype"], r["batch"]) for r in rows)
    for preset, dtype, batch in keys:
        group = [r for r in rows if (r["preset"], r["dtype"], r["batch"]) == (preset, dtype, batch) and "us" in r]
        if not group:
            continue
        default = next((r for r in group if r.get("default")), None)
        best = min(group, key=lambda r: r["us"])
        out.append({"preset": preset, "dtype": dtype, "batch": batch, "default_us": default and default["us"],
                    "best_us": best["us"], "best": {k: best[k] for k in ("num_warps", "num_stages", "tile",
                                                                          "programs_per_sm")},
                    "x_default": default and default["us"] / best["us"]})
    return out


@torch.no_grad()
def profile_rows(model, names: list[str], batch: int, context: int, steps: int = 3, top: int = 15) -> list[dict]:
    """For each scheme: the attention implementation, ms per decode step (after 4 warm-up steps) and the ``top``
    operators by self CPU time and by self device time over ``steps`` profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    device = model.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    ids = prompt_ids(model, batch, context)
    rows = []
    for name in names:
        row = {"scheme": name, "batch": batch, "context": context}
        try:
            with scheme_context(model, name):
                row["attn_implementation"] = model.config._attn_implementation
                cache = make_gpu_cache(name, model, context + 64)
                token = model(input_ids=ids, **cache_kwargs(cache), logits_to_keep=1).logits[:, -1:].argmax(-1)
                token = greedy_steps(model, cache, token, 4)
                seconds, _ = timed_seconds(lambda: greedy_steps(model, cache, token, steps), device)  # noqa: B023
                row["step_ms"] = seconds * 1e3 / steps
                with profile(activities=activities) as prof:
                    greedy_steps(model, cache, token, steps)
                events = prof.key_averages()
                row["cpu_top"] = _top(events, "self_cpu_time_total", top, steps)
                if device.type == "cuda":
                    row["device_top"] = _top(events, "self_device_time_total", top, steps)
        except Exception as exc:
            traceback.print_exc()
            row["status"] = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
        rows.append(row)
        print(f"profile {name}: {row.get('status', 'ok')} {row.get('step_ms', 0):.2f} ms/step", flush=True)
    return rows


def _top(events, attr: str, top: int, steps: int) -> list[dict]:
    ranked = sorted(events, key=lambda e: getattr(e, attr, 0), reverse=True)[:top]
    return [{"op": e.key, "us_per_step": getattr(e, attr, 0) / steps, "calls_per_step": e.count / steps}
            for e in ranked]


def markdown(tune: list[dict], profiles: list[dict]) -> str:
    """The sweep's best settings against the default, and each profile's top operators."""
    out = []
    if tune:
        out += ["## Launch settings of the attention kernel (best of the sweep vs default)", "",
                "| preset | dtype | batch | default us | best us | x default | warps | stages | tile | programs/SM |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for b in best_rows(tune):
            cfg = b["best"]
            default = "-" if b["default_us"] is None else f"{b['default_us']:.1f}"
            x = "-" if b["x_default"] is None else f"{b['x_default']:.2f}"
            out.append(f"| {b['preset']} | {b['dtype']} | {b['batch']} | {default} | {b['best_us']:.1f} | {x} | "
                       f"{cfg['num_warps'] or '-'} | {cfg['num_stages'] or '-'} | {cfg['tile'] or '-'} | "
                       f"{cfg['programs_per_sm'] or '-'} |")
        failed = sorted({(r["preset"], r["dtype"], r["num_warps"], r["num_stages"], r["tile"], r["status"])
                         for r in tune if r.get("status", "").startswith("failed")}, key=str)
        out += ["", f"Settings that failed: {len(failed)}"] + [f"- {f}" for f in failed[:20]] + [""]
    for p in profiles:
        out += [f"## Profile: {p['scheme']} (batch {p['batch']}, context {p['context']}, "
                f"attention {p.get('attn_implementation')}): {p.get('status') or format(p['step_ms'], '.2f') + ' ms/step'}",
                ""]
        for title, key in (("self CPU", "cpu_top"), ("self device", "device_top")):
            if key in p:
                out += [f"| op ({title}) | us/step | calls/step |", "|---|---:|---:|"]
                out += [f"| {e['op'][:70]} | {e['us_per_step']:.0f} | {e['calls_per_step']:.1f} |" for e in p[key]]
                out.append("")
    return "\n".join(out) + "\n"
