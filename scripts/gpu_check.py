"""GPU check of the Triton decode attention over the stored codes (issue 19), on one GPU, nothing downloaded.

A random-weight LlamaForCausalLM with Llama-3-8B's shapes (32 query heads, 8 KV heads, head_dim 128, hidden
4096, MLP 14336, vocab 128256) and 4 of its layers, in bf16. It checks the kernel against the torch fused
attention (SQNR), times the attention alone against SDPA over bf16 K/V, then times whole-model decode at batch 1
(8k, 32k, 128k) and batch 8 at 32k for DynamicCache + SDPA, transformers' QuantizedCache (where quanto or HQQ
imports), our dense read-out, our Triton path (balanced, compact, max), and the static caches with the decode
step under ``torch.compile`` (ours, ``AsymKVCache(max_cache_len=...)``, beside transformers' StaticCache), each
beside its physical ceiling (weights + KV bytes over the bandwidth), with peak memory, prefill time and the longest
context each fits in a memory budget. Writes results/gpu/gpu_check.{md,json}, rewritten after every part and every
decode row (a run cut short leaves the rows it measured, marked partial). Eager schemes run first at every setting,
the compiled ones (one compile per row) after them; ``--time-budget`` skips the rows not started in time.

On the GPU machine (torch, triton and transformers installed):

    pip install --no-deps -e .
    python scripts/gpu_check.py 2>&1 | tee results/gpu/raw_output.txt

``--parts static`` (issue 38) times the compiled static path as ``generate`` runs it (decode steps compiled with
CUDA graphs, ``--compile-mode reduce-overhead``, prefill eager in chunks) beside transformers' compiled StaticCache
and the eager paths, at ``--static-contexts`` x ``--static-batches``, with launches per step and each scheme's
ratio to its baseline (results/gpu/gpu_check.md, section "Compiled static path"):

    python scripts/gpu_check.py --parts static 2>&1 | tee results/gpu/raw_output_static.txt

``--dry-run`` runs every part on CPU with tiny shapes and the kernels under Triton's interpreter (CI runs it, so
that this script cannot rot); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

CONTEXTS = [8192, 32768, 131072]  # batch-1 decode contexts (tokens of random prompt before decoding)
LONG_BATCH = [8, 32768]  # batch and context where the KV cache dominates the bytes a step reads
STEPS = 32  # timed decode steps per run
WARMUP = 4  # untimed decode steps first (Triton compiles each kernel variant on first use)
LAYERS = 4  # of Llama-3-8B's 32: bytes per layer are the real ones, the run stays short
PRESETS = ["balanced", "compact", "max"]  # served by the Triton schemes and timed alone against SDPA
ATTENTION_CONTEXT = 32768  # context of the attention-alone timing
ATTENTION_BATCHES = [1, 8]
ITERS = 50  # attention calls per timing
BANDWIDTH_TBPS = 4.8  # H200 HBM3e; every time is printed beside bytes / this bandwidth
BUDGET_GIB = 60.0  # KV memory for the longest-context table: an 80 GB card minus Llama-3-8B's 16 GB of weights
FULL_LAYERS = 32  # layers of the model the budget is for (Llama-3-8B)
OUT = Path(__file__).resolve().parents[1] / "results" / "gpu"
# --dry-run: tiny shapes, contexts that still quantize a block of every preset (128-token blocks after 4 sinks and a
# 64-token window), one step
DRY = dict(contexts=[200], long_batch=[2, 200], steps=1, warmup=1, layers=2, attention_context=256,
           attention_batches=[2], iters=1, static_contexts=[200], static_batches=[1, 2], prefill_chunk=64)
PARTS = ("update", "check", "attention", "decode", "tune", "profile", "static")
DEFAULT_PARTS = ("update", "check", "attention", "decode")
CHECK_CONTEXT = 4096  # context of the kernel-vs-torch agreement check (at most the attention context)
STATIC_CONTEXTS = [8192, 32768, 131072]  # --parts static: every context at every batch
STATIC_BATCHES = [1, 8]
PREFILL_CHUNK = 8192  # --parts static prefills in forwards of this many tokens (batch 8 x 128k at once needs ~100 GB)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter: checks the script runs")
    p.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS, help="batch-1 decode contexts")
    p.add_argument("--long-batch", type=int, nargs=2, default=LONG_BATCH, metavar=("BATCH", "CONTEXT"))
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--schemes", nargs="+", default=None, help="subset of the schemes (default: all)")
    p.add_argument("--attention-context", type=int, default=ATTENTION_CONTEXT)
    p.add_argument("--attention-batches", type=int, nargs="+", default=ATTENTION_BATCHES)
    p.add_argument("--iters", type=int, default=ITERS)
    p.add_argument("--bandwidth-tbps", type=float, default=BANDWIDTH_TBPS, help="the card's memory bandwidth, TB/s")
    p.add_argument("--budget-gib", type=float, default=BUDGET_GIB)
    p.add_argument("--full-layers", type=int, default=FULL_LAYERS)
    p.add_argument("--compiled-contexts", type=int, nargs="+", default=None,
                   help="batch-1 contexts for the compiled schemes (default: --contexts; each is a new compile)")
    p.add_argument("--compile-mode", default="reduce-overhead",
                   choices=["reduce-overhead", "default", "max-autotune-no-cudagraphs"],
                   help="torch.compile mode of the compiled schemes on a GPU (default: reduce-overhead, CUDA graphs, "
                        "what generate uses when it compiles a static cache)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start no decode row after this many seconds (those rows say so); the report is still written")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                   help=f"comma-separated parts to run, of {','.join(PARTS)} (default: {','.join(DEFAULT_PARTS)})")
    p.add_argument("--tune-batches", type=int, nargs="+", default=[1, 8], help="batches of the launch-setting sweep")
    p.add_argument("--profile-schemes", nargs="+", default=["dynamic", "dynamic-flash", "balanced-dense", "balanced-triton"],
                   help="schemes whose decode steps are profiled (batch 1, the middle of --contexts)")
    p.add_argument("--static-contexts", type=int, nargs="+", default=STATIC_CONTEXTS, help="contexts of --parts static")
    p.add_argument("--static-batches", type=int, nargs="+", default=STATIC_BATCHES, help="batches of --parts static")
    p.add_argument("--static-schemes", nargs="+", default=None,
                   help="schemes of --parts static (default: hf_asymkv.bench.static_report.STATIC_SCHEMES)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, help="prompt tokens per prefill forward "
                   "in --parts static")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if args.dry_run:
        for name, value in DRY.items():
            if getattr(args, name) == globals()[name.upper()]:
                setattr(args, name, value)
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    _check(p, args)
    return args


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    least = [("--contexts", args.contexts, 1), ("--long-batch", args.long_batch, 1), ("--steps", args.steps, 1),
             ("--warmup", args.warmup, 0), ("--layers", args.layers, 1), ("--iters", args.iters, 1),
             ("--attention-context", args.attention_context, 1), ("--attention-batches", args.attention_batches, 1),
             ("--full-layers", args.full_layers, 1), ("--compiled-contexts", args.compiled_contexts or [1], 1),
             ("--tune-batches", args.tune_batches, 1), ("--static-contexts", args.static_contexts, 1),
             ("--static-batches", args.static_batches, 1), ("--prefill-chunk", args.prefill_chunk, 1)]
    for flag, value, minimum in least:
        if min(value if isinstance(value, list) else [value]) < minimum:
            p.error(f"{flag} must be >= {minimum}, got {value}")
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        p.error(f"--parts: unknown or no parts {unknown}; known: {','.join(PARTS)}")
    positive = [("--bandwidth-tbps", args.bandwidth_tbps), ("--budget-gib", args.budget_gib)]
    if args.time_budget is not None:
        positive.append(("--time-budget", args.time_budget))
    for flag, value in positive:
        if not value > 0:
            p.error(f"{flag} must be > 0, got {value}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.dry_run:  # before anything imports Triton (transformers does)
        os.environ["TRITON_INTERPRET"] = "1"
        from hf_asymkv.kernels.interpreter import prepare_interpreter

        prepare_interpreter()
    import torch

    from hf_asymkv.bench.gpu_runs import GPU_SCHEMES
    from hf_asymkv.bench.static_report import STATIC_SCHEMES

    schemes = args.schemes or list(GPU_SCHEMES)
    args.static_schemes = args.static_schemes or STATIC_SCHEMES
    for flag, names in (("schemes", schemes), ("--profile-schemes", args.profile_schemes),
                        ("--static-schemes", args.static_schemes)):
        unknown = sorted(set(names) - set(GPU_SCHEMES))
        if unknown:
            sys.exit(f"gpu_check.py: error: unknown {flag} {unknown}; known: {list(GPU_SCHEMES)}")
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_check.py: error: no CUDA device here; use --dry-run to check the script on CPU")
    return run(args, schemes)


def run(args: argparse.Namespace, schemes: list[str]) -> dict:
    import torch

    from hf_asymkv.bench import gpu_attention, gpu_runs, op_count
    from hf_asymkv.core.presets import PRESETS as PRESETS_ALL

    started = time.monotonic()
    device = torch.device("cpu" if args.dry_run else "cuda")
    shapes = dataclasses.replace(gpu_runs.DRY_SHAPES if args.dry_run else gpu_runs.LLAMA3_8B, layers=args.layers)
    model = gpu_runs.build_model(shapes, torch.float32 if args.dry_run else torch.bfloat16, device)
    meta = _meta(args, shapes, model, device)
    print(f"model: {shapes}, weights read per step {meta['weight_bytes'] / 2**30:.2f} GiB", flush=True)
    run_part = set(args.parts).__contains__
    deadline = None if args.time_budget is None else started + args.time_budget
    parts = {"update_cost": [], "kernel_check": [], "attention": [], "decode": [], "tune": [], "profile": [],
             "static": []}
    if run_part("update"):
        parts["update_cost"] = op_count.flush_cost_rows(model, list(PRESETS_ALL))
    if run_part("check"):
        parts["kernel_check"] = gpu_attention.kernel_check_rows(model, PRESETS, 2,
                                                                min(CHECK_CONTEXT, args.attention_context))
        _write(args, meta, parts, final=False)
    for batch in args.attention_batches if run_part("attention") else []:
        parts["attention"] += gpu_attention.attention_rows(model, PRESETS, batch, args.attention_context, args.iters)
        _write(args, meta, parts, final=False)
    if run_part("tune"):
        from hf_asymkv.bench import gpu_tune

        parts["tune"] = gpu_tune.launch_rows(model, PRESETS, args.tune_batches, args.attention_context, args.iters,
                                             [model.dtype], deadline)
        if model.dtype != torch.float32:  # float32 needs twice the shared memory: which settings fit
            parts["tune"] += gpu_tune.launch_rows(model, PRESETS[:1], args.tune_batches[:1], args.attention_context,
                                                  args.iters, [torch.float32], deadline)
        _write(args, meta, parts, final=False)
    if run_part("profile"):
        from hf_asymkv.bench import gpu_tune

        context = sorted(args.contexts)[len(args.contexts) // 2]
        parts["profile"] = gpu_tune.profile_rows(model, args.profile_schemes, 1, context)
        _write(args, meta, parts, final=False)
    for name, batch, context in decode_plan(args, schemes) if run_part("decode") else []:
        if deadline is not None and time.monotonic() > deadline:
            row = gpu_runs.DecodeRow(name, batch, context, status=f"skipped: --time-budget {args.time_budget:g} s spent")
        else:
            row = gpu_runs.decode_row(model, name, batch, context, args.steps, args.warmup,
                                      compile_mode=args.compile_mode)
        print(f"decode {name} batch {batch} context {context}: {row.status} {row.decode_ms:.2f} ms/step", flush=True)
        parts["decode"].append(row.as_dict())
        _write(args, meta, parts, final=False)
    for name, batch, context in static_plan(args) if run_part("static") else []:
        if deadline is not None and time.monotonic() > deadline:
            row = gpu_runs.DecodeRow(name, batch, context, status=f"skipped: --time-budget {args.time_budget:g} s spent")
        else:
            row = gpu_runs.decode_row(model, name, batch, context, args.steps, args.warmup,
                                      compile_mode=args.compile_mode, prefill_chunk=args.prefill_chunk,
                                      count_launches=True)
        print(f"static {name} batch {batch} context {context}: {row.status} {row.decode_ms:.2f} ms/step, "
              f"{row.launches_per_step} launches/step", flush=True)
        parts["static"].append(row.as_dict())
        _write(args, meta, parts, final=False)
    return _write(args, meta, parts, final=True)


def static_plan(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """``(scheme, batch, context)`` of ``--parts static`` in the order they run: per batch and context (shortest
    first), the eager schemes, then the compiled ones, so that each ratio's baseline is measured beside it."""
    from hf_asymkv.bench.gpu_runs import GPU_SCHEMES

    names = sorted(args.static_schemes, key=lambda n: GPU_SCHEMES[n].compiled)  # stable: eager ones first
    return [(n, b, c) for c in sorted(args.static_contexts) for b in args.static_batches for n in names]


