"""The `hf-asymkv` command line. Each subcommand parses its arguments and calls into the library."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _dtype(name: str):
    """``"float32"`` / ``"bfloat16"`` / ``"float16"`` (argparse restricts the choices) -> torch dtype."""
    import torch

    return getattr(torch, name)


def _set_threads(threads: int) -> None:
    """``--threads``: 0 keeps torch's choice."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def _command(args) -> str:
    """The equivalent `hf-asymkv` command line (also for the scripts/ wrappers), for results' metadata."""
    return " ".join(["hf-asymkv", *args.argv])


def _load(args):
    from .models import load_model

    return load_model(args.model, dtype=_dtype(args.dtype), device=args.device,
                      device_map=getattr(args, "device_map", None))


def _cmd_demo(args) -> int:
    from .demo import format_demo, run_demo

    if not 0.0 <= args.depth <= 1.0:  # checked here too, so that a typo fails before the model loads
        raise ValueError(f"--depth must be in [0, 1], got {args.depth}")
    if args.context < 64:
        raise ValueError(f"--context must be >= 64 tokens, got {args.context}")
    _set_threads(args.threads)
    model, tokenizer = _load(args)
    rows, info = run_demo(model, tokenizer, context_tokens=args.context, depth=args.depth, seed=args.seed)
    print(format_demo(rows, info))
    return 0


def _cmd_memory(args) -> int:
    from .bench import format_memory_table, measure_kv_memory, save_rows

    if args.decode_tokens < 0:
        raise ValueError(f"--decode-tokens must be >= 0, got {args.decode_tokens}")
    model, _ = _load(args)
    rows = measure_kv_memory(model, args.schemes.split(","), args.lengths, decode_tokens=args.decode_tokens,
                             dtype=_dtype(args.kv_dtype))
    print(format_memory_table(rows))
    if args.out:
        save_rows(rows, args.out, {"model": args.model, "kv_dtype": args.kv_dtype, "command": _command(args)})
    return 0


