"""`hf-asymkv publish` (scales + settings + model card, optionally to the Hub) and `hf-asymkv export-vllm`.

Every path is checked while the command line is parsed (:mod:`.args`), and the output folder's contents before
anything heavy is imported, so a wrong path is refused within the second. The cache settings offered (choices
and the defaults ``--help`` shows) are the core's own (:mod:`.settings`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .args import at_least, existing_file, input_arg, model_source, output_path
from .settings import core_settings

__all__ = ["add_parsers"]

SETTING_FLAGS = ("key_format", "value_bits", "key_block_size", "residual_length", "sink_tokens", "key_symmetric",
                 "key_wide_fraction", "value_rotation", "overflow_policy")
"""The ``AsymKVConfig`` fields ``publish`` takes as flags (``--key-format`` ...), over ``--preset`` or the defaults."""


def _check_new_folder(out: str, overwrite: bool) -> None:
    """A non-empty ``--out`` folder without ``--overwrite`` is refused before anything heavy is imported (with
    ``--overwrite`` the writer checks that it is a folder this tool wrote)."""
    from ..core.fileio import check_out_dir

    if not overwrite:
        check_out_dir(Path(out).expanduser(), False, marker="")


def _cmd_publish(args) -> int:
    _check_new_folder(args.out, args.overwrite)
    from ..hub.publish import publish, push_to_hub

    overrides = {key: getattr(args, key) for key in SETTING_FLAGS if getattr(args, key) is not None}
    if args.layer_overrides is not None:
        overrides["layer_overrides"] = _read_layer_overrides(args.layer_overrides)
    out = publish(args.model, args.scales, args.out, eval_results=args.eval_results, settings=overrides,
                  preset=args.preset, overwrite=args.overwrite, base_model=args.base_model, license=args.license,
                  repo_id=args.push_to_hub)
    print(f"wrote {out} (kv_scales.safetensors, asymkv_config.json, README.md"
          f"{', eval/' if args.eval_results else ''})")
    if args.push_to_hub is not None:
        push_to_hub(out, args.push_to_hub, private=args.private)
        print(f"pushed {out} to https://huggingface.co/{args.push_to_hub}")
    return 0


def _read_layer_overrides(path: str) -> dict:
    """The per-layer settings in a JSON file: ``{"<layer index>": {setting: value}}``, an object with such a
    ``layer_overrides`` entry (``AsymKVConfig.to_dict()``), or a published ``asymkv_config.json`` (under
    ``settings``). Indices and settings are checked against the model by
    ``publish`` (a ``ValueError`` naming the layer).

    Raises:
        ValueError: a file that is not JSON, or whose content is neither form.
    """
    import json

    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--layer-overrides {path!r} is not a readable JSON file: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("settings"), dict):  # a published asymkv_config.json
        data = data["settings"]
    if isinstance(data, dict) and isinstance(data.get("layer_overrides"), dict):
        data = data["layer_overrides"]
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"--layer-overrides {path!r} must hold a JSON object {{\"<layer index>\": {{setting: value}}}} "
                         "or an object with a 'layer_overrides' entry of that form.")
    return data


def _hub_repo_id(text: str) -> str:
    """argparse ``type=``: ``--push-to-hub``; an invalid repo id fails before anything is written."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError as exc:
        raise argparse.ArgumentTypeError(f"invalid Hub repo id {text!r}: {exc}") from None
    return text


def _checkpoint_folder(model: str) -> Path:
    """A local safetensors folder for ``--model`` (already checked by :func:`.args.model_source`): the default
    model's cached folder, a folder, or a Hub snapshot."""
    from ..models import DEFAULT_MODEL, default_model_path

    if model == DEFAULT_MODEL:
        return default_model_path()
    if model.lower().endswith(".gguf"):
        raise ValueError(f"--model {model!r}: a GGUF file cannot carry the scales; give a safetensors checkpoint folder "
                         f"(for the default model: --model {DEFAULT_MODEL})")
    folder = Path(model).expanduser()
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    try:  # a Hub id: only what a serving checkpoint needs (no .bin / .pt duplicates)
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja",
                                                             "tokenizer*"]))
    except Exception as exc:  # offline, no such repo, gated
        raise ValueError(f"--model {model!r}: not a local folder and not downloadable from the Hub: {exc}") from None


