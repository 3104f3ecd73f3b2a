"""A complete serving checkpoint: a model's weights (linked, never modified) plus FP8 KV scales that vLLM and
SGLang load, a compressed-tensors ``quantization_config`` carrying the ``kv_cache_scheme``, and a how-to.

Layout of ``SERVE_DIR`` (every weight file of the source keeps its bytes; single-file checkpoints are listed
under a shard name so that the added scales can sit in their own file)::

    model-0000i-of-0000N.safetensors   hard links (or copies) of the source weights
    model-kv-scales.safetensors        <attention module of layer i>.k_scale / v_scale (float32), e.g.
                                       model.layers.{i}.self_attn.k_scale (:mod:`.attention_names`)
    model.safetensors.index.json       weight_map over both, metadata.total_size
    config.json                        the source config + quantization_config.kv_cache_scheme
    kv_cache_scales.json               SGLang / legacy vLLM --quantization-param-path file
    tokenizer files, generation_config.json, ...   linked as they are
    README.md, hf_asymkv_export.json   how to serve it; what was exported from what
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..core.fileio import usual_mode, write_folder_atomically
from ..core.scales import FP8_E4M3_MAX, KVScales, config_fingerprint
from ..core.shapes import kv_layer_indices
from .attention_names import attention_prefixes
from .sglang import SGLANG_FILE, sglang_scales
from .vllm import STRATEGIES, kv_cache_scheme, kv_scale_tensors

__all__ = ["EXPORT_MARKER", "SCALES_SHARD", "export_serving_checkpoint", "validate_quantization_config"]

SCALES_SHARD = "model-kv-scales.safetensors"
EXPORT_MARKER = "hf_asymkv_export.json"
INDEX = "model.safetensors.index.json"
_REWRITTEN = {"config.json", INDEX, "README.md", SCALES_SHARD, SGLANG_FILE, EXPORT_MARKER}
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def _tensor_bytes(path: Path) -> dict[str, int]:
    """``{tensor name: bytes}`` of a safetensors file, from its header (``get_slice``: no tensor is read)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            return {name: math.prod(s.get_shape()) * _DTYPE_BYTES[s.get_dtype()] for name, s in slices.items()}
    except (SafetensorError, OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{path}: not a readable safetensors file (truncated or foreign?): {exc}") from None


def _weight_files(model_dir: Path) -> dict[str, list[str]]:
    """``{shard file name: [tensor names]}`` of a safetensors checkpoint, single-file or sharded (index)."""
    index = model_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not a safetensors index (no weight_map): {exc}") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: weight_map must be a JSON object, got {type(weight_map).__name__}")
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):  # nothing outside
                raise ValueError(f"{index}: the shard of {name!r} is not a file name in the folder: {str(shard)[:80]!r}")
            shards.setdefault(shard, []).append(name)
        try:
            missing = sorted(s for s in shards if not (model_dir / s).is_file())
        except OSError as exc:  # a name the file system refuses (longer than it allows, ...)
            raise ValueError(f"{index}: a shard name the file system refuses: {exc.strerror}") from None
        if missing:
            raise ValueError(f"{index} lists shards that are not in the folder: {missing}")
        return shards
    single = model_dir / "model.safetensors"
    if single.is_file():
        return {single.name: list(_tensor_bytes(single))}
    raise ValueError(f"{model_dir}: no model.safetensors or {INDEX}; export-vllm --model needs a safetensors "
                     "checkpoint (convert .bin weights with save_pretrained(..., safe_serialization=True))")


def _read_config(model_dir: Path) -> tuple[dict, object]:
    """``config.json`` of a checkpoint folder, as a dict and as transformers reads it.

    Raises:
        ValueError: no ``config.json``, or one that is not a JSON object or that transformers refuses (naming it).
    """
    from transformers import AutoConfig

    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir}: not a checkpoint folder (no config.json)")
    try:
        config_dict = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8; nesting deeper than Python's stack
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(config_dict, dict) or not isinstance(config_dict.get("quantization_config", {}), dict):
        raise ValueError(f"{path}: must hold a JSON object (with an object as quantization_config, if any)")
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 - transformers refuses a config with many types (TypeError, KeyError, ...)
        raise ValueError(f"{path}: transformers cannot read it ({type(exc).__name__}: {exc})") from None
    return config_dict, config