def _cmd_calibrate(args) -> int:
    import json
    import time

    from .calibrate import bucket_report, calibrate_model, format_report, percentile_top_k, scales_from_stats
    from .data import load_texts, pack_samples
    from .fileio import atomic_write_text

    # Every argument is checked before the (slow) model load; an out-of-range --percentile is wrong whatever
    # --statistic says.
    if not 0 < args.percentile < 100:
        raise ValueError(f"--percentile must be in (0, 100), got {args.percentile}")
    for flag, value in (("--chunk-size", args.chunk_size), ("--seq-len", args.seq_len),
                        ("--num-samples", args.num_samples)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    texts = load_texts(args.data, split=args.split, text_column=args.text_column)  # fail before loading a model
    model, tokenizer = _load(args)
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


def _cmd_publish(args) -> int:
    from pathlib import Path

    from .publish import publish, push_to_hub

    if args.push_to_hub is not None:  # an invalid repo id fails before anything is written
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(args.push_to_hub)
        except HFValidationError as exc:
            raise ValueError(f"--push-to-hub: invalid Hub repo id {args.push_to_hub!r}: {exc}") from None
    if not Path(args.scales).expanduser().is_file():
        raise ValueError(f"--scales: file {args.scales!r} does not exist")
    overrides = {key: getattr(args, key) for key in ("key_format", "value_bits", "key_block_size",
                                                     "residual_length", "sink_tokens", "overflow_policy")
                 if getattr(args, key) is not None}
    out = publish(args.model, args.scales, args.out, eval_results=args.eval_results, settings=overrides,
                  overwrite=args.overwrite, base_model=args.base_model, license=args.license,
                  repo_id=args.push_to_hub)
    print(f"wrote {out} (kv_scales.safetensors, asymkv_config.json, README.md"
          f"{', eval/' if args.eval_results else ''})")
    if args.push_to_hub is not None:
        push_to_hub(out, args.push_to_hub, private=args.private)
        print(f"pushed {out} to https://huggingface.co/{args.push_to_hub}")
    return 0


def _cmd_export_vllm(args) -> int:
    from pathlib import Path

    from .publish import load_config
    from .scales import KVScales
    from .vllm import export_vllm, read_vllm_scales

    if args.from_checkpoint is not None:  # vLLM / llm-compressor checkpoint -> our scales file
        ckpt = Path(args.from_checkpoint).expanduser()
        if not ckpt.exists():
            raise ValueError(f"--from-checkpoint: {args.from_checkpoint!r} does not exist")
        model = args.model
        if model is None:
            if not (ckpt.is_dir() and (ckpt / "config.json").is_file()):
                raise ValueError("--from-checkpoint needs --model (the checkpoint has no config.json)")
            model = str(ckpt)
        out = Path(args.out).expanduser()
        if out.is_dir():
            raise ValueError(f"--out {args.out!r} is a folder; with --from-checkpoint give a .safetensors file")
        if out.exists() and not args.overwrite:
            raise ValueError(f"--out {args.out!r} exists; pass --overwrite to replace it")
        scales = read_vllm_scales(ckpt, load_config(model), model_id=model)
        scales.save(out)
        print(f"wrote {out} ({len(scales.k_channel_absmax)} layers; per-tensor ranges imported from {ckpt})")
        return 0
    scales_path = Path(args.scales).expanduser()
    if not scales_path.is_file():
        raise ValueError(f"--scales: file {args.scales!r} does not exist")
    config = load_config(args.model) if args.model is not None else None
    scales = KVScales.load(scales_path, config)
    out = export_vllm(scales, args.out, overwrite=args.overwrite)
    print(f"wrote {out} (kv_scales.safetensors with {2 * len(scales.k_channel_absmax)} per-tensor scales, "
          "kv_cache_scheme.json, README.md); serve with: vllm serve CHECKPOINT --kv-cache-dtype fp8_e4m3 "
          "after merging them (see README.md)")
    return 0


def _cmd_eval_synthetic(args) -> int:
    import json
    from dataclasses import asdict
    from pathlib import Path

    from .fileio import atomic_write_text
    from .synthetic import format_synthetic, run_synthetic

    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    rows = run_synthetic(args.seeds)
    table = format_synthetic(rows)
    print(table)
    if args.out:
        out = Path(args.out)
        atomic_write_text(out / "synthetic.json", json.dumps({"seeds": args.seeds, "rows": [asdict(r) for r in rows]},
                                                              indent=2))
        atomic_write_text(out / "synthetic.md", table + "\n")
    return 0


def _cmd_bench(args) -> int:
    import json
    from dataclasses import asdict
    from pathlib import Path

    import torch

    from .fileio import atomic_write_text
    from .schemes import check_scheme
    from .speed import format_speed_table, measure_decode_speed, plot_speed

    if args.new_tokens < 1 or args.repeats < 1:
        raise ValueError(f"--new-tokens and --repeats must be >= 1, got {args.new_tokens} and {args.repeats}")
    schemes = args.schemes.split(",")
    for name in schemes:  # a typo fails before the (slow) model load
        check_scheme(name)
    _set_threads(args.threads)
    model, _ = _load(args)
    rows = measure_decode_speed(model, schemes, args.lengths, new_tokens=args.new_tokens,
                                repeats=args.repeats, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    table = format_speed_table(rows)
    print(table)
    if args.out:
        meta = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
                "torch": torch.__version__, "command": _command(args)}
        out = Path(args.out)
        atomic_write_text(out / "decode_speed.json", json.dumps(
            {"meta": meta, "rows": [{**asdict(r), "spike_ratio": r.spike_ratio} for r in rows]}, indent=2))
        atomic_write_text(out / "decode_speed.md", f"`{meta['command']}` (torch threads: {meta['threads']})\n\n{table}\n")
        plot_speed(rows, out / "decode_speed.png", f"{args.model}, {args.dtype}, torch threads: {meta['threads']}")
    return 0


def _add_model_args(p: argparse.ArgumentParser, dtype: str = "float32") -> None:
    from .models import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"HF model id, local folder or .gguf file (default: the embedded {DEFAULT_MODEL})")
    p.add_argument("--dtype", default=dtype, choices=["float32", "bfloat16", "float16"], help="model dtype")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--device-map", default=None, help="accelerate device_map, e.g. auto (overrides --device)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-asymkv", description="Asymmetric KV-cache quantization for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="long-document retrieval, DynamicCache vs AsymKVCache side by side")
    _add_model_args(p)
    p.add_argument("--context", type=int, default=3000, help="document length in tokens (default 3000)")
    p.add_argument("--depth", type=float, default=0.35, help="needle depth in [0, 1] (default 0.35)")
    p.add_argument("--seed", type=int, default=7, help="prompt seed (default 7)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("calibrate", help="record K/V ranges on long samples into a kv_scales.safetensors file")
    _add_model_args(p)
    p.add_argument("--data", required=True,
                   help="local .txt/.jsonl/.parquet file or folder, or a `datasets` name")
    p.add_argument("--split", default="train", help="dataset split (datasets names only; default train)")
    p.add_argument("--text-column", default="text", help="text field of .jsonl/.parquet/datasets (default text)")
    p.add_argument("--seq-len", type=int, default=8192,
                   help="sample length in tokens: use your production context length (default 8192)")
    p.add_argument("--num-samples", type=int, default=4, help="number of packed samples (default 4)")
    p.add_argument("--chunk-size", type=int, default=2048, help="chunked-prefill size (default 2048)")
    p.add_argument("--statistic", default="absmax", choices=["absmax", "percentile"], help="K range statistic")
    p.add_argument("--percentile", type=float, default=99.99, help="for --statistic percentile (default 99.99)")
    p.add_argument("--out", default="kv_scales.safetensors", help="output file (default kv_scales.safetensors)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_calibrate)

    p = sub.add_parser("eval", help="evaluations: synthetic head, needle retrieval, attention damage, perplexity")
    evals = p.add_subparsers(dest="eval_command", required=True)
    e = evals.add_parser("synthetic", help="the reference article's synthetic head, our quantizers, several seeds")
    e.add_argument("--seeds", type=int, default=5, help="number of random heads (default 5)")
    e.add_argument("--out", default=None, help="folder for synthetic.json and synthetic.md")
    e.set_defaults(func=_cmd_eval_synthetic)
    from .evals.cli import add_eval_commands

    add_eval_commands(evals)

    p = sub.add_parser("bench", help="prefill s, decode ms/token, KV bytes and peak RSS per cache scheme vs "
                                     "DynamicCache (interleaved repeats; JSON, markdown and PNG with --out)")
    _add_model_args(p)
    p.add_argument("--lengths", type=_int_list, default=[1024, 4096],
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
    _add_model_args(p)
    p.add_argument("--kv-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="dtype the caches store (default bfloat16)")
    p.add_argument("--lengths", type=_int_list, default=[4096], help="prefill lengths, e.g. 1024,4096")
    p.add_argument("--schemes", default="dynamic,asymkv,hf-quanto-int4,hf-fp8", help="comma-separated scheme names")
    p.add_argument("--decode-tokens", type=int, default=0, help="greedy steps after the prefill (default 0)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.set_defaults(func=_cmd_memory)

    from .models import DEFAULT_MODEL

    p = sub.add_parser("publish", help="write a folder (optionally a Hub repo) with the scales, settings and a "
                                       "model card",
                       description="Write OUT/ with a copy of the scales file (validated against the model's "
                                   "config), asymkv_config.json (recommended AsymKVCache settings) and a README.md "
                                   "model card; load it back with AsymKVCache.from_pretrained(OUT or REPO, "
                                   "config=model.config).")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model the scales belong to: HF model id, local folder or .gguf file; only its config is "
                        f"read (default: the embedded {DEFAULT_MODEL})")
    p.add_argument("--scales", required=True, help="kv_scales.safetensors file from `hf-asymkv calibrate`")
    p.add_argument("--out", required=True, help="folder to create (must not exist or be empty)")
    p.add_argument("--eval-results", default=None,
                   help="folder of .md/.json result files (or one such file), quoted verbatim in the card")
    p.add_argument("--push-to-hub", default=None, metavar="REPO",
                   help="also upload the folder to this Hub model repo (created if missing; needs a login/HF_TOKEN)")
    p.add_argument("--private", action="store_true", help="create the Hub repo private")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it is an earlier publish folder")
    p.add_argument("--base-model", default=None, help="base model Hub id for the card (default: inferred if known)")
    p.add_argument("--license", default=None, help="license id for the card front matter (default: inferred if known)")
    g = p.add_argument_group("recommended cache settings (default: the library's recommendation)")
    g.add_argument("--key-format", default=None, choices=["int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2"],
                   help="key storage format (default int8)")
    g.add_argument("--value-bits", type=int, default=None, choices=[2, 4, 8], help="value bits (default 4)")
    g.add_argument("--key-block-size", type=int, default=None, help="tokens per quantized block (default 128)")
    g.add_argument("--residual-length", type=int, default=None,
                   help="newest tokens kept exact (default 128)")
    g.add_argument("--sink-tokens", type=int, default=None, help="first tokens kept exact (default 0)")
    g.add_argument("--overflow-policy", default=None,
                   help="what a key beyond its calibrated range does (default widen)")
    p.set_defaults(func=_cmd_publish)

    p = sub.add_parser("export-vllm", help="export scales as vLLM per-tensor FP8 KV scales, or import them back",
                       description="--scales F --out DIR: write DIR/ with vLLM's per-tensor k_scale/v_scale tensors, "
                                   "the kv_cache_scheme snippet for config.json and a how-to. "
                                   "--from-checkpoint CKPT --model M --out F.safetensors: read the per-tensor scales "
                                   "of a vLLM / llm-compressor checkpoint into an hf-asymkv scales file.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--scales", default=None, help="our kv_scales.safetensors file to export")
    src.add_argument("--from-checkpoint", default=None, metavar="CKPT",
                     help="checkpoint folder (or .safetensors file) holding per-tensor k_scale/v_scale to import")
    p.add_argument("--model", default=None,
                   help="model config to validate against; needed with --from-checkpoint unless CKPT has a "
                        "config.json (HF id, local folder or .gguf)")
    p.add_argument("--out", required=True, help="export folder, or with --from-checkpoint the scales file to write")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export folder / existing file")
    p.set_defaults(func=_cmd_export_vllm)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .evals.plots import MissingExtraError
    from .models import ModelNotAvailableError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    # Bad input, a missing model package or eval extra, or a --model that is neither a folder nor a reachable Hub id
    # (OSError, FileNotFoundError included): one line on stderr, exit 2.
    except (ValueError, OSError, ModelNotAvailableError, MissingExtraError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
