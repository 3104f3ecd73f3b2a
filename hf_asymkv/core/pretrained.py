"""Reading a published folder (or Hub repo) back: what ``AsymKVCache.from_pretrained`` needs, nothing more.

A publish folder (written by ``hf-asymkv publish``, :mod:`hf_asymkv.hub.publish`) holds:

- ``kv_scales.safetensors`` (:data:`SCALES_FILE`): the calibrated scales file (:class:`~hf_asymkv.core.scales.KVScales`,
  format ``hf_asymkv.kv_scales``; not the vLLM scale file of ``hf-asymkv export-vllm``);
- ``asymkv_config.json``: ``format``, ``format_version``, the recommended cache ``settings`` (the dict form of
  :class:`~hf_asymkv.core.config.AsymKVConfig`), the ``scales_file`` name, ``base_model`` and the
  ``hf_asymkv_version`` that wrote it;
- ``README.md``: the model card.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import AsymKVConfig
from .scales import KVScales

__all__ = [
    "CARD_FILE",
    "CONFIG_FILE",
    "CONFIG_FORMAT",
    "CONFIG_FORMAT_VERSION",
    "HUB_FILES",
    "SCALES_FILE",
    "SUPPORTED_CONFIG_FORMAT_VERSIONS",
    "load_published",
]

SCALES_FILE = "kv_scales.safetensors"
CONFIG_FILE = "asymkv_config.json"
CARD_FILE = "README.md"
CONFIG_FORMAT = "hf_asymkv.published"
CONFIG_FORMAT_VERSION = "1"
SUPPORTED_CONFIG_FORMAT_VERSIONS = ("1",)
"""``format_version`` values of ``asymkv_config.json`` that :func:`load_published` reads (the versions of the
settings inside it are :data:`hf_asymkv.core.config.SUPPORTED_CONFIG_VERSIONS`)."""
HUB_FILES = [SCALES_FILE, CONFIG_FILE, CARD_FILE]
"""What :func:`load_published` downloads from a Hub repo (``allow_patterns``)."""


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
                   token: str | None = None) -> tuple[KVScales, AsymKVConfig]:
    """Read a publish folder (or Hub repo): its validated scales and its recommended cache config.

    Args:
        config: the model config the scales must match; None skips that check.
        revision, token: for Hub repos (``snapshot_download``).

    Returns:
        ``(scales, cache_config)``.

    Raises:
        ValueError: missing or malformed ``asymkv_config.json`` (bad JSON, unknown format or version, unknown
            or invalid settings), missing scales file, or scales that do not belong to ``config``.
        OSError: not a local folder and the Hub download failed.
    """
    folder, where = _resolve(dir_or_repo_id, revision, token)
    cfg_path = folder / CONFIG_FILE
    if not cfg_path.is_file():
        raise ValueError(f"{where}: no {CONFIG_FILE} (not an hf-asymkv publish folder; create one with "
                         "`hf-asymkv publish`)")
    try:
        published = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # (nesting deeper than Python's stack)
        raise ValueError(f"{where}: {CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(published, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} must hold a JSON object, got {type(published).__name__}")
    if published.get("format") != CONFIG_FORMAT:
        raise ValueError(f"{where}: {CONFIG_FILE} format is {published.get('format')!r}, expected {CONFIG_FORMAT!r}")
    version = str(published.get("format_version"))
    if version not in SUPPORTED_CONFIG_FORMAT_VERSIONS:
        raise ValueError(f"{where}: {CONFIG_FILE} format_version {published.get('format_version')!r} is not "
                         f"supported (supported: {list(SUPPORTED_CONFIG_FORMAT_VERSIONS)}); upgrade hf-asymkv")
    cache_config = AsymKVConfig.from_dict(published.get("settings", {}), f"{where}: {CONFIG_FILE} settings")
    name = published.get("scales_file", SCALES_FILE)
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise ValueError(f"{where}: {CONFIG_FILE} scales_file must be a file name in the folder, got {name!r}")
    scales_path = folder / name
    try:
        present = scales_path.is_file()
    except OSError as exc:  # a name the file system refuses (longer than it allows, ...)
        raise ValueError(f"{where}: {CONFIG_FILE} scales_file {name[:80]!r} cannot name a file: {exc.strerror}") from None
    if not present:
        raise ValueError(f"{where}: the scales file {name!r} named by {CONFIG_FILE} is missing")
    try:
        scales = KVScales.load(scales_path, config)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return scales, cache_config