def _check_export_args(args) -> None:
    """What ``export-vllm`` can refuse from its flags and the file system alone, before anything heavy loads."""
    from ..core.fileio import output_problem

    importing = args.from_checkpoint is not None
    problem = output_problem(args.out, "file" if importing else "folder", whole=True)
    if problem:
        raise ValueError(f"--out: {problem}" + ("; with --from-checkpoint give a .safetensors file" if importing
                                                else ""))
    if importing:
        if args.strategy is not None or args.tp_size != 1:
            raise ValueError("--strategy and --tp-size shape an export; --from-checkpoint reads the scales as they are")
        if args.model is None and not (Path(args.from_checkpoint).expanduser() / "config.json").is_file():
            raise ValueError("--from-checkpoint needs --model (the checkpoint has no config.json)")
        if Path(args.out).expanduser().exists() and not args.overwrite:
            raise ValueError(f"--out {args.out!r} exists; pass --overwrite to replace it")
        return
    if args.model is None and (args.strategy not in (None, "tensor") or args.tp_size != 1):
        raise ValueError("--strategy attn_head and --tp-size need --model (they shape a complete checkpoint; the "
                         "scales-only export is per-tensor)")
    _check_new_folder(args.out, args.overwrite)


def _cmd_export_vllm(args) -> int:
    _check_export_args(args)
    if args.from_checkpoint is not None:  # vLLM / llm-compressor checkpoint -> our scales file
        from ..hub.vllm import read_vllm_scales
        from ..models import load_config

        model = args.model or args.from_checkpoint
        scales = read_vllm_scales(args.from_checkpoint, load_config(model), model_id=model)
        out = scales.save(Path(args.out).expanduser())
        print(f"wrote {out} ({len(scales.k_channel_absmax)} layers; {scales.metadata['statistic']} ranges imported "
              f"from {args.from_checkpoint})")
        return 0
    if args.model is not None:  # a complete serving checkpoint
        from ..hub.serving import export_serving_checkpoint

        out = export_serving_checkpoint(_checkpoint_folder(args.model), args.scales, args.out,
                                        strategy=args.strategy or "tensor", tp_size=args.tp_size,
                                        overwrite=args.overwrite)
        print(f"wrote {out}: the checkpoint with {args.strategy or 'tensor'} FP8 KV scales; serve with:\n"
              f"  vllm serve {out} --kv-cache-dtype fp8\n"
              f"  python -m sglang.launch_server --model-path {out} --kv-cache-dtype fp8_e4m3")
        _note_private_links(out)
        return 0
    from ..core.scales import KVScales
    from ..hub.vllm import export_vllm

    scales = KVScales.load(Path(args.scales).expanduser())
    out = export_vllm(scales, args.out, overwrite=args.overwrite)
    print(f"wrote {out} (kv_scales.safetensors with {2 * len(scales.k_channel_absmax)} per-tensor scales, "
          "kv_cache_scheme.json, README.md); for a checkpoint vLLM loads as is, pass --model CHECKPOINT")
    return 0


def _note_private_links(out: Path) -> None:
    """Weights are hard-linked, and a link shares its source's permissions: say so when some are narrower than a
    new file's (a checkpoint written by safetensors is 0600)."""
    import sys

    from ..core.fileio import usual_mode

    narrow = sorted(p.name for p in out.iterdir() if p.is_file() and p.stat().st_mode & 0o777 != usual_mode())
    if narrow:
        print(f"note: {', '.join(narrow[:4])}{' ...' if len(narrow) > 4 else ''} keep the permissions of the "
              f"checkpoint's files (hard links share them: mode {oct(out.joinpath(narrow[0]).stat().st_mode & 0o777)}"
              "); chmod the source files if others must read the export", file=sys.stderr)


