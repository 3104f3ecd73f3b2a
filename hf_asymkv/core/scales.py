"""`KVScales`: calibrated K/V ranges, the calibrated scales file (``kv_scales.safetensors``, format
``hf_asymkv.kv_scales``), and its validation.

Not to be confused with the vLLM scale file that ``hf-asymkv export-vllm`` writes (only vLLM's per-tensor
``k_scale`` / ``v_scale``, :data:`hf_asymkv.hub.vllm.VLLM_SCALES_FILE`), which this module does not read.

File layout (every tensor float32):

- ``model.layers.{i}.self_attn.k_scale`` / ``.v_scale``: scalars, vLLM's per-tensor FP8-E4M3 dequant
  multipliers (``amax / 448``), so the file can be read by vLLM-style loaders as is.
- ``model.layers.{i}.self_attn.k_channel_absmax``: ``[kv_heads, head_dim]`` post-RoPE key range per channel
  (format-agnostic: the cache derives int8 or fp8 scales from it).
- ``model.layers.{i}.self_attn.v_head_absmax``: ``[kv_heads]`` value range per head.
- ``__metadata__`` (strings): ``format``, ``format_version``, ``model_id``, ``fingerprint`` (JSON of layers,
  kv heads, head_dim, rope, layer types), calibration ``data``, ``num_samples``, ``sample_lengths``,
  ``statistic``, ``tool_version``.

Writes are atomic (temp file in the same folder, then rename); loads validate everything and name the
problem in a ``ValueError``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .fileio import atomic_write
from .quant import FP8_E4M3_MAX
from .shapes import layer_shapes

__all__ = ["FP8_E4M3_MAX", "KVScales", "SCALES_FORMAT", "SCALES_FORMAT_VERSION", "SUPPORTED_SCALES_FORMAT_VERSIONS",
           "config_fingerprint"]

SCALES_FORMAT = "hf_asymkv.kv_scales"
"""``format`` metadata of the calibrated scales file."""
SCALES_FORMAT_VERSION = "1"
SUPPORTED_SCALES_FORMAT_VERSIONS = ("1",)
"""``format_version`` values :meth:`KVScales.load` reads."""
_PREFIX = "model.layers.{}.self_attn."
_REQUIRED_META = ("format", "format_version", "fingerprint")


def save_file(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """safetensors' writer, imported on first use: ``import hf_asymkv`` loads no writer it does not need."""
    from safetensors.torch import save_file as write

    write(tensors, path, metadata=metadata)


def _uniform_or_per_layer(values: list[int]) -> int | list[int]:
    """One number when every layer agrees (what files of homogeneous models always stored), else the list."""
    return values[0] if len(set(values)) == 1 else values


def config_fingerprint(config) -> dict:
    """What a scales file must agree with: layer count, kv heads, head_dim, rope settings, layer types.

    ``num_key_value_heads`` and ``head_dim`` are single numbers when every layer with KV has the same (the form
    every file of a homogeneous model holds) and per-layer lists (one entry per cache layer,
    :func:`~hf_asymkv.core.shapes.layer_shapes`) when they differ (Gemma4's full-attention layers).
    """
    text = config.get_text_config(decoder=True)
    shapes = layer_shapes(config)
    kv = [shape for shape in shapes if shape.holds_kv] or shapes
    heads = _uniform_or_per_layer([shape.kv_heads for shape in kv])
    head_dims = _uniform_or_per_layer([shape.head_dim for shape in kv])
    per_layer = isinstance(heads, list) or isinstance(head_dims, list)
    if per_layer:
        heads, head_dims = [shape.kv_heads for shape in shapes], [shape.head_dim for shape in shapes]
    rope = getattr(text, "rope_parameters", None) or {"rope_theta": getattr(text, "rope_theta", None)}
    if isinstance(rope, dict) and any(isinstance(v, dict) for v in rope.values()):  # per-layer-type rope
        rope = {k: v for k, v in sorted(rope.items())}
    return {
        "model_type": getattr(text, "model_type", None),
        "num_hidden_layers": int(text.num_hidden_layers),
        "num_key_value_heads": heads,
        "head_dim": head_dims,
        "rope": json.loads(json.dumps(rope, default=str, sort_keys=True)),
        "layer_types": list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers),
    }


