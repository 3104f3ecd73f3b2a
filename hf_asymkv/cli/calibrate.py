"""`hf-asymkv calibrate`: record K/V ranges on long samples into a kv_scales.safetensors file."""

from __future__ import annotations

import argparse
import sys

from .args import add_model_args, at_least, input_arg, load_model_from_args, missing_path, output_file

__all__ = ["add_parser"]


def _cmd_calibrate(args) -> int:
    import time

    from ..calibration.calibrate import calibrate_model, percentile_top_k
    from ..calibration.data import stream_texts
    from ..evals.common import Heartbeat

    # A missing file or column fails before the model loads (the first text is read now); the rest is streamed
    # only as far as the samples need. Numeric ranges and the output path were checked while parsing.
    texts = stream_texts(args.data, split=args.split, text_column=args.text_column)
    model, tokenizer = load_model_from_args(args)
    samples, plan = _samples(args, texts, model, tokenizer)
    top_k = 0
    if args.statistic == "percentile":  # rows above the percentile, per channel, plus the percentile row
        top_k = percentile_top_k(args.percentile, plan.sample_tokens)
    start = time.perf_counter()
    stats = calibrate_model(model, samples, chunk_size=args.chunk_size, top_k=top_k, progress=not args.quiet,
                            tick=Heartbeat("calibrate"))
    _write(args, stats, model.config, plan, time.perf_counter() - start)
    if args.sensitivity_tokens:
        _write_sensitivity(args, model, samples[0][:, :args.sensitivity_tokens])
    return 0


