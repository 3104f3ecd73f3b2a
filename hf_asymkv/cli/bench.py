"""`hf-asymkv bench` (speed, bytes and peak RSS per scheme) and `hf-asymkv memory` (KV bytes per scheme)."""

from __future__ import annotations

import sys

from .args import add_model_args, command_line, int_list, load_model_from_args, set_threads, torch_dtype

__all__ = ["add_parsers"]


def _cmd_memory(args) -> int:
    from ..bench.kv_memory import format_memory_table, measure_kv_memory, save_rows

    if args.decode_tokens < 0:
        raise ValueError(f"--decode-tokens must be >= 0, got {args.decode_tokens}")
    model, _ = load_model_from_args(args)
    rows = measure_kv_memory(model, args.schemes.split(","), args.lengths, decode_tokens=args.decode_tokens,
                             dtype=torch_dtype(args.kv_dtype))
    print(format_memory_table(rows))
    if args.out:
        save_rows(rows, args.out, {"model": args.model, "kv_dtype": args.kv_dtype, "command": command_line(args)})
    return 0


def _cmd_bench(args) -> int:
    import json
    from dataclasses import asdict
    from pathlib import Path

    import torch

    from ..core.fileio import atomic_write_text
    from ..bench.schemes import check_scheme
    from ..bench.speed import format_speed_table, measure_decode_speed, plot_speed

    if args.new_tokens < 1 or args.repeats < 1:
        raise ValueError(f"--new-tokens and --repeats must be >= 1, got {args.new_tokens} and {args.repeats}")
    schemes = args.schemes.split(",")
    for name in schemes:  # a typo fails before the (slow) model load
        check_scheme(name)
    set_threads(args.threads)
    model, _ = load_model_from_args(args)
    rows = measure_decode_speed(model, schemes, args.lengths, new_tokens=args.new_tokens,
                                repeats=args.repeats, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    table = format_speed_table(rows)
    print(table)
    if args.out:
        meta = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
                "torch": torch.__version__, "command": command_line(args)}
        out = Path(args.out)
        atomic_write_text(out / "decode_speed.json", json.dumps(
            {"meta": meta, "rows": [{**asdict(r), "spike_ratio": r.spike_ratio} for r in rows]}, indent=2))
        atomic_write_text(out / "decode_speed.md", f"`{meta['command']}` (torch threads: {meta['threads']})\n\n{table}\n")
        plot_speed(rows, out / "decode_speed.png", f"{args.model}, {args.dtype}, torch threads: {meta['threads']}")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("bench", help="prefill s, decode ms/token, KV bytes and peak RSS per cache scheme vs "
                                     "DynamicCache (interleaved repeats; JSON, markdown and PNG with --out)")
    add_model_args(p)
    p.add_argument("--lengths", type=int_list, default=[1024, 4096],
                   help="context lengths, e.g. 1024,4096,8192,16384 (default 1024,4096)")
    p.add_argument("--schemes", default="dynamic,asymkv,asymkv-fused,hf-quanto-int4,hf-fp8",
                   help="comma-separated scheme names (asymkv-fused switches the model to attn_implementation="
                        "'asymkv_sdpa' while it runs)")
    p.add_argument("--new-tokens", type=int, default=32, help="timed decode steps per repeat (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", default=None, help="folder for decode_speed.json, decode_speed.md and decode_speed.png")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("memory", help="real KV bytes after a prefill, per cache scheme, vs DynamicCache")
    add_model_args(p)
    p.add_argument("--kv-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="dtype the caches store (default bfloat16)")
    p.add_argument("--lengths", type=int_list, default=[4096], help="prefill lengths, e.g. 1024,4096")
    p.add_argument("--schemes", default="dynamic,asymkv,hf-quanto-int4,hf-fp8", help="comma-separated scheme names")
    p.add_argument("--decode-tokens", type=int, default=0, help="greedy steps after the prefill (default 0)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.set_defaults(func=_cmd_memory)
