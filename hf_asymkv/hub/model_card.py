"""Model card rendering for published scales: ``README.md`` from ``model_cards/TEMPLATE.md`` (or the built-in
copy of it), with YAML front matter, usage, calibration facts, per-layer ranges and the attached evaluation.

Used by :func:`hf_asymkv.hub.publish.publish`; :func:`render_card` is re-exported there.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from ..core.config import AsymKVConfig
from ..core.scales import KVScales

__all__ = [
    "EVAL_DIR",
    "read_eval",
    "render_card",
    "render_template",
]

EVAL_DIR = "eval"
"""Folder of a published folder holding the evaluation files the card quotes."""
_TEMPLATE_PATH = Path(__file__).resolve().parents[2] / "model_cards" / "TEMPLATE.md"
_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def _template() -> str:
    if _TEMPLATE_PATH.is_file():  # a source checkout: the editable template
        return _TEMPLATE_PATH.read_text(encoding="utf-8")
    return _BUILTIN_TEMPLATE  # an installed wheel (model_cards/ is not package data)


def render_template(template: str, values: dict[str, str]) -> str:
    """Replace every ``{{name}}`` in one pass (inserted text is not scanned again).

    Raises:
        ValueError: the template names a placeholder without a value.
    """
    missing = sorted({m.group(1) for m in _PLACEHOLDER.finditer(template)} - set(values))
    if missing:
        raise ValueError(f"model card template has placeholders without values: {missing}")
    # A line holding only a placeholder whose value is empty disappears (optional blocks leave no gap).
    lines = [line for line in template.splitlines(keepends=True)
             if not ((m := _PLACEHOLDER.fullmatch(line.strip())) and values[m.group(1)] == "")]
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], "".join(lines))


def _cell(value) -> str:
    if isinstance(value, float):
        text = repr(value)  # the number as measured: no rounding
    elif isinstance(value, (dict, list)):
        text = json.dumps(value, separators=(",", ":"))
    else:
        text = str(value)
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _sample_lengths_text(raw: str) -> str:
    try:
        lengths = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    if not (isinstance(lengths, list) and lengths and all(isinstance(n, int) for n in lengths)):
        return raw
    if len(set(lengths)) == 1:
        return f"{len(lengths)} x {lengths[0]} tokens ({sum(lengths)} tokens)"
    return (f"{len(lengths)} samples of {min(lengths)}-{max(lengths)} tokens (median {statistics.median(lengths):g}, "
            f"{sum(lengths)} tokens)")


_CALIBRATION_FIELDS = (
    ("data", "Calibration data"),
    ("num_samples", "Samples"),
    ("sample_lengths", "Sample lengths"),
    ("statistic", "Key range statistic"),
    ("percentile", "Percentile"),
    ("chunk_size", "Prefill chunk size"),
    ("dtype", "Model dtype during calibration"),
    ("model_id", "Model id at calibration"),
    ("tool_version", "hf-asymkv version (calibration)"),
)
_HIDDEN_METADATA = ("format", "format_version", "fingerprint")


def _calibration_text(meta: dict[str, str]) -> str:
    rows = []
    for key, label in _CALIBRATION_FIELDS:
        if key == "percentile" and key not in meta:
            continue
        value = meta.get(key)
        if value is None or value == "":
            value = "not recorded"
        elif key == "sample_lengths":
            value = _sample_lengths_text(value)
        rows.append([label, value])
    known = {k for k, _ in _CALIBRATION_FIELDS} | set(_HIDDEN_METADATA)
    rows += [[f"`{k}`", v] for k, v in sorted(meta.items()) if k not in known]
    text = _md_table(["item", "value"], rows)
    statistic = meta.get("statistic", "")
    if statistic == "absmax":
        text += ("\n\nKey ranges are the largest `|K|` seen per (head, channel) after RoPE over every calibration "
                 "token; value ranges the largest `|V|` per head.")
    elif statistic == "percentile":
        text += ("\n\nKey ranges are a per-(head, channel) percentile of `|K|` after RoPE (keys beyond it widen "
                 "their block's scale at run time); value ranges the largest `|V|` per head.")
    return text


def _layer_table(scales: KVScales) -> str:
    rows = []
    for i in sorted(scales.k_channel_absmax):
        k, v = scales.k_channel_absmax[i], scales.v_head_absmax[i]
        rows.append([i, f"{float(k.max()):.4g}", f"{float(k.float().median()):.4g}", f"{float(v.max()):.4g}",
                     f"{scales.k_scale(i):.4e}", f"{scales.v_scale(i):.4e}"])
    return _md_table(["layer", "K range max", "K range median", "V range max", "k_scale", "v_scale"], rows)


def _settings_table(settings: dict) -> str:
    return _md_table(["setting", "value"], [[f"`{k}`", json.dumps(v)] for k, v in settings.items()])


def _storage_text(c: AsymKVConfig) -> str:
    sinks = f" and the first {c.sink_tokens} tokens" if c.sink_tokens else ""
    wide = (f" (the widest {c.key_wide_fraction:g} of each block's channels one bit wider)"
            if c.key_wide_fraction else "")
    return (f"With the recommended settings below, keys are stored {c.key_format} per {c.key_granularity}{wide}, "
            f"values int{c.value_bits} per {c.value_granularity}"
            f"{' (rotated by an orthonormal Hadamard matrix)' if c.value_rotation else ''}, and the newest {c.residual_length} tokens{sinks} "
            "stay exact.")


def _usage(base_model: str | None, where: str) -> str:
    base = base_model or "path/or/id/of/the/base-model"
    return "\n".join([
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        "from hf_asymkv import AsymKVCache, cache_kwargs",
        "",
        f"model = AutoModelForCausalLM.from_pretrained({json.dumps(base)})",
        f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(base)})",
        f"cache = AsymKVCache.from_pretrained({json.dumps(where)}, config=model.config)",
        "",
        'inputs = tokenizer("A long document ... Question: ...", return_tensors="pt")',
        "out = model.generate(**inputs, **cache_kwargs(cache), max_new_tokens=64)  # cache= on transformers 5.24+",
        'print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
        'print(cache.memory_footprint()["total"], cache.stats())',
    ])


def _json_rows(data) -> tuple[list[dict], dict] | None:
    """``(rows, meta)`` when ``data`` is a list of flat objects or ``{"rows": [...], "meta": {...}}``."""
    meta = {}
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
        data = data["rows"]
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        return data, meta
    return None


def read_eval(path: Path) -> list[tuple[Path, str]]:
    """``[(file, markdown)]`` for every ``.md`` / ``.json`` file of an evaluation folder (or one such file)."""
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix.lower() in (".md", ".json"))
        if not files:
            raise ValueError(f"eval results folder {str(path)!r} holds no .md or .json file")
    elif path.is_file():
        if path.suffix.lower() not in (".md", ".json"):
            raise ValueError(f"eval results {str(path)!r}: expected a folder, a .md table or a .json file")
        files = [path]
    else:
        raise ValueError(f"eval results {str(path)!r} does not exist")
    out = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"eval results file {str(f)!r} is not UTF-8 text: {exc}") from None
        if not text.strip():
            raise ValueError(f"eval results file {str(f)!r} is empty")
        if f.suffix.lower() == ".md":
            body = text.strip()
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"eval results file {str(f)!r} is not valid JSON: {exc}") from None
            parsed = _json_rows(data)
            if parsed is None:
                body = "```json\n" + text.strip() + "\n```"
            else:
                rows, meta = parsed
                columns = list(dict.fromkeys(k for r in rows for k in r))
                body = _md_table(columns, [[r.get(c, "") for c in columns] for r in rows])
                if meta:
                    body = "\n".join(f"- `{k}`: {_cell(v)}" for k, v in meta.items()) + "\n\n" + body
        out.append((f, body))
    return out


def render_card(scales: KVScales, cache_config: AsymKVConfig, *, base_model: str | None, where: str, license: str | None = None,
                evaluation: list[tuple[str, str]] | None = None, template: str | None = None) -> str:
    """The model card text.

    Args:
        cache_config: the recommended cache settings (shown as a table and in the storage sentence).
        evaluation: ``[(source name, markdown)]`` quoted verbatim; None or empty: the card says that no
            evaluation was attached.
        where: what the usage snippet passes to ``AsymKVCache.from_pretrained`` (repo id or folder).
    """
    from ..version import __version__

    fingerprint = scales.fingerprint
    model_type = fingerprint.get("model_type")
    tags = ["kv-cache", "quantization", "hf-asymkv"] + ([model_type] if model_type else [])
    from huggingface_hub import ModelCardData  # the Hub's own card metadata: valid YAML, None fields left out

    front = ModelCardData(base_model=base_model, library_name="hf-asymkv", license=license, tags=tags).to_yaml()
    if evaluation:
        parts = [f"Measured results from the attached files (copies in `{EVAL_DIR}/`): Markdown is quoted verbatim, "
                 "JSON rows are shown as a table with their values unchanged."]
        for source, body in evaluation:
            parts.append(f"### {source}\n\nSource: `{EVAL_DIR}/{source}`\n\n{body}")
        eval_text = "\n\n".join(parts)
        extra_files = f"| `{EVAL_DIR}/` | the evaluation files quoted under Evaluation |"
    else:
        eval_text = ("No evaluation was attached to this publication: this card reports no accuracy or memory "
                     "numbers. Measure retrieval on your own long prompts before relying on these scales.")
        extra_files = ""
    title_model = base_model or model_type or "a transformers model"
    values = {
        "front_matter": front,
        "title": f"AsymKV cache scales for {title_model}",
        "base_model_text": f"[`{base_model}`](https://huggingface.co/{base_model})" if base_model else
                           f"a `{model_type or 'transformers'}` model (base model id not recorded)",
        "storage_text": _storage_text(cache_config),
        "usage": _usage(base_model, where),
        "settings_table": _settings_table(cache_config.settings()),
        "extra_files": extra_files,
        "calibration": _calibration_text(scales.metadata),
        "layer_table": _layer_table(scales),
        "evaluation": eval_text,
        "fingerprint": json.dumps(fingerprint, indent=2, sort_keys=True),
        "version": __version__,
    }
    return render_template(template if template is not None else _template(), values)


_BUILTIN_TEMPLATE = '''\
---
{{front_matter}}
---

# {{title}}

Calibrated key/value ranges for the asymmetric KV cache of **hf-asymkv** (`AsymKVCache`, a drop-in
`transformers.Cache`), measured on {{base_model_text}}. {{storage_text}} The calibrated key ranges fix the
per-channel key scales; a key beyond its range is never silently clipped (with the `widen` overflow policy its
block's scale is widened, and `cache.stats()` counts it).

This repository holds no model weights: load the base model as usual and pass this cache to `generate`.

## Usage

```python
{{usage}}
```

The published settings below apply unless you override them, e.g.
`AsymKVCache.from_pretrained(..., config=model.config, residual_length=256)`. Loading checks that the scales
belong to the model (layer count, KV heads, head_dim, RoPE settings) and fails with a message otherwise.

## Recommended cache settings

{{settings_table}}

## Files

| File | Content |
|---|---|
| `kv_scales.safetensors` | per layer: post-RoPE key range per channel `k_channel_absmax` `[kv_heads, head_dim]`, value range per head `v_head_absmax` `[kv_heads]`, and vLLM-style per-tensor FP8 scales `k_scale` / `v_scale` (`amax / 448`) |
| `asymkv_config.json` | format version, recommended `AsymKVCache` settings, base model, hf-asymkv version |
| `README.md` | this card |
{{extra_files}}

## Calibration

{{calibration}}

## Per-layer ranges

`K range max` and `K range median` are the largest and the median per-channel key range of the layer (their
ratio shows how strong the channel outliers are); `k_scale` / `v_scale` are the per-tensor FP8-E4M3 dequant
multipliers (`amax / 448`) a per-tensor engine such as vLLM would use.

{{layer_table}}

## Evaluation

{{evaluation}}

## Model fingerprint

The scales load only into a model whose config matches this fingerprint:

```json
{{fingerprint}}
```

## Using the ranges with vLLM

`hf-asymkv export-vllm --scales kv_scales.safetensors --out vllm_kv_scales/` writes vLLM's per-tensor
`k_scale` / `v_scale` tensors and the `kv_cache_scheme` snippet for `config.json`. vLLM keeps one scale for K
and one for V per layer, so only the ranges carry over, not the per-channel int8 keys and int4 values.

*Card generated by hf-asymkv {{version}}.*
'''