def _write_sensitivity(args, model, ids) -> None:
    """Per-layer sensitivity (:func:`~hf_asymkv.calibration.sensitivity.layer_sensitivity`) of the first sample's
    first ``--sensitivity-tokens`` tokens, as ``<scales stem>.sensitivity.json`` beside the scales file (the
    scales format is unchanged; the JSON carries its own ``version``)."""
    import json
    from pathlib import Path

    from ..calibration.sensitivity import layer_sensitivity
    from ..core.fileio import atomic_write_text
    from ..evals.common import Heartbeat

    sensitivity = layer_sensitivity(model, ids, queries=min(16, ids.shape[1] // 2), tick=Heartbeat("sensitivity"))
    out = Path(args.out).expanduser()
    path = out.with_name(out.stem + ".sensitivity.json")
    atomic_write_text(path, json.dumps({"model_id": args.model, "data": args.data, **sensitivity}, indent=1))
    print(f"wrote {path} (attention KL per layer for {len(sensitivity['keys'])} key and "
          f"{len(sensitivity['values'])} value widths, {ids.shape[1]} tokens)")


def _samples(args, texts, model, tokenizer):
    """The samples and their :class:`~hf_asymkv.calibration.data.SamplePlan`: warnings (text read more than once,
    defaults cut to a short text, a --seq-len beyond the model's positions) go to stderr before the long pass."""
    from ..calibration.data import DEFAULT_NUM_SAMPLES, DEFAULT_SEQ_LEN, cut_samples, plan_samples, read_tokens

    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit and args.seq_len is not None and args.seq_len > limit:
        print(f"warning: --seq-len {args.seq_len} exceeds the model's max_position_embeddings {limit}",
              file=sys.stderr)
    budget = (args.seq_len or min(DEFAULT_SEQ_LEN, limit or DEFAULT_SEQ_LEN)) * (args.num_samples or DEFAULT_NUM_SAMPLES)
    stream = read_tokens(texts, tokenizer, budget)
    plan = plan_samples(len(stream), args.seq_len, args.num_samples, limit)
    for note in plan.notes:
        print(f"warning: {note}", file=sys.stderr, flush=True)
    return cut_samples(stream, plan.seq_len, plan.num_samples), plan


def _write(args, stats, config, plan, seconds: float) -> None:
    """The scales file (text facts in its metadata), the JSON bucket report beside it, and the summary."""
    import json

    from ..calibration.calibrate import bucket_report, format_report, scales_from_stats
    from ..core.fileio import atomic_write_text

    meta = {"model_id": args.model, "data": args.data, "num_samples": plan.num_samples,
            "sample_lengths": json.dumps([plan.seq_len] * plan.num_samples), "chunk_size": args.chunk_size,
            "dtype": args.dtype, "text_tokens": plan.text_tokens, "distinct_tokens": plan.distinct_tokens,
            "text_reads": round(plan.reads, 2)}
    scales = scales_from_stats(stats, config, statistic=args.statistic, percentile=args.percentile, metadata=meta)
    out = scales.save(args.out)
    report = bucket_report(stats)
    report_path = out.with_name(out.stem + ".report.json")
    atomic_write_text(report_path, json.dumps({"meta": meta, **report}, indent=2))
    print(format_report(report))
    k_max = max(float(k.max()) for k in scales.k_channel_absmax.values())
    reuse = f", read {plan.reads:.1f} times" if plan.reads > 1 else ""
    print(f"\nwrote {out} ({len(scales.k_channel_absmax)} layers, {plan.num_samples} x {plan.seq_len} tokens from "
          f"{plan.distinct_tokens:,} distinct text tokens{reuse}, {args.statistic}, {seconds:.0f} s; largest K range "
          f"{k_max:.2f}) and {report_path}")


def _percentile(text: str) -> float:
    """argparse ``type=``: a number in (0, 100); wrong whatever --statistic says."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 100), got {text!r}") from None
    if not 0 < value < 100:
        raise argparse.ArgumentTypeError(f"must be in (0, 100), got {value}")
    return value


def _data_source(text: str) -> str | None:
    """Why ``--data`` cannot be read: a local path that does not exist (a `datasets` name is looked up when the
    samples are read)."""
    from pathlib import Path

    from ..calibration.data import looks_like_path

    if not Path(text).expanduser().exists() and looks_like_path(text):
        return missing_path(text)
    return None


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="record K/V ranges on long samples into a kv_scales.safetensors file")
    add_model_args(p)
    input_arg(p, "--data", required=True, check=_data_source,
                   help="local .txt/.md (read as is), .jsonl/.json/.parquet (through `datasets`, streamed) file or "
                        "folder of them, or a `datasets` name")
    p.add_argument("--split", default="train", help="dataset split (datasets names only; default train)")
    p.add_argument("--text-field", "--text-column", dest="text_column", default="text", metavar="FIELD",
                   help="text field of .jsonl/.json/.parquet rows and datasets")
    p.add_argument("--seq-len", type=at_least(1), default=None,
                   help="sample length in tokens: use your production context length (default: 8192, cut to the "
                        "model's max_position_embeddings and to a shorter text)")
    p.add_argument("--num-samples", type=at_least(1), default=None,
                   help="number of packed samples (default: 4, fewer when the text holds fewer; a count that reads "
                        "the text more than once is warned about)")
    p.add_argument("--chunk-size", type=at_least(1), default=2048, help="chunked-prefill size in tokens")
    p.add_argument("--statistic", default="absmax", choices=["absmax", "percentile"],
                   help="K range statistic: absmax or percentile")
    p.add_argument("--percentile", type=_percentile, default=99.99,
                   help="for --statistic percentile, in (0, 100)")
    p.add_argument("--out", type=output_file, default="kv_scales.safetensors",
                   help="output file (default kv_scales.safetensors)")
    p.add_argument("--sensitivity-tokens", type=at_least(2, zero_ok=True), default=0,
                   help="also measure each layer's sensitivity on this many tokens of the first sample (the attention "
                   "KL its keys and values cost at each width, written as <out stem>.sensitivity.json for per-layer "
                   "allocation; about 14 extra passes per layer, e.g. 2048; default 0: not measured)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (a line about once a minute still says "
                   "where the run is)")
    p.set_defaults(func=_cmd_calibrate)