def decode_plan(args: argparse.Namespace, schemes: list[str]) -> list[tuple[str, int, int]]:
    """``(scheme, batch, context)`` in the order they run: every eager scheme at every setting first, then the
    compiled ones (a compile each) at ``--compiled-contexts`` and the long batch, so that a time budget that runs
    out costs the compiles, not the eager figures."""
    from hf_asymkv.bench.gpu_runs import GPU_SCHEMES

    batch1 = [(1, c) for c in args.contexts]
    compiled_batch1 = batch1 if args.compiled_contexts is None else [(1, c) for c in args.compiled_contexts]
    long_batch = tuple(args.long_batch)
    plan = [(n, b, c) for b, c in batch1 + [long_batch] for n in schemes if not GPU_SCHEMES[n].compiled]
    return plan + [(n, b, c) for b, c in compiled_batch1 + [long_batch] for n in schemes if GPU_SCHEMES[n].compiled]


def _write(args: argparse.Namespace, meta: dict, parts: dict, final: bool) -> dict:
    """Derive the tables from the rows measured so far and write the report (atomically: a run cut short leaves the
    last complete report, marked partial); print it when ``final``."""
    from hf_asymkv.bench import gpu_report

    bandwidth = args.bandwidth_tbps * 1e12
    decode = gpu_report.with_ceilings(parts["decode"], meta["weight_bytes"], bandwidth)
    attention = gpu_report.attention_table(parts["attention"], bandwidth)
    fit = gpu_report.fit_rows(decode, meta["model"]["layers"], args.full_layers, args.budget_gib * 2**30)
    goals = gpu_report.goal_rows(decode, attention, max(args.contexts), tuple(args.long_batch))
    meta = {**meta, "complete": final}
    report = {"meta": meta, "update_cost": parts["update_cost"], "kernel_check": parts["kernel_check"],
              "attention": attention, "decode": decode, "fit": fit, "goals": goals, "tune": parts["tune"],
              "profile": parts["profile"]}
    markdown = gpu_report.markdown_report(meta, parts["update_cost"], parts["kernel_check"], attention, decode, fit,
                                          goals)
    if parts["tune"] or parts["profile"]:
        from hf_asymkv.bench.gpu_tune import markdown as tune_markdown

        markdown += "\n" + tune_markdown(parts["tune"], parts["profile"])
    if parts["static"]:
        from hf_asymkv.bench.gpu_runs import GPU_SCHEMES
        from hf_asymkv.bench.static_report import static_markdown, static_rows

        report["static"] = static_rows(parts["static"], {n for n, s in GPU_SCHEMES.items() if s.compiled})
        markdown += "\n" + static_markdown(report["static"])
    paths = gpu_report.write_report(args.out, report, markdown)
    if final:
        print(markdown)
        for path in paths:
            print(f"wrote {path}")
    return report


def _meta(args: argparse.Namespace, shapes, model, device) -> dict:
    import torch
    import transformers

    from hf_asymkv.bench.gpu_runs import weight_bytes
    from hf_asymkv.kernels.backend import triton_version

    return {"dry_run": args.dry_run, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "bandwidth_tbps": args.bandwidth_tbps, "torch": torch.__version__, "triton": triton_version(),
            "transformers": transformers.__version__, "model": dataclasses.asdict(shapes), "dtype": str(model.dtype),
            "weight_bytes": weight_bytes(model), "steps": args.steps, "warmup": args.warmup,
            "budget_gib": args.budget_gib, "full_layers": args.full_layers, "time_budget_s": args.time_budget,
            "compiled_contexts": args.compiled_contexts or args.contexts, "parts": args.parts,
            "compile_mode": args.compile_mode, "static_contexts": args.static_contexts,
            "static_batches": args.static_batches, "prefill_chunk": args.prefill_chunk}


if __name__ == "__main__":
    main()
