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


def _checkpoint_folder(model: str):
    """A local safetensors folder for ``--model``: the default model's cached folder, a folder, or a Hub snapshot."""
    from pathlib import Path

    from ..models import DEFAULT_MODEL, default_model_path

    if model == DEFAULT_MODEL:
        return default_model_path()
    if model.lower().endswith(".gguf"):
        raise ValueError(f"--model {model!r}: a GGUF file cannot carry the scales; give a safetensors checkpoint folder "
                         f"(for the default model: --model {DEFAULT_MODEL})")
    folder = Path(model).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists() or model.startswith((".", "/", "~")):
        raise ValueError(f"--model {model!r} is not a checkpoint folder")
    from huggingface_hub import snapshot_download

    try:  # a Hub id: only what a serving checkpoint needs (no .bin / .pt duplicates)
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja",
                                                             "tokenizer*"]))
    except Exception as exc:  # offline, no such repo, gated
        raise ValueError(f"--model {model!r}: not a local folder and not downloadable from the Hub: {exc}") from None


def _cmd_export_vllm(args) -> int:
    from pathlib import Path

    from ..core.scales import KVScales
    from ..hub.vllm import export_vllm, read_vllm_scales
    from ..models import load_config

    if args.from_checkpoint is not None:  # vLLM / llm-compressor checkpoint -> our scales file
        if args.strategy is not None or args.tp_size != 1:
            raise ValueError("--strategy and --tp-size shape an export; --from-checkpoint reads the scales as they are")
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
        print(f"wrote {out} ({len(scales.k_channel_absmax)} layers; {scales.metadata['statistic']} ranges imported "
              f"from {ckpt})")
        return 0
    scales_path = Path(args.scales).expanduser()
    if not scales_path.is_file():
        raise ValueError(f"--scales: file {args.scales!r} does not exist")
    if args.model is not None:  # a complete serving checkpoint
        from ..hub.serving import export_serving_checkpoint

        out = export_serving_checkpoint(_checkpoint_folder(args.model), scales_path, args.out,
                                        strategy=args.strategy or "tensor", tp_size=args.tp_size,
                                        overwrite=args.overwrite)
        print(f"wrote {out}: the checkpoint with {args.strategy or 'tensor'} FP8 KV scales; serve with:\n"
              f"  vllm serve {out} --kv-cache-dtype fp8\n"
              f"  python -m sglang.launch_server --model-path {out} --kv-cache-dtype fp8_e4m3")
        return 0
    if args.strategy not in (None, "tensor") or args.tp_size != 1:
        raise ValueError("--strategy attn_head and --tp-size need --model (they shape a complete checkpoint; the "
                         "scales-only export is per-tensor)")
    scales = KVScales.load(scales_path)
    out = export_vllm(scales, args.out, overwrite=args.overwrite)
    print(f"wrote {out} (kv_scales.safetensors with {2 * len(scales.k_channel_absmax)} per-tensor scales, "
          "kv_cache_scheme.json, README.md); for a checkpoint vLLM loads as is, pass --model CHECKPOINT")
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

    p = sub.add_parser("export-vllm", help="write a checkpoint with FP8 KV scales for vLLM/SGLang, or import them back",
                       description="--scales F --model CKPT --out DIR: write DIR/, a complete checkpoint (CKPT's weights "
                                   "linked unchanged, k_scale/v_scale tensors in their own shard, config.json with a "
                                   "compressed-tensors kv_cache_scheme, SGLang's kv_cache_scales.json, a README). "
                                   "Then: vllm serve DIR --kv-cache-dtype fp8. "
                                   "--scales F --out DIR without --model: only the per-tensor scale tensors and the "
                                   "config snippet. --from-checkpoint CKPT --out F.safetensors: read the KV scales of "
                                   "a vLLM / llm-compressor checkpoint into an hf-asymkv scales file.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--scales", default=None, help="our kv_scales.safetensors file to export")
    src.add_argument("--from-checkpoint", default=None, metavar="CKPT",
                     help="checkpoint folder (or .safetensors file) holding k_scale/v_scale (per tensor or per head) "
                          "to import")
    p.add_argument("--model", default=None,
                   help="with --scales: the checkpoint to add the scales to (safetensors folder, Hub id, or "
                        f"{DEFAULT_MODEL}); with --from-checkpoint: its config, needed unless CKPT has a config.json")
    p.add_argument("--out", required=True, help="export folder, or with --from-checkpoint the scales file to write")
    p.add_argument("--strategy", default=None, choices=["tensor", "attn_head"],
                   help="with --model: one FP8 scale per layer (tensor, default) or per KV head (attn_head)")
    p.add_argument("--tp-size", type=int, default=1,
                   help="with --model: tensor-parallel ranks listed in SGLang's kv_cache_scales.json (default 1)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export folder / existing file")
    p.set_defaults(func=_cmd_export_vllm)