def _fraction(text: str) -> float:
    """A number in [0, 1) for argparse (an error naming the value otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def _add_setting_flags(p: argparse.ArgumentParser) -> None:
    """``--preset`` and one flag per :data:`SETTING_FLAGS` field; choices and defaults are the core's."""
    core = core_settings()
    d = core.defaults
    g = p.add_argument_group("recommended cache settings (default: AsymKVConfig(), the 'balanced' preset; a flag "
                             "overrides the preset's or the default value)")
    g.add_argument("--preset", default=None, choices=core.presets,
                   help=f"start from this preset of hf_asymkv.PRESETS, one of {', '.join(core.presets)}; a preset "
                        "with asymmetric keys needs --key-symmetric, as calibrated ranges serve symmetric keys "
                        "(default: none, i.e. AsymKVConfig()'s values)")
    g.add_argument("--key-format", default=None, choices=core.key_formats,
                   help=f"key storage format, one of {', '.join(core.key_formats)} (default {d['key_format']})")
    g.add_argument("--value-bits", type=int, default=None, choices=core.value_bits,
                   help=f"value bits, one of {', '.join(map(str, core.value_bits))} (default {d['value_bits']})")
    g.add_argument("--key-block-size", type=at_least(1), default=None,
                   help=f"tokens per quantized block (default {d['key_block_size']})")
    g.add_argument("--residual-length", type=at_least(0), default=None,
                   help=f"newest tokens kept exact (default {d['residual_length']})")
    g.add_argument("--sink-tokens", type=at_least(0), default=None,
                   help=f"first tokens kept exact (default {d['sink_tokens']})")
    g.add_argument("--key-symmetric", action=argparse.BooleanOptionalAction, default=None,
                   help=f"symmetric key codes; --no-key-symmetric: scale and zero per channel block, for the 4/3/2-bit "
                        f"integer key formats (default {'on' if d['key_symmetric'] else 'off'})")
    g.add_argument("--key-wide-fraction", type=_fraction, default=None,
                   help="share of each block's key channels given one more code bit (int4/int3/int2 keys per channel; "
                        f"compact uses 0.25; 0 for none) (default {d['key_wide_fraction']})")
    g.add_argument("--value-rotation", action=argparse.BooleanOptionalAction, default=None,
                   help=f"store values Hadamard-rotated (default {'on' if d['value_rotation'] else 'off'})")
    g.add_argument("--overflow-policy", default=None, choices=core.overflow_policies,
                   help=f"what a key beyond its calibrated range does, one of {', '.join(core.overflow_policies)} "
                        f"(default {d['overflow_policy']})")


def add_parsers(sub) -> None:
    from ..models import DEFAULT_MODEL

    p = sub.add_parser("publish", help="write a folder (optionally a Hub repo) with the scales, settings and a "
                                       "model card",
                       description="Write OUT/ with a copy of the scales file (validated against the model's "
                                   "config), asymkv_config.json (recommended AsymKVCache settings) and a README.md "
                                   "model card; load it back with AsymKVCache.from_pretrained(OUT or REPO, "
                                   "config=model.config).")
    p.add_argument("--model", default=DEFAULT_MODEL, type=model_source,
                   help=f"model the scales belong to: HF model id, local folder or .gguf file; only its config is "
                        f"read (default: the embedded {DEFAULT_MODEL})")
    input_arg(p, "--scales", required=True, check=existing_file, help="kv_scales.safetensors file from `hf-asymkv "
                                                                      "calibrate`")
    p.add_argument("--out", required=True, type=output_path("folder", whole=True),
                   help="folder to create (must not exist or be empty)")
    input_arg(p, "--eval-results", default=None,
                   help="folder of .md/.json result files (or one such file), quoted verbatim in the card")
    p.add_argument("--push-to-hub", default=None, metavar="REPO", type=_hub_repo_id,
                   help="also upload the folder to this Hub model repo (created if missing; needs a login/HF_TOKEN)")
    p.add_argument("--private", action="store_true", help="create the Hub repo private")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it is an earlier publish folder")
    p.add_argument("--base-model", default=None, help="base model Hub id for the card (default: inferred if known)")
    p.add_argument("--license", default=None, help="license id for the card front matter (default: inferred if known)")
    _add_setting_flags(p)
    input_arg(p, "--layer-overrides", default=None, check=existing_file, metavar="JSON",
              help="per-layer settings to publish: a JSON file {\"<layer index>\": {setting: value}} (negative "
                   "indices count from the last layer), or an asymkv_config.json whose layer_overrides to take; e.g. "
                   "the allocation of docs/protection.md (default: none)")
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
    input_arg(p, "--scales", group=src, default=None, check=existing_file,
              help="our kv_scales.safetensors file to export")
    input_arg(p, "--from-checkpoint", group=src, default=None, metavar="CKPT",
                     help="checkpoint folder (or .safetensors file) holding k_scale/v_scale (per tensor or per head) "
                          "to import")
    p.add_argument("--model", default=None, type=model_source,
                   help="with --scales: the checkpoint to add the scales to (safetensors folder, Hub id, or "
                        f"{DEFAULT_MODEL}); with --from-checkpoint: its config, needed unless CKPT has a config.json")
    p.add_argument("--out", required=True, type=output_path("any", whole=True),
                   help="export folder, or with --from-checkpoint the scales file to write")
    p.add_argument("--strategy", default=None, choices=["tensor", "attn_head"],
                   help="with --model: one FP8 scale per layer (tensor, default) or per KV head (attn_head)")
    p.add_argument("--tp-size", type=at_least(1), default=1,
                   help="with --model: tensor-parallel ranks listed in SGLang's kv_cache_scales.json (default 1)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export folder / existing file")
    p.set_defaults(func=_cmd_export_vllm)
