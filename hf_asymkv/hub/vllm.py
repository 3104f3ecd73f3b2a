"""vLLM interchange: our ranges as vLLM's FP8 KV scale tensors and ``kv_cache_scheme``, and such scales read back.

vLLM (and llm-compressor / compressed-tensors checkpoints) keep FP8-E4M3 dequant multipliers ``amax / 448`` as
``model.layers.{i}.self_attn.k_scale`` / ``.v_scale``: one per layer (``strategy: tensor``) or one per KV head
(``strategy: attn_head``). Our per-channel key ranges collapse to their maximum over what one scale covers; on
import each scale's range fills every channel it covers (per-channel key precision cannot be recovered).
:mod:`.serving` assembles a complete checkpoint from these pieces.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..core.scales import FP8_E4M3_MAX, KVScales, config_fingerprint
from ..core.shapes import kv_layer_indices, layer_shapes

__all__ = ["KV_CACHE_SCHEME", "STRATEGIES", "VLLM_SCALES_FILE", "export_vllm", "kv_cache_scheme", "kv_scale_tensors",
           "read_vllm_scales", "vllm_scale_names"]

VLLM_SCALES_FILE = "kv_scales.safetensors"
SCHEME_FILE = "kv_cache_scheme.json"
STRATEGIES = ("tensor", "attn_head")
"""compressed-tensors KV strategies vLLM loads: one scale per layer, or one per KV head."""


def kv_cache_scheme(strategy: str = "tensor") -> dict:
    """compressed-tensors ``kv_cache_scheme`` (``QuantizationArgs``) for static symmetric FP8-E4M3 KV scales."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
    return {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}


KV_CACHE_SCHEME = {"kv_cache_scheme": kv_cache_scheme("tensor")}
"""compressed-tensors snippet to merge into ``config.json``'s ``quantization_config``."""

# Names vLLM's loader accepts for per-tensor KV scales (it remaps them to `<attention module>.attn.k_scale`), for a
# Llama checkpoint whose attention modules are `model.layers.{i}.self_attn`:
#   model.layers.{i}.self_attn.k_scale            (llm-compressor, current)
#   model.layers.{i}.self_attn.attn.k_scale       (vLLM's own parameter name)
#   model.layers.{i}.self_attn.k_proj.k_scale     (ModelOpt)
#   model.layers.{i}.self_attn.k_proj.output_scale (older compressed-tensors)
# Other checkpoints name the attention module their own way (`gpt_neox.layers.{i}.attention`,
# `model.language_model.layers.{i}.self_attn`, ...): any `<...>.{i}.<module>.` prefix is read.
_PREFIX = r"(?P<prefix>(?:\w+\.)*?)(?P<layer>\d+)\.(?P<module>\w+)\."
_NAME_PATTERNS = (
    re.compile(_PREFIX + r"(?:attn\.)?(?P<kind>[kv])_scale$"),
    re.compile(_PREFIX + r"(?P<kind>[kv])_proj\.(?P=kind)_scale$"),
    re.compile(_PREFIX + r"(?P<kind>[kv])_proj\.output_scale$"),
)


def vllm_scale_names(layer: int, prefix: str | None = None) -> tuple[str, str]:
    """The K and V scale names of ``layer``: ``<prefix>.k_scale`` / ``.v_scale``, where ``prefix`` is the layer's
    attention module as the checkpoint names it (:func:`.attention_names.attention_prefixes`); without one,
    Llama's ``model.layers.{layer}.self_attn``."""
    prefix = prefix or f"model.layers.{layer}.self_attn"
    return f"{prefix}.k_scale", f"{prefix}.v_scale"


