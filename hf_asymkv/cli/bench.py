"""`hf-asymkv bench` (speed, bytes and peak RSS per scheme) and `hf-asymkv memory` (KV bytes per scheme)."""

from __future__ import annotations

import sys

from ..bench.schemes import ATTENTION, PEER_SCHEMES, scheme_names
from .args import (
    DTYPES,
    add_model_args,
    add_threads_arg,
    at_least,
    command_line,
    int_list,
    load_model_from_args,
    name_list,
    output_file,
    output_folder,
    set_threads,
    torch_dtype,
)

__all__ = ["add_parsers"]


def _cmd_memory(args) -> int:
    from ..bench.kv_memory import format_memory_table, measure_kv_memory, save_rows

    model, _ = load_model_from_args(args)
    rows = measure_kv_memory(model, args.schemes, args.lengths, decode_tokens=args.decode_tokens,
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

    from ..bench.speed import bandwidth_line, format_speed_table, measure_decode_speed, plot_speed
    from ..core.fileio import atomic_write_text

    schemes = args.schemes
    set_threads(args.threads)
    model, _ = load_model_from_args(args)
    rows = measure_decode_speed(model, schemes, args.lengths, new_tokens=args.new_tokens, repeats=args.repeats,
                                progress=lambda msg: print(msg, file=sys.stderr, flush=True), fill_from=args.fill_from)
    table = f"{format_speed_table(rows)}\n\n{bandwidth_line(rows)}"
    print(table)
    if args.out:
        meta = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
                "torch": torch.__version__, "command": command_line(args)}
        out = Path(args.out)
        atomic_write_text(out / "decode_speed.json", json.dumps(
            {"meta": meta, "rows": [{**asdict(r), "spike_ratio": r.spike_ratio, "x_roofline": r.x_roofline}
                                    for r in rows]}, indent=2))
        atomic_write_text(out / "decode_speed.md", f"`{meta['command']}` (torch threads: {meta['threads']})\n\n{table}\n")
        plot_speed(rows, out / "decode_speed.png", f"{args.model}, {args.dtype}, torch threads: {meta['threads']}")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("bench", help="prefill s, decode ms/token, KV bytes and peak RSS per cache scheme vs "
                                     "DynamicCache (interleaved repeats; JSON, markdown and PNG with --out)")
    add_model_args(p)
    p.add_argument("--lengths", type=int_list, default="1024,4096",
                   help="context lengths, e.g. 1024,4096,8192,16384 (default 1024,4096)")
    p.add_argument("--schemes", type=name_list(scheme_names(static=True), "cache scheme"),
                   default="dynamic,asymkv,asymkv-fused,hf-quanto-int4,hf-fp8",
                   help=f"comma-separated scheme names, from: {', '.join(scheme_names(static=True))} (asymkv-fused "
                        "switches the model to attn_implementation='asymkv_sdpa' while it runs; '-static' schemes "
                        "preallocate for the prompt and the decode steps, '-compiled' ones compile the decode step "
                        "with torch.compile, untimed, in the warm-up)")
    p.add_argument("--new-tokens", type=at_least(1), default=32, help="timed decode steps per repeat")
    p.add_argument("--repeats", type=at_least(1), default=3, help="interleaved repeats")
    p.add_argument("--fill-from", type=at_least(1), default=None, metavar="TOKENS",
                   help="contexts of at least TOKENS tokens are written into each cache as random K/V (one update per "
                        "layer, timed in the prefill column, marked '(fill)') instead of a prompt's prefill: for "
                        "contexts past the model's positions or too long to prefill per scheme (default: none)")
    add_threads_arg(p)
    p.add_argument("--out", type=output_folder, default=None,
                   help="folder for decode_speed.json, decode_speed.md and decode_speed.png")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("memory", help="real KV bytes after a prefill, per cache scheme, vs DynamicCache")
    add_model_args(p)
    p.add_argument("--kv-dtype", default="bfloat16", choices=DTYPES,
                   help=f"dtype the caches store, one of {', '.join(DTYPES)} (default bfloat16)")
    p.add_argument("--lengths", type=int_list, default="4096", help="prefill lengths, e.g. 1024,4096")
    # A scheme that needs its own attention implementation measures nothing different here (same storage); the
    # peers' emulations hold dequantized tensors, so their real bytes are not their engine's (eval frontier counts
    # those with PeerFormat.engine_nbytes).
    memory_schemes = [s for s in scheme_names() if s not in ATTENTION and s not in PEER_SCHEMES]
    p.add_argument("--schemes", type=name_list(memory_schemes, "cache scheme"),
                   default="dynamic,asymkv,hf-quanto-int4,hf-fp8",
                   help=f"comma-separated scheme names, from: {', '.join(memory_schemes)}")
    p.add_argument("--decode-tokens", type=at_least(0), default=0, help="greedy steps after the prefill")
    p.add_argument("--out", type=output_file, default=None, help="JSON file for the rows")
    p.set_defaults(func=_cmd_memory)
