"""`hf-asymkv publish` (scales + settings + model card, optionally to the Hub) and `hf-asymkv export-vllm`."""

from __future__ import annotations

__all__ = ["add_parsers"]


def _cmd_publish(args) -> int:
    from pathlib import Path

    from ..hub.publish import publish, push_to_hub

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

    from ..models import load_config
    from ..core.scales import KVScales
    from ..hub.vllm import export_vllm, read_vllm_scales

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


def add_parsers(sub) -> None:
    from ..models import DEFAULT_MODEL

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