def kv_scale_tensors(scales: KVScales, strategy: str = "tensor", prefixes: dict[int, str] | None = None
                     ) -> dict[str, torch.Tensor]:
    """Per-layer ``k_scale`` / ``v_scale`` checkpoint tensors (float32, FP8-E4M3 dequant multipliers ``range / 448``).

    Args:
        prefixes: ``{layer: attention module name}`` of the checkpoint (:func:`vllm_scale_names`); None: Llama's.
        strategy: ``"tensor"``: shape ``[1]``, the layer's largest range (what llm-compressor writes and
            compressed-tensors allocates). ``"attn_head"``: shape ``[kv_heads, 1, 1]``, each KV head's largest
            key channel / its value range (compressed-tensors' parameter shape; vLLM flattens it to ``[kv_heads]``).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
    out = {}
    for i in sorted(scales.k_channel_absmax):
        k_range = scales.k_channel_absmax[i].float().amax(dim=1)  # [kv_heads]
        v_range = scales.v_head_absmax[i].float()  # [kv_heads]
        k_name, v_name = vllm_scale_names(i, (prefixes or {}).get(i))
        for name, ranges in ((k_name, k_range), (v_name, v_range)):
            per = ranges.reshape(-1, 1, 1) if strategy == "attn_head" else ranges.max().reshape(1)
            out[name] = (per / FP8_E4M3_MAX).contiguous()
    return out


def _readme(scales: KVScales) -> str:
    layers = sorted(scales.k_channel_absmax)
    model_id = scales.metadata.get("model_id") or "the model"
    return f"""# FP8 KV-cache scales for vLLM

Exported by hf-asymkv from calibrated ranges of `{model_id}` (layers {layers[0]}-{layers[-1]}, {len(layers)} in all).
`{VLLM_SCALES_FILE}` holds only vLLM's per-tensor names, one float32 scalar each:
`model.layers.{{i}}.self_attn.k_scale` and `model.layers.{{i}}.self_attn.v_scale`, the layer's largest key / value
range divided by {FP8_E4M3_MAX:g} (the FP8-E4M3 dequant multiplier). These are the names of Llama-style
checkpoints; a checkpoint whose attention modules are named otherwise (GPT-NeoX's `gpt_neox.layers.{{i}}.attention`,
multimodal `model.language_model.layers.{{i}}.self_attn`, ...) needs `hf-asymkv export-vllm --model CHECKPOINT`,
which names the scales after the checkpoint's own modules.

## How to use

1. Add the tensors to the checkpoint's weights, e.g. for a single-file checkpoint:

   ```python
   from safetensors.torch import load_file, save_file

   weights = load_file("CHECKPOINT/model.safetensors")
   weights.update(load_file("{VLLM_SCALES_FILE}"))
   save_file(weights, "CHECKPOINT/model.safetensors", metadata={{"format": "pt"}})
   ```

   For a sharded checkpoint, add them to one shard (or a new file) and list every added name in
   `model.safetensors.index.json`'s `weight_map`.
2. Add the contents of `{SCHEME_FILE}` to `quantization_config` in the checkpoint's `config.json`. A
   checkpoint that has no `quantization_config` needs one with `"quant_method": "compressed-tensors"` around
   it; check the quantized KV-cache page of your vLLM version's documentation for the exact fields it expects.
3. Serve: `vllm serve CHECKPOINT --kv-cache-dtype fp8_e4m3`.

## What carries over