def _scale_names(names) -> list[str]:
    return sorted(n for n in names if n.endswith(("k_scale", "v_scale", "k_proj.output_scale", "v_proj.output_scale")))


def _check_scales(model_dir: Path, config, scales: KVScales) -> None:
    """Refuse scales calibrated for another model, or missing some of its attention layers (``ValueError``)."""
    expected, saved = config_fingerprint(config), scales.fingerprint
    for key in ("model_type", "num_hidden_layers", "num_key_value_heads", "head_dim"):
        if key in saved and saved[key] != expected[key]:
            raise ValueError(f"the scales do not belong to {model_dir}: fingerprint {key!r} is {saved[key]!r} in the "
                             f"scales file but {expected[key]!r} in the model (calibrated for "
                             f"{scales.metadata.get('model_id') or 'another model'!r})")
    try:
        scales.validate(config)  # shapes, values and the remaining fingerprint keys (rope, layer types)
    except ValueError as exc:
        raise ValueError(f"the scales do not belong to {model_dir}: {exc}") from None
    missing = sorted(set(kv_layer_indices(config)) - set(scales.k_channel_absmax))
    if missing:
        raise ValueError(f"the scales have no ranges for layers {missing} of {model_dir}; vLLM would run those "
                         "layers with a scale of 1.0, so calibrate every attention layer")


def _check_checkpoint(model_dir: Path, config_dict: dict, shards: dict[str, list[str]]) -> None:
    """Refuse a checkpoint that already holds KV scales or uses another quantization method (``ValueError``)."""
    present = _scale_names(n for names in shards.values() for n in names)
    if present:
        raise ValueError(f"{model_dir} already holds KV scales ({present[0]}, ... {len(present)} tensors); import them "
                         "with `hf-asymkv export-vllm --from-checkpoint` instead of adding ours beside them")
    qc = config_dict.get("quantization_config")
    if qc is not None and qc.get("quant_method") != "compressed-tensors":
        raise ValueError(f"{model_dir}/config.json has a {qc.get('quant_method')!r} quantization_config; a KV "
                         "cache scheme can only be added to an unquantized or compressed-tensors checkpoint")


def merged_quantization_config(existing: dict | None, strategy: str) -> dict:
    """``existing`` (a compressed-tensors ``quantization_config`` or None) with our ``kv_cache_scheme`` set."""
    if existing is None:  # compressed-tensors needs config_groups, empty when only the KV cache is quantized
        existing = {"quant_method": "compressed-tensors", "format": "dense", "quantization_status": "compressed",
                    "config_groups": {}, "ignore": []}
    return {**existing, "kv_cache_scheme": kv_cache_scheme(strategy)}


def validate_quantization_config(qc: dict) -> None:
    """Check ``qc`` with compressed-tensors' own model when it is installed (``pip install compressed-tensors``).

    Raises:
        ValueError: compressed-tensors rejects it, naming its complaint.
    """
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:  # optional: the export stands without it; tests install it
        return
    try:
        QuantizationConfig.model_validate(qc)
    except Exception as exc:  # pydantic.ValidationError and whatever the model's validators raise
        raise ValueError(f"compressed-tensors rejects the quantization_config: {exc}") from None


def _link_or_copy(src: Path, dst: Path) -> str:
    """Hard-link ``src`` as ``dst`` (no bytes copied; a link shares the source's mode), or copy it across file
    systems (with the usual mode of a new file)."""
    try:
        os.link(src, dst)
        return "linked"
    except OSError:  # another file system, or links not allowed
        shutil.copyfile(src, dst)
        os.chmod(dst, usual_mode())
        return "copied"


