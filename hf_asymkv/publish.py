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
import shutil
from pathlib import Path

from .fileio import check_out_dir, write_folder_atomically
from .model_card import EVAL_DIR, _read_eval, render_card
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
    check_out_dir(out_dir, overwrite, CONFIG_FILE)  # fail before loading anything
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