vLLM uses one per-tensor scale for K and one for V per layer. hf-asymkv stores keys int8 (or fp8) with a scale
per channel and values int4 per token; that storage does not carry over, only the ranges do: each layer's
scale is the maximum over its channels/heads, so channels with small keys get fewer effective bits in vLLM
than in `AsymKVCache`. Import such scales back with `hf-asymkv export-vllm --from-checkpoint DIR --model M`.
"""


def export_vllm(scales: KVScales | str | Path, out_dir: str | Path, *, config=None, overwrite: bool = False) -> Path:
    """Write a folder with vLLM's per-tensor KV scales, the ``kv_cache_scheme`` snippet and a how-to.

    Args:
        scales: a :class:`KVScales` or a ``kv_scales.safetensors`` path.
        out_dir: the folder to create (built in a temp folder, then renamed).
        config: optional model config the scales must belong to.
        overwrite: replace an existing export folder.

    Returns:
        ``out_dir`` as a Path, holding ``kv_scales.safetensors`` (only ``model.layers.{i}.self_attn.k_scale`` /
        ``v_scale``, float32, 0-dim), ``kv_cache_scheme.json`` and ``README.md``.
    """
    from ..core.fileio import usual_mode, write_folder_atomically
    from ..version import __version__

    if isinstance(scales, KVScales):
        scales.validate(config)
    else:
        scales = KVScales.load(scales, config)
    tensors = {}
    for i in sorted(scales.k_channel_absmax):
        k_name, v_name = vllm_scale_names(i)
        tensors[k_name] = torch.tensor(scales.k_scale(i), dtype=torch.float32)
        tensors[v_name] = torch.tensor(scales.v_scale(i), dtype=torch.float32)
    meta = {"format": "pt", "producer": "hf_asymkv", "hf_asymkv_version": __version__,
            "model_id": scales.metadata.get("model_id", ""), "meaning": f"amax / {FP8_E4M3_MAX:g} (FP8-E4M3)"}

    def build(tmp: Path) -> None:
        save_file(tensors, str(tmp / VLLM_SCALES_FILE), metadata=meta)
        os.chmod(tmp / VLLM_SCALES_FILE, usual_mode())  # safetensors writes 0600
        (tmp / SCHEME_FILE).write_text(json.dumps(KV_CACHE_SCHEME, indent=2) + "\n", encoding="utf-8")
        (tmp / "README.md").write_text(_readme(scales), encoding="utf-8")

    return write_folder_atomically(out_dir, build, overwrite=overwrite, marker=SCHEME_FILE)


def _match(name: str):
    """``(module prefix with the layer index as *, layer, "k" or "v")`` of a KV scale name, or None."""
    for pattern in _NAME_PATTERNS:
        m = pattern.fullmatch(name)
        if m:
            return f"{m.group('prefix')}*.{m.group('module')}", int(m.group("layer")), m.group("kind")
    return None


def _scale_values(t: torch.Tensor, heads: int, where: str) -> torch.Tensor:
    """A checkpoint scale as ``[1]`` (per tensor) or ``[kv_heads]`` (per head), float32; ``ValueError`` otherwise."""
    per_tensor = t.numel() == 1 and t.dim() <= 1
    per_head = t.numel() == heads and list(t.shape) in ([heads], [heads, 1, 1])
    if not (per_tensor or per_head):
        raise ValueError(f"{where}: expected a per-tensor scale (shape [] or [1]) or one per KV head ([{heads}] or "
                         f"[{heads}, 1, 1]), got shape {list(t.shape)}")
    value = t.detach().float().reshape(-1)
    bad = value[~(torch.isfinite(value) & (value > 0))]
    if bad.numel():
        raise ValueError(f"{where} must be finite and > 0, got {float(bad[0])!r}")
    return value


def read_vllm_scales(folder_or_file: str | Path, config, *, model_id: str | None = None) -> KVScales:
    """Read K/V scales from a vLLM / llm-compressor style checkpoint into :class:`KVScales`.

    Scans every ``*.safetensors`` file of a folder (sharded checkpoints included), or one file. A per-tensor
    scale (shape ``[]``/``[1]``) fills all channels and heads of its layer with ``scale * 448``; a per-head scale
    (``strategy: attn_head``, shape ``[kv_heads]`` or ``[kv_heads, 1, 1]``) fills each head's channels.

    Args:
        config: the model config (layer count, KV heads, head_dim; fingerprint of the result).
        model_id: recorded in the metadata (default: the config's ``_name_or_path``).

    Raises:
        FileNotFoundError: no such file or folder.
        ValueError: naming the file / tensor / layer: no safetensors files, unreadable file, no scales found,
            layers without a K or V scale, shapes other than per-tensor / per-head, non-finite or non-positive
            scales, conflicting duplicates.
    """
    from ..version import __version__

    path = Path(folder_or_file).expanduser()
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path}: no .safetensors files in this folder")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")

    fp, shapes = config_fingerprint(config), layer_shapes(config)
    n_layers = fp["num_hidden_layers"]
    kv_heads = {i: shape.kv_heads for i, shape in enumerate(shapes)}
    found: dict[tuple[int, str], tuple[torch.Tensor, str]] = {}  # (layer, "k"/"v") -> (scale(s), "file: tensor")
    prefixes: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                names = [(n, m) for n in st.keys() if (m := _match(n))]
                tensors = {n: st.get_tensor(n) for n, _ in names}
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{f}: not a readable safetensors file (truncated or foreign?): {exc}") from None
        for name, (prefix, layer, kind) in names:
            where = f"{f.name}: {name}"
            prefixes.setdefault(prefix, where)
            heads = kv_heads.get(layer, shapes[0].kv_heads)  # a layer beyond the model is named below
            value = _scale_values(tensors[name], heads, f"{where} (layer {layer}): {kind}_scale")
            previous = found.get((layer, kind))
            if previous is not None and not (previous[0].numel() == value.numel()
                                             and torch.allclose(previous[0], value, rtol=1e-6, atol=0)):
                raise ValueError(f"layer {layer}: conflicting {kind}_scale values {previous[0].tolist()!r} "
                                 f"({previous[1]}) and {value.tolist()!r} ({where})")
            found.setdefault((layer, kind), (value, where))
    where_all = str(path)
    if not found:
        raise ValueError(f"{where_all}: no per-tensor KV scales found (looked for model.layers.{{i}}.self_attn."
                         "k_scale / v_scale, ...self_attn.attn.k_scale, ...k_proj.output_scale in "
                         f"{len(files)} file(s))")
    if len(prefixes) > 1:
        raise ValueError(f"{where_all}: KV scales under several module prefixes, ambiguous: "
                         f"{sorted(prefixes.values())}")

    layers = sorted({layer for layer, _ in found})
    beyond = [i for i in layers if i >= n_layers]
    if beyond:
        raise ValueError(f"{where_all}: scales for layers {beyond}, but the model has {n_layers} layers "
                         "(a checkpoint of another model?)")
    missing = [f"layer {i}: no {kind}_scale" for i in sorted(set(layers) | set(kv_layer_indices(config)))
               for kind in "kv" if (i, kind) not in found]
    if missing:
        raise ValueError(f"{where_all}: incomplete KV scales ({len(missing)} missing): " + "; ".join(missing[:8])
                         + (" ..." if len(missing) > 8 else ""))
    k_abs = {i: (found[(i, "k")][0] * FP8_E4M3_MAX).reshape(-1, 1).expand(shapes[i].kv_heads, shapes[i].head_dim).clone()
             for i in layers}
    v_abs = {i: (found[(i, "v")][0] * FP8_E4M3_MAX).expand(shapes[i].kv_heads).clone() for i in layers}
    per_head = any(value.numel() > 1 for value, _ in found.values())
    kind_of = "per-head" if per_head else "per-tensor"
    meta = {
        "fingerprint": json.dumps(fp),
        "model_id": model_id if model_id is not None else str(getattr(config, "_name_or_path", "") or ""),
        "data": f"not recorded: imported from {kind_of} vLLM scales in {path.name}",
        "statistic": f"{kind_of} (imported)",
        "source": f"vllm-{kind_of}",
        "source_files": json.dumps([f.name for f in files]),
        "note": "every channel holds its head's imported range (scale * 448); per-tensor scales fill every head",
        "tool_version": __version__,
    }
    scales = KVScales(k_abs, v_abs, meta)
    scales.validate(config)
    return scales
