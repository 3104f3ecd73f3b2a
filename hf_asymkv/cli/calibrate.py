"""`hf-asymkv calibrate`: record K/V ranges on long samples into a kv_scales.safetensors file."""

from __future__ import annotations

import argparse
import sys

from .args import add_model_args, at_least, file_path, load_model_from_args

__all__ = ["add_parser"]


def _cmd_calibrate(args) -> int:
    import json
    import time

    from ..calibration.calibrate import (
        bucket_report,
        calibrate_model,
        format_report,
        percentile_top_k,
        scales_from_stats,
    )
    from ..calibration.data import pack_samples, stream_texts
    from ..core.fileio import atomic_write_text

    # A missing file or column fails before the model loads (the first text is read now); the rest is streamed
    # only as far as the samples need. Numeric ranges were checked while parsing.
    texts = stream_texts(args.data, split=args.split, text_column=args.text_column)
    model, tokenizer = load_model_from_args(args)
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit and args.seq_len > limit:
        print(f"warning: --seq-len {args.seq_len} exceeds the model's max_position_embeddings {limit}",
              file=sys.stderr)
    samples = pack_samples(texts, tokenizer, args.seq_len, args.num_samples)
    top_k = 0
    if args.statistic == "percentile":  # rows above the percentile, per channel, plus the percentile row
        top_k = percentile_top_k(args.percentile, args.seq_len * len(samples))
    start = time.perf_counter()
    stats = calibrate_model(model, samples, chunk_size=args.chunk_size, top_k=top_k, progress=not args.quiet)
    seconds = time.perf_counter() - start
    meta = {"model_id": args.model, "data": args.data, "num_samples": len(samples),
            "sample_lengths": json.dumps([int(s.shape[-1]) for s in samples]), "chunk_size": args.chunk_size,
            "dtype": args.dtype}
    scales = scales_from_stats(stats, model.config, statistic=args.statistic, percentile=args.percentile,
                               metadata=meta)
    out = scales.save(args.out)
    report = bucket_report(stats)
    report_path = out.with_name(out.stem + ".report.json")
    atomic_write_text(report_path, json.dumps({"meta": meta, **report}, indent=2))
    print(format_report(report))
    k_max = max(float(k.max()) for k in scales.k_channel_absmax.values())
    print(f"\nwrote {out} ({len(scales.k_channel_absmax)} layers, {len(samples)} x {args.seq_len} tokens, "
          f"{args.statistic}, {seconds:.0f} s; largest K range {k_max:.2f}) and {report_path}")
    return 0


def _percentile(text: str) -> float:
    """argparse ``type=``: a number in (0, 100); wrong whatever --statistic says."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 100), got {text!r}") from None
    if not 0 < value < 100:
        raise argparse.ArgumentTypeError(f"must be in (0, 100), got {value}")
    return value


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="record K/V ranges on long samples into a kv_scales.safetensors file")
    add_model_args(p)
    p.add_argument("--data", required=True,
                   help="local .txt/.md (read as is), .jsonl/.json/.parquet (through `datasets`, streamed) file or "
                        "folder of them, or a `datasets` name")
    p.add_argument("--split", default="train", help="dataset split (datasets names only; default train)")
    p.add_argument("--text-field", "--text-column", dest="text_column", default="text",
                   help="text field of .jsonl/.json/.parquet rows and datasets")
    p.add_argument("--seq-len", type=at_least(1), default=8192,
                   help="sample length in tokens: use your production context length")
    p.add_argument("--num-samples", type=at_least(1), default=4, help="number of packed samples")
    p.add_argument("--chunk-size", type=at_least(1), default=2048, help="chunked-prefill size in tokens")
    p.add_argument("--statistic", default="absmax", choices=["absmax", "percentile"],
                   help="K range statistic: absmax or percentile")
    p.add_argument("--percentile", type=_percentile, default=99.99,
                   help="for --statistic percentile, in (0, 100)")
    p.add_argument("--out", type=file_path, default="kv_scales.safetensors",
                   help="output file (default kv_scales.safetensors)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_calibrate)