def _shard_names(shards: dict[str, list[str]]) -> dict[str, str]:
    """Source shard name -> name in SERVE_DIR (a single ``model.safetensors`` becomes a one-shard checkpoint)."""
    if list(shards) == ["model.safetensors"]:
        return {"model.safetensors": "model-00001-of-00001.safetensors"}
    return {s: s for s in shards}


def _write_weights(tmp: Path, model_dir: Path, shards: dict[str, list[str]], tensors: dict[str, torch.Tensor]) -> dict:
    """Link the source's files into ``tmp``, add the scales shard and the index; return ``{file: "linked"/"copied"}``."""
    from safetensors.torch import save_file

    renamed, how = _shard_names(shards), {}
    for src in sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith(".")):
        if src.name not in _REWRITTEN:
            name = renamed.get(src.name, src.name)
            how[name] = _link_or_copy(src, tmp / name)
    save_file(tensors, str(tmp / SCALES_SHARD), metadata={"format": "pt", "producer": "hf_asymkv"})
    os.chmod(tmp / SCALES_SHARD, usual_mode())  # the writer may create it 0600
    weight_map = {n: renamed[s] for s, names in shards.items() for n in names}
    weight_map.update({n: SCALES_SHARD for n in tensors})
    total = sum(sum(_tensor_bytes(tmp / name).values()) for name in [*(renamed[s] for s in shards), SCALES_SHARD])
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return how


def export_serving_checkpoint(model_dir: str | Path, scales: KVScales | str | Path, out_dir: str | Path, *,
                              strategy: str = "tensor", tp_size: int = 1, overwrite: bool = False) -> Path:
    """Write ``out_dir``: the checkpoint in ``model_dir`` plus our KV scales, loadable by vLLM, SGLang, transformers.

    Args:
        model_dir: a local safetensors checkpoint folder (``config.json``, ``model.safetensors`` or an index).
        scales: our calibrated :class:`KVScales` or its ``kv_scales.safetensors`` path.
        out_dir: the folder to create (built in a temp folder beside it, then renamed).
        strategy: ``"tensor"`` (one K and one V scale per layer, shape ``[1]``) or ``"attn_head"`` (one per KV
            head, shape ``[kv_heads, 1, 1]``, the shape compressed-tensors gives its parameters; vLLM flattens it).
        tp_size: tensor-parallel ranks listed in the SGLang JSON (its loader requires the server's TP size).
        overwrite: replace an earlier export folder (one holding ``hf_asymkv_export.json``).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: naming the problem: not a safetensors checkpoint, scales of another model (layer count,
            KV heads, head_dim or architecture), layers without scales, a checkpoint that already holds KV scales
            or another quantization method, a config compressed-tensors rejects, an unknown strategy.
    """
    from ..version import __version__

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
    model_dir = Path(model_dir).expanduser()
    scales_source = "a KVScales object" if isinstance(scales, KVScales) else str(Path(scales).expanduser().resolve())
    if not isinstance(scales, KVScales):
        scales = KVScales.load(scales)  # the model check below names the fingerprint key that differs
    config_dict, config = _read_config(model_dir)
    try:  # a config transformers accepts may still hold fields of the wrong type (architectures: 3, ...)
        _check_scales(model_dir, config, scales)
        shards = _weight_files(model_dir)
        _check_checkpoint(model_dir, config_dict, shards)
        qc = merged_quantization_config(config_dict.get("quantization_config"), strategy)
        validate_quantization_config(qc)
        heads = config_fingerprint(config)["num_key_value_heads"]
        prefixes = attention_prefixes(config, (n for names in shards.values() for n in names),
                                      sorted(scales.k_channel_absmax), where=str(model_dir))
        tensors = kv_scale_tensors(scales, strategy, prefixes)
        sglang = sglang_scales(scales, config_dict.get("model_type"),
                               config.get_text_config(decoder=True).num_hidden_layers, tp_size)
    except ValueError as exc:  # every refusal names the checkpoint
        if str(model_dir) in str(exc):
            raise
        raise ValueError(f"{model_dir}: {exc}") from None
    except (TypeError, KeyError, AttributeError, IndexError, RuntimeError, ArithmeticError, AssertionError) as exc:
        # (the model is built on the meta device from the config to find its attention modules: torch's layers
        # refuse sizes of -1 or a pad id beyond the vocabulary with these)
        raise ValueError(f"{model_dir}: a malformed checkpoint (config.json or weights): {type(exc).__name__}: "
                         f"{exc}") from None

    def build(tmp: Path) -> None:
        how = _write_weights(tmp, model_dir, shards, tensors)
        (tmp / "config.json").write_text(json.dumps({**config_dict, "quantization_config": qc}, indent=2) + "\n",
                                         encoding="utf-8")
        (tmp / SGLANG_FILE).write_text(json.dumps(sglang, indent=2) + "\n", encoding="utf-8")
        (tmp / "README.md").write_text(_readme(model_dir, scales, strategy, heads, prefixes), encoding="utf-8")
        (tmp / EXPORT_MARKER).write_text(json.dumps({
            "producer": "hf_asymkv", "version": __version__, "source_model": str(model_dir.resolve()),
            "scales": scales_source, "scales_model_id": scales.metadata.get("model_id", ""), "strategy": strategy,
            "tp_size": tp_size, "files": how}, indent=2) + "\n", encoding="utf-8")

    return write_folder_atomically(out_dir, build, overwrite=overwrite, marker=EXPORT_MARKER)


