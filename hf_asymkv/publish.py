"""Publishing calibrated scales: a folder (or Hub repo) with the scales, the recommended cache settings and a
model card, and loading it back (:func:`load_published`, used by ``AsymKVCache.from_pretrained``).

A published folder holds:

- ``kv_scales.safetensors``: a byte-for-byte copy of the calibrated scales file (validated against the model).
- ``asymkv_config.json``: ``format``, ``format_version``, the recommended ``AsymKVCache`` ``settings``, the
  ``scales_file`` name, the ``base_model`` Hub id (or null) and the ``hf_asymkv_version`` that wrote it.
- ``README.md``: a model card rendered from ``model_cards/TEMPLATE.md`` (YAML front matter, usage, calibration
  facts, per-layer ranges, and the attached evaluation verbatim, or a statement that none was attached).
- ``eval/``: copies of the evaluation files the card quotes, when ``eval_results`` is given.

The folder is built in a temp folder next to ``out_dir`` and renamed into place, so a failure never leaves a
half-written folder where a reader looks.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from .scales import KVScales

__all__ = [
    "CONFIG_FILE",
    "CONFIG_FORMAT",
    "CONFIG_FORMAT_VERSION",
    "DEFAULT_SETTINGS",
    "SCALES_FILE",
    "load_config",
    "load_published",
    "publish",
    "push_to_hub",
    "render_card",
]

SCALES_FILE = "kv_scales.safetensors"
CONFIG_FILE = "asymkv_config.json"
CARD_FILE = "README.md"
EVAL_DIR = "eval"
CONFIG_FORMAT = "hf_asymkv.published"
CONFIG_FORMAT_VERSION = "1"
SUPPORTED_CONFIG_VERSIONS = ("1",)
HUB_FILES = [SCALES_FILE, CONFIG_FILE, CARD_FILE]
"""What :func:`load_published` downloads from a Hub repo (``allow_patterns``)."""

DEFAULT_SETTINGS = dict(key_format="int8", value_bits=4, key_block_size=128, residual_length=128, sink_tokens=0,
                        overflow_policy="widen")
"""Recommended ``AsymKVCache`` settings written by :func:`publish` unless overridden."""

# Hub id and license of the model behind the DEFAULT_MODEL alias (its GGUF file carries no Hub id).
_DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_DEFAULT_MODEL_LICENSE = "apache-2.0"
_TEMPLATE_PATH = Path(__file__).resolve().parent.parent / "model_cards" / "TEMPLATE.md"
_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def allowed_settings() -> tuple[str, ...]:
    """``AsymKVCache`` keyword arguments a published config may set (everything except the ranges)."""
    from .cache import AsymKVCache

    params = inspect.signature(AsymKVCache.__init__).parameters
    return tuple(n for n, p in params.items()
                 if p.kind is p.KEYWORD_ONLY and n not in ("scales", "key_absmax"))


# ------------------------------------------------------------------------------------------------ model config
def load_config(model: str):
    """The model's config only (no weights): ``DEFAULT_MODEL``, a Hub id, a local folder or a ``.gguf`` file.

    Raises:
        ValueError: the config cannot be loaded (no such folder/file, not a model, Hub unreachable).
    """
    from transformers import AutoConfig

    from .models import DEFAULT_MODEL, default_model_path

    model = str(model)
    kwargs = {}
    if model == DEFAULT_MODEL:
        source = str(default_model_path())
    elif model.lower().endswith(".gguf"):
        gguf = Path(model).expanduser()
        if not gguf.is_file():
            raise ValueError(f"GGUF file {model!r} does not exist")
        source, kwargs["gguf_file"] = str(gguf.parent), gguf.name
    else:
        source = model
    try:
        return AutoConfig.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:  # not a folder nor a valid/reachable Hub id, unrecognized model, ...
        raise ValueError(f"cannot load the config of model {model!r}: {exc}") from None


def _looks_like_hub_id(text: str | None) -> bool:
    if not text or Path(text).expanduser().exists() or text.lower().endswith(".gguf") or "/" not in text:
        return False  # a bare name ("gpt2") is a valid id, but also what local aliases look like: not guessed
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _base_model(model: str, scales: KVScales) -> str | None:
    """Hub id of the base model: the alias's known id, the ``model`` argument or the scales' ``model_id`` if
    either is a Hub id (``org/name``) rather than a local path; None when unknown."""
    from .models import DEFAULT_MODEL

    for candidate in (model, scales.metadata.get("model_id")):
        if candidate == DEFAULT_MODEL:
            return _DEFAULT_MODEL_HUB_ID
        if _looks_like_hub_id(candidate):
            return candidate
    return None


def _license_of(model: str) -> str | None:
    """License of the base model when it is known: the alias's, or a local folder's model card front matter."""
    from .models import DEFAULT_MODEL

    if model == DEFAULT_MODEL:
        return _DEFAULT_MODEL_LICENSE
    card = Path(model).expanduser() / "README.md"
    if card.is_file():
        front = _front_matter(card.read_text(encoding="utf-8", errors="replace"))
        value = front.get("license") if isinstance(front, dict) else None
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def _front_matter(text: str) -> dict:
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    try:
        end = next(i for i in range(1, len(lines)) if lines[i].strip() == "---")
    except StopIteration:
        return {}
    try:
        import yaml  # a huggingface_hub dependency
    except ImportError:  # pragma: no cover
        return {}
    try:
        data = yaml.safe_load("\n".join(lines[1:end]))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


# ------------------------------------------------------------------------------------------------ settings
def _check_settings(settings, where: str) -> dict:
    if not isinstance(settings, dict):
        raise ValueError(f"{where}: settings must be a JSON object, got {type(settings).__name__}")
    allowed = allowed_settings()
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown AsymKVCache settings {unknown}; allowed: {list(allowed)}")
    for key, value in settings.items():
        if not (value is None or isinstance(value, (str, int, float, bool))):
            raise ValueError(f"{where}: setting {key!r} must be a JSON scalar, got {value!r}")
    return dict(settings)


# ------------------------------------------------------------------------------------------------ atomic folders
def _check_out_dir(out_dir: Path, overwrite: bool, marker: str) -> None:
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ValueError(f"output {str(out_dir)!r} exists and is not a folder")
    if not any(out_dir.iterdir()):
        return
    if not overwrite:
        raise ValueError(f"output folder {str(out_dir)!r} exists and is not empty; choose a new folder or "
                         "replace it with overwrite=True (--overwrite)")
    if not (out_dir / marker).is_file():
        raise ValueError(f"refusing to replace {str(out_dir)!r}: it is not empty and holds no {marker}, so it was "
                         "not written by hf-asymkv; choose a new or empty folder")


def write_folder_atomically(out_dir: str | Path, build: Callable[[Path], None], *, overwrite: bool,
                            marker: str) -> Path:
    """Call ``build(tmp)`` on a temp folder next to ``out_dir``, then rename it to ``out_dir``.

    An existing non-empty ``out_dir`` is refused unless ``overwrite`` and it holds ``marker`` (so only a folder
    this tool wrote is ever replaced). On any error nothing is left behind: no temp folder, no ``out_dir``
    (an overwritten folder is restored).
    """
    out_dir = Path(out_dir).expanduser()
    _check_out_dir(out_dir, overwrite, marker)  # before any work
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    old_root = None
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes it 0700; give the folder the usual permissions
        build(tmp)
        _check_out_dir(out_dir, overwrite, marker)  # again: something may have appeared meanwhile
        if out_dir.exists():
            if any(out_dir.iterdir()):
                old_root = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
                os.rename(out_dir, old_root / "old")
            else:
                out_dir.rmdir()
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if old_root is not None:
                os.rename(old_root / "old", out_dir)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # already renamed on success
        if old_root is not None:
            shutil.rmtree(old_root, ignore_errors=True)
    return out_dir


# ------------------------------------------------------------------------------------------------ model card
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


def _yaml_block(fields: dict) -> str:
    """YAML front matter; strings are JSON-quoted (valid YAML double-quoted scalars)."""
    lines = []
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, list):
            lines.append(f"{key}:")
            lines += [f"- {json.dumps(v)}" for v in value]
        else:
            lines.append(f"{key}: {json.dumps(value)}")
    return "\n".join(lines)


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


def _storage_text(settings: dict) -> str:
    from .cache import AsymKVCache

    defaults = {n: p.default for n, p in inspect.signature(AsymKVCache.__init__).parameters.items()}
    s = {**defaults, **settings}
    window = s["residual_length"]
    sinks = f" and the first {s['sink_tokens']} tokens" if s["sink_tokens"] else ""
    return (f"With the recommended settings below, keys are stored {s['key_format']} per {s['key_granularity']}, "
            f"values int{s['value_bits']} per {s['value_granularity']}, and the newest {window} tokens{sinks} "
            "stay exact.")


def _usage(base_model: str | None, where: str) -> str:
    base = base_model or "path/or/id/of/the/base-model"
    return "\n".join([
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        "from hf_asymkv import AsymKVCache",
        "",
        f"model = AutoModelForCausalLM.from_pretrained({json.dumps(base)})",
        f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(base)})",
        f"cache = AsymKVCache.from_pretrained({json.dumps(where)}, config=model.config)",
        "",
        'inputs = tokenizer("A long document ... Question: ...", return_tensors="pt")',
        "out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)"
        "  # transformers 5.x also takes cache=",
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


def _read_eval(path: Path) -> list[tuple[Path, str]]:
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


def render_card(scales: KVScales, settings: dict, *, base_model: str | None, where: str, license: str | None = None,
                evaluation: list[tuple[str, str]] | None = None, template: str | None = None) -> str:
    """The model card text.

    Args:
        evaluation: ``[(source name, markdown)]`` quoted verbatim; None or empty: the card says that no
            evaluation was attached.
        where: what the usage snippet passes to ``AsymKVCache.from_pretrained`` (repo id or folder).
    """
    from . import __version__

    fingerprint = scales.fingerprint
    model_type = fingerprint.get("model_type")
    tags = ["kv-cache", "quantization", "hf-asymkv"] + ([model_type] if model_type else [])
    front = _yaml_block({"base_model": base_model, "library_name": "hf-asymkv", "license": license, "tags": tags})
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
        "storage_text": _storage_text(settings),
        "usage": _usage(base_model, where),
        "settings_table": _settings_table(settings),
        "extra_files": extra_files,
        "calibration": _calibration_text(scales.metadata),
        "layer_table": _layer_table(scales),
        "evaluation": eval_text,
        "fingerprint": json.dumps(fingerprint, indent=2, sort_keys=True),
        "version": __version__,
    }
    return render_template(template if template is not None else _template(), values)


# ------------------------------------------------------------------------------------------------ publish
def publish(model: str, scales: str | Path, out_dir: str | Path, *, eval_results: str | Path | None = None,
            settings: dict | None = None, overwrite: bool = False, base_model: str | None = None,
            license: str | None = None, repo_id: str | None = None) -> Path:
    """Write a publish folder: the scales, the recommended cache settings and a model card.

    Args:
        model: the model the scales were calibrated for (``DEFAULT_MODEL``, Hub id, local folder, ``.gguf``);
            only its config is loaded.
        scales: the ``kv_scales.safetensors`` file; validated against the model's config.
        out_dir: the folder to create; a non-empty existing folder is refused unless ``overwrite`` (and then
            only one this tool wrote).
        eval_results: a folder of ``.md`` / ``.json`` result files (or one such file), quoted verbatim.
        settings: ``AsymKVCache`` settings that override :data:`DEFAULT_SETTINGS`.
        base_model: the base model's Hub id for the card (default: inferred when ``model`` is one).
        license: the base model's license for the card front matter (default: inferred when known).
        repo_id: the Hub repo the folder will be pushed to (used in the card's usage snippet).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: scales for another model, unknown or invalid settings, bad eval results, non-empty output.
    """
    from . import __version__
    from .cache import AsymKVCache

    out_dir = Path(out_dir).expanduser()
    _check_out_dir(out_dir, overwrite, CONFIG_FILE)  # fail before loading anything
    scales_path = Path(scales).expanduser()
    config = load_config(model)
    loaded = KVScales.load(scales_path, config)
    merged = _check_settings({**DEFAULT_SETTINGS, **(settings or {})}, "settings")
    try:
        AsymKVCache(config, scales=loaded, **merged)  # the settings must build a cache for this model
    except ValueError as exc:
        raise ValueError(f"settings {merged} do not build an AsymKVCache for {model!r}: {exc}") from None
    base_model = base_model or _base_model(str(model), loaded)
    license = license or _license_of(str(model))
    evaluation = _read_eval(Path(eval_results).expanduser()) if eval_results is not None else []
    card = render_card(loaded, merged, base_model=base_model, license=license, where=repo_id or out_dir.name,
                       evaluation=[(f.name, body) for f, body in evaluation])
    published = {
        "format": CONFIG_FORMAT,
        "format_version": CONFIG_FORMAT_VERSION,
        "cache_class": "hf_asymkv.AsymKVCache",
        "scales_file": SCALES_FILE,
        "base_model": base_model,
        "hf_asymkv_version": __version__,
        "settings": merged,
    }

    def build(tmp: Path) -> None:
        shutil.copyfile(scales_path, tmp / SCALES_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(published, indent=2) + "\n", encoding="utf-8")
        (tmp / CARD_FILE).write_text(card, encoding="utf-8")
        if evaluation:
            (tmp / EVAL_DIR).mkdir()
            for f, _ in evaluation:
                shutil.copyfile(f, tmp / EVAL_DIR / f.name)
        load_published(tmp, config)  # the folder loads back (also catches a scales file changed meanwhile)

    return write_folder_atomically(out_dir, build, overwrite=overwrite, marker=CONFIG_FILE)


# ------------------------------------------------------------------------------------------------ Hub
def push_to_hub(folder: str | Path, repo_id: str, *, private: bool = False, token: str | None = None,
                commit_message: str = "Upload hf-asymkv KV-cache scales"):
    """Create (if needed) the model repo ``repo_id`` and upload a publish folder to it.

    Returns:
        what ``HfApi.upload_folder`` returns (a ``CommitInfo``).

    Raises:
        ValueError: invalid repo id, or ``folder`` is not a loadable publish folder.
        OSError: the Hub refused or could not be reached (the message names the step and the repo).
    """
    import huggingface_hub
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ValueError(f"invalid Hub repo id {repo_id!r}: {exc}") from None
    folder = Path(folder).expanduser()
    load_published(folder, None)  # never upload something that does not load back
    api = huggingface_hub.HfApi(token=token)
    try:
        api.create_repo(repo_id, exist_ok=True, private=private, repo_type="model")
    except Exception as exc:  # every Hub failure gets the same clear message
        raise OSError(f"could not create or access the Hub model repo {repo_id!r} "
                      f"({type(exc).__name__}: {exc}); nothing was uploaded") from exc
    try:
        return api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                                 commit_message=commit_message)
    except Exception as exc:
        raise OSError(f"uploading {str(folder)!r} to the Hub repo {repo_id!r} failed "
                      f"({type(exc).__name__}: {exc})") from exc


def _resolve(dir_or_repo_id: str | Path, revision: str | None, token: str | None) -> tuple[Path, str]:
    """The local folder holding a publication, downloading it from the Hub when it is not a local folder."""
    path = Path(dir_or_repo_id).expanduser()
    if path.is_dir():
        return path, str(dir_or_repo_id)
    if path.exists():
        raise ValueError(f"{str(dir_or_repo_id)!r} is a file; expected a publish folder (holding {CONFIG_FILE}) "
                         "or a Hub repo id")
    import huggingface_hub
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id = str(dir_or_repo_id)
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ValueError(f"{repo_id!r} is neither an existing folder nor a valid Hub repo id") from None
    try:
        local = huggingface_hub.snapshot_download(repo_id, repo_type="model", revision=revision, token=token,
                                                  allow_patterns=list(HUB_FILES))
    except Exception as exc:
        raise OSError(f"{repo_id!r} is not a local folder, and downloading it from the Hugging Face Hub failed "
                      f"({type(exc).__name__}: {exc})") from exc
    return Path(local), f"Hub repo {repo_id!r}"


def load_published(dir_or_repo_id: str | Path, config, *, revision: str | None = None,
                   token: str | None = None) -> tuple[KVScales, dict]:
    """Read a publish folder (or Hub repo): its validated scales and its recommended settings.

    Args:
        config: the model config the scales must match; None skips that check.
        revision, token: for Hub repos (``snapshot_download``).

    Returns:
        ``(scales, settings)``; ``settings`` are ``AsymKVCache`` keyword arguments.

    Raises:
        ValueError: missing or malformed ``asymkv_config.json`` (bad JSON, unknown format or version, unknown
            setting keys), missing scales file, or scales that do not belong to ``config``.
        OSError: not a local folder and the Hub download failed.
    """
    folder, where = _resolve(dir_or_repo_id, revision, token)
    cfg_path = folder / CONFIG_FILE
    if not cfg_path.is_file():
        raise ValueError(f"{where}: no {CONFIG_FILE} (not an hf-asymkv publish folder; create one with "
                         "`hf-asymkv publish`)")
    try:
        published = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: {CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(published, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} must hold a JSON object, got {type(published).__name__}")
    if published.get("format") != CONFIG_FORMAT:
        raise ValueError(f"{where}: {CONFIG_FILE} format is {published.get('format')!r}, expected {CONFIG_FORMAT!r}")
    version = str(published.get("format_version"))
    if version not in SUPPORTED_CONFIG_VERSIONS:
        raise ValueError(f"{where}: {CONFIG_FILE} format_version {published.get('format_version')!r} is not "
                         f"supported (supported: {list(SUPPORTED_CONFIG_VERSIONS)}); upgrade hf-asymkv")
    settings = _check_settings(published.get("settings", {}), f"{where}: {CONFIG_FILE}")
    name = published.get("scales_file", SCALES_FILE)
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise ValueError(f"{where}: {CONFIG_FILE} scales_file must be a file name in the folder, got {name!r}")
    scales_path = folder / name
    if not scales_path.is_file():
        raise ValueError(f"{where}: the scales file {name!r} named by {CONFIG_FILE} is missing")
    try:
        scales = KVScales.load(scales_path, config)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return scales, settings


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
