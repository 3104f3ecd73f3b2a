"""Publishing calibrated scales: a folder (or Hub repo) with the scales, the recommended cache settings and a
model card. :func:`hf_asymkv.core.pretrained.load_published` reads it back (``AsymKVCache.from_pretrained``).

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

import json
import shutil
from pathlib import Path

from ..core.config import AsymKVConfig
from ..core.fileio import check_out_dir, write_folder_atomically
from ..core.presets import preset_config
from ..core.pretrained import CARD_FILE, CONFIG_FILE, CONFIG_FORMAT, CONFIG_FORMAT_VERSION, SCALES_FILE, load_published
from ..core.scales import KVScales
from ..models import DEFAULT_MODEL, load_config
from .model_card import EVAL_DIR, read_eval, render_card

__all__ = ["DEFAULT_CONFIG", "publish", "push_to_hub", "render_card"]

DEFAULT_CONFIG = AsymKVConfig()
"""Recommended ``AsymKVCache`` settings written by :func:`publish` unless overridden."""

# Hub id and license of the model behind the DEFAULT_MODEL alias (its GGUF file carries no Hub id).
_DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_DEFAULT_MODEL_LICENSE = "apache-2.0"


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

    for candidate in (model, scales.metadata.get("model_id")):
        if candidate == DEFAULT_MODEL:
            return _DEFAULT_MODEL_HUB_ID
        if _looks_like_hub_id(candidate):
            return candidate
    return None


def _license_of(model: str) -> str | None:
    """License of the base model when it is known: the alias's, or a local folder's model card front matter."""

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


# ------------------------------------------------------------------------------------------------ publish
def publish(model: str, scales: str | Path, out_dir: str | Path, *, eval_results: str | Path | None = None,
            settings: dict | None = None, preset: str | None = None, overwrite: bool = False,
            base_model: str | None = None, license: str | None = None, repo_id: str | None = None) -> Path:
    """Write a publish folder: the scales, the recommended cache settings and a model card.

    Args:
        model: the model the scales were calibrated for (``DEFAULT_MODEL``, Hub id, local folder, ``.gguf``);
            only its config is loaded.
        scales: the ``kv_scales.safetensors`` file; validated against the model's config.
        out_dir: the folder to create; a non-empty existing folder is refused unless ``overwrite`` (and then
            only one this tool wrote).
        eval_results: a folder of ``.md`` / ``.json`` result files (or one such file), quoted verbatim.
        settings: ``AsymKVConfig`` settings that override ``preset`` (or :data:`DEFAULT_CONFIG`).
        preset: a name of ``hf_asymkv.PRESETS`` to start from instead of :data:`DEFAULT_CONFIG`.
        base_model: the base model's Hub id for the card (default: inferred when ``model`` is one).
        license: the base model's license for the card front matter (default: inferred when known).
        repo_id: the Hub repo the folder will be pushed to (used in the card's usage snippet).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: scales for another model, unknown or invalid settings, an unknown preset, bad eval results,
            non-empty output.
    """
    from ..core.cache import AsymKVCache
    from ..version import __version__

    out_dir = Path(out_dir).expanduser()
    check_out_dir(out_dir, overwrite, CONFIG_FILE)  # fail before loading anything
    scales_path = Path(scales).expanduser()
    config = load_config(model)
    loaded = KVScales.load(scales_path, config)
    base = DEFAULT_CONFIG if preset is None else preset_config(preset)
    cache_config = AsymKVConfig.from_dict({**base.to_dict(), **(settings or {})}, "settings")
    try:
        AsymKVCache(config, cache_config, scales=loaded)  # the settings must build a cache for this model
    except ValueError as exc:
        raise ValueError(f"settings {cache_config.settings()} do not build an AsymKVCache for {model!r}: {exc}") from None
    base_model = base_model or _base_model(str(model), loaded)
    license = license or _license_of(str(model))
    evaluation = read_eval(Path(eval_results).expanduser()) if eval_results is not None else []
    card = render_card(loaded, cache_config, base_model=base_model, license=license, where=repo_id or out_dir.name,
                       evaluation=[(f.name, body) for f, body in evaluation])
    published = {
        "format": CONFIG_FORMAT,
        "format_version": CONFIG_FORMAT_VERSION,
        "cache_class": "hf_asymkv.AsymKVCache",
        "scales_file": SCALES_FILE,
        "base_model": base_model,
        "hf_asymkv_version": __version__,
        "settings": cache_config.to_dict(),
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