@dataclass
class KVScales:
    """Calibrated ranges for every layer with KV.

    Attributes:
        k_channel_absmax: ``{layer: Tensor[kv_heads, head_dim]}`` post-RoPE key absmax (or percentile).
        v_head_absmax: ``{layer: Tensor[kv_heads]}`` value absmax per head.
        metadata: string metadata (see module docstring).
    """

    k_channel_absmax: dict[int, torch.Tensor]
    v_head_absmax: dict[int, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)

    # -------------------------------------------------------------- derived views
    def k_scale(self, layer: int) -> float:
        """vLLM per-tensor FP8-E4M3 key dequant multiplier (``amax / 448``)."""
        return float(self.k_channel_absmax[layer].max()) / FP8_E4M3_MAX

    def v_scale(self, layer: int) -> float:
        return float(self.v_head_absmax[layer].max()) / FP8_E4M3_MAX

    @property
    def fingerprint(self) -> dict:
        return json.loads(self.metadata.get("fingerprint", "{}"))

    # -------------------------------------------------------------- I/O
    def to_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i in sorted(self.k_channel_absmax):
            p = _PREFIX.format(i)
            out[p + "k_scale"] = torch.tensor(self.k_scale(i), dtype=torch.float32)
            out[p + "v_scale"] = torch.tensor(self.v_scale(i), dtype=torch.float32)
            out[p + "k_channel_absmax"] = self.k_channel_absmax[i].float()
            out[p + "v_head_absmax"] = self.v_head_absmax[i].float()
        return out

    def save(self, path: str | Path) -> Path:
        """Validate, then write atomically. Returns the path."""
        self.validate()
        # The writer stamps the format it writes: metadata carried over (e.g. from a loaded file) cannot override it.
        meta = {**self.metadata, "format": SCALES_FORMAT, "format_version": SCALES_FORMAT_VERSION}
        # clone: safetensors refuses tensors that share memory (e.g. one range reused for several layers)
        tensors = {k: v.detach().clone().contiguous() for k, v in self.to_tensors().items()}
        return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={k: str(v) for k, v in meta.items()}))

    @classmethod
    def load(cls, path: str | Path, config=None) -> KVScales:
        """Read and validate a scales file; with ``config``, also check it belongs to that model.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a safetensors file (truncated or foreign), not ours, unknown version, missing
                or malformed tensors, non-finite/zero/negative ranges, or another model's file.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"scales file {str(path)!r} does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = dict(f.metadata() or {})
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{path}: not a readable safetensors file (truncated or foreign?): {exc}") from None
        missing_meta = [k for k in _REQUIRED_META if k not in metadata]
        if missing_meta:
            raise ValueError(f"{path}: not an hf_asymkv scales file, metadata lacks {missing_meta}")
        if metadata["format"] != SCALES_FORMAT:
            raise ValueError(f"{path}: format is {metadata['format']!r}, expected {SCALES_FORMAT!r}")
        if metadata["format_version"] not in SUPPORTED_SCALES_FORMAT_VERSIONS:
            raise ValueError(f"{path}: format_version {metadata['format_version']!r} is not supported "
                             f"(supported: {list(SUPPORTED_SCALES_FORMAT_VERSIONS)}); upgrade hf-asymkv")
        try:
            fingerprint = json.loads(metadata["fingerprint"])
        except (json.JSONDecodeError, RecursionError):  # (nesting deeper than Python's stack)
            fingerprint = None
        if not isinstance(fingerprint, dict):
            raise ValueError(f"{path}: metadata 'fingerprint' is not a JSON object: {metadata['fingerprint'][:80]!r}")
        try:
            scales = cls._from_tensors(tensors, metadata, str(path))
            scales.validate(config)
        except ValueError as exc:  # every load error names the file
            if str(path) in str(exc):
                raise
            raise ValueError(f"{path}: {exc}") from None
        return scales

    @classmethod
    def _from_tensors(cls, tensors: dict[str, torch.Tensor], metadata: dict, where: str) -> KVScales:
        k_abs, v_abs, layers = {}, {}, set()
        for name, t in tensors.items():
            layer, _, leaf = name.removeprefix("model.layers.").partition(".self_attn.")
            if not name.startswith("model.layers.") or not layer.isdigit():
                raise ValueError(f"{where}: unexpected tensor {name!r}")
            layers.add(int(layer))  # a layer named by any of its tensors must have all four
            if leaf == "k_channel_absmax":
                k_abs[int(layer)] = t.float()
            elif leaf == "v_head_absmax":
                v_abs[int(layer)] = t.float()
            elif leaf not in ("k_scale", "v_scale"):
                raise ValueError(f"{where}: unexpected tensor {name!r}")
        for i in sorted(layers):
            p = _PREFIX.format(i)
            missing = [p + s for s in ("k_scale", "v_scale", "k_channel_absmax", "v_head_absmax") if p + s not in tensors]
            if missing:
                raise ValueError(f"{where}: missing tensors {missing}")
        if not k_abs:
            raise ValueError(f"{where}: no per-layer k_channel_absmax tensors")
        scales = cls(k_abs, v_abs, metadata)
        scales.validate()  # shapes and values first: the vLLM scalars are checked against valid ranges
        for i in sorted(layers):
            p = _PREFIX.format(i)
            for leaf, expected in (("k_scale", scales.k_scale(i)), ("v_scale", scales.v_scale(i))):
                t = tensors[p + leaf]
                if t.dim() != 0:
                    raise ValueError(f"{where}: {p + leaf} must be a scalar, got shape {tuple(t.shape)}")
                value = float(t)
                if not abs(value - expected) <= 1e-5 * expected:  # also catches NaN
                    raise ValueError(f"{where}: {p + leaf} is {value!r} but its absmax / {FP8_E4M3_MAX:g} is "
                                     f"{expected!r} (the file was edited inconsistently)")
        return scales

    # -------------------------------------------------------------- validation
    def validate(self, config=None) -> None:
        """Check shapes, values and (with ``config``) that the ranges belong to this model.

        Raises:
            ValueError: naming the layer/tensor and what is wrong with it.
        """
        if not self.k_channel_absmax:
            raise ValueError("no layers: k_channel_absmax is empty")
        if set(self.k_channel_absmax) != set(self.v_head_absmax):
            raise ValueError(f"K and V ranges cover different layers: {sorted(self.k_channel_absmax)} vs "
                             f"{sorted(self.v_head_absmax)}")
        for i, k in self.k_channel_absmax.items():
            v = self.v_head_absmax[i]
            if k.dim() != 2 or v.dim() != 1 or v.shape[0] != k.shape[0] or k.numel() == 0:
                raise ValueError(f"layer {i}: k_channel_absmax must be [kv_heads, head_dim] and v_head_absmax "
                                 f"[kv_heads]; got {tuple(k.shape)} and {tuple(v.shape)}")
            for name, t in (("k_channel_absmax", k), ("v_head_absmax", v)):
                if not torch.isfinite(t).all():
                    raise ValueError(f"layer {i}: {name} has NaN or inf values")
                if (t <= 0).any():
                    raise ValueError(f"layer {i}: {name} has zero or negative values (min {float(t.min())})")
        if config is not None:
            self._check_config(config)

    def _check_config(self, config) -> None:
        expected = config_fingerprint(config)
        n_layers, shapes = expected["num_hidden_layers"], layer_shapes(config)
        bad_layers = [i for i in self.k_channel_absmax if not 0 <= i < n_layers]
        if bad_layers:
            raise ValueError(f"scales name layers {bad_layers} but the model has {n_layers} layers "
                             "(a file calibrated for another model?)")
        for i, k in self.k_channel_absmax.items():
            heads, head_dim = (shapes[i].kv_heads, shapes[i].head_dim) if i < len(shapes) else (None, None)
            if tuple(k.shape) != (heads, head_dim):
                raise ValueError(f"layer {i}: k_channel_absmax is {tuple(k.shape)}, the model needs "
                                 f"[{heads}, {head_dim}] (a file calibrated for another model?)")
        saved = self.fingerprint
        for key, value in expected.items():
            if key in saved and saved[key] != value:
                raise ValueError(f"scales fingerprint mismatch on {key!r}: file has {saved[key]!r}, model has "
                                 f"{value!r} (calibrated for {self.metadata.get('model_id', 'another model')!r})")