def _readme(model_dir: Path, scales: KVScales, strategy: str, heads: int, prefixes: dict[int, str]) -> str:
    layers = sorted(scales.k_channel_absmax)
    rows = "\n".join(f"| {i} | `{prefixes[i]}` | {scales.k_scale(i):.6g} | {scales.v_scale(i):.6g} |" for i in layers)
    per = ("one scale per layer for K and one for V (shape `[1]`)" if strategy == "tensor" else
           f"one scale per KV head for K and for V (shape `[{heads}, 1, 1]`; vLLM reads it as `[{heads}]`)")
    return f"""# {model_dir.name} with FP8 KV-cache scales

Written by `hf-asymkv export-vllm` from `{model_dir}` and scales calibrated by hf-asymkv
(`{scales.metadata.get('model_id') or 'unknown model'}`, statistic `{scales.metadata.get('statistic', 'absmax')}`).
The weights are the source checkpoint's files, unchanged. Added: `{SCALES_SHARD}` with
`k_scale` / `v_scale` under each layer's attention module (named as in the weights, listed below), {per},
each the FP8-E4M3 dequant multiplier
`range / {FP8_E4M3_MAX:g}`; `quantization_config.kv_cache_scheme` (compressed-tensors, strategy `{strategy}`) in
`config.json`; `{SGLANG_FILE}` (one scale per layer for both K and V).

## Serve

```bash
vllm serve {{THIS_FOLDER}} --kv-cache-dtype fp8
python -m sglang.launch_server --model-path {{THIS_FOLDER}} --kv-cache-dtype fp8_e4m3
# SGLang builds that read scales only from a JSON file:
python -m sglang.launch_server --model-path {{THIS_FOLDER}} --kv-cache-dtype fp8_e4m3 \\
    --quantization-param-path {{THIS_FOLDER}}/{SGLANG_FILE}
```

`transformers` loads this folder as the source model (with `compressed-tensors` installed); the scales are
for the engines.

## What carries over

hf-asymkv keeps keys 8-bit with a scale per channel and values 4-bit per token; an engine's FP8 cache keeps
{per}. Only the ranges carry over, as the maximum over the channels (and heads) each engine scale covers.

| layer | attention module | K range / 448 (max) | V range / 448 (max) |
|---|---|---|---|
{rows}
"""
