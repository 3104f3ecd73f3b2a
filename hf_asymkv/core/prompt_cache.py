"""Prompt caches on disk: an :class:`~hf_asymkv.AsymKVCache` saved to one safetensors file and loaded back.

Prefill a long document once, save the cache, and answer questions about it later from the file: loading reads the
tensors back into the layers, nothing is recomputed, and the loaded cache continues exactly as the saved one would
(the same tokens under ``generate``, the same ``memory_footprint()``). ``cache.save(path)`` calls
:func:`save_prompt_cache`; ``AsymKVCache.load(path, model.config)`` opens the file with :func:`open_prompt_cache`, builds
the cache its metadata describes and restores it (mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache`` in
``mlx_lm/models/cache.py`` are the model; this module does not import the cache's, which imports it).

**What the file holds.** Each layer as it is stored (:mod:`~hf_asymkv.core.layer_state`): codes, scales, zeros, wide
bits and channels, exact sinks and window, left-padded rows' sink overlays and pending tokens, as live rows (the
capacity each buffer had is recorded, and restored), with the counters the layer needs to continue; static caches
(``max_cache_len``) their filled slots; the layers the cache keeps as transformers' own (sliding windows) their K/V.
So the file's tensor bytes are ``memory_footprint()["total"]`` less its ``unused_capacity`` (a static cache: its
``used`` bytes). ``__metadata__`` (strings): ``format``, ``format_version``, ``hf_asymkv_version``, ``cache_config``
(the :class:`~hf_asymkv.AsymKVConfig` dict form, versioned), ``fingerprint`` (the model's, as scales files carry it:
:func:`~hf_asymkv.core.scales.config_fingerprint`), ``max_cache_len``, ``batch_size``, ``tokens``,
``token_ids_sha256`` (empty when the ids were not given), ``layers`` (one JSON record per layer) and ``user``
(the caller's own strings).

**Saving settles the cache first.** An update a kvpress hook still holds exact is quantized, as the next update would
do (:meth:`~hf_asymkv.AsymKVCache.settle`), and a transformers sliding-window layer whose window is a view into the
buffer of a long prefill keeps a copy of the window instead (the same values; the rest of that buffer is freed). The
saved cache and the one in memory are then the same, byte for byte. The write is atomic: a failed save leaves
nothing at ``path`` (an earlier file there stays as it was).

**Loading refuses**, with a ``ValueError`` naming the problem, a file that is not safetensors (truncated or foreign),
not a prompt cache, of another format version, of another model (fingerprint), whose settings differ from the
``cache_config`` the caller expects, whose token ids differ from the ``input_ids`` the caller continues, or whose
tensors are missing, unexpected, of the wrong shape or dtype, or of lengths that do not add up. The tensor bytes
themselves are not checksummed: an edited code byte within a well-formed file loads as written. The header is read
with ``safe_open`` (it checks the file's size against it) and each tensor's bytes once, into the cache's own memory
(:class:`_FileTensors`), after its shape and dtype are checked: a loaded cache does not depend on the file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..version import __version__
from .config import AsymKVConfig
from .fileio import atomic_write
from .layer_state import layer_state, restore_layer
from .scales import config_fingerprint, save_file
from .shapes import layer_shapes

__all__ = ["FORMAT", "FORMAT_VERSION", "SUPPORTED_FORMAT_VERSIONS", "PromptCacheFile", "open_prompt_cache",
           "read_prompt_cache_metadata", "save_prompt_cache", "token_ids_hash"]

FORMAT = "hf_asymkv.prompt_cache"
"""``format`` metadata of a prompt-cache file."""
FORMAT_VERSION = "1"
SUPPORTED_FORMAT_VERSIONS = ("1",)
"""``format_version`` values :func:`open_prompt_cache` reads."""
_REQUIRED = ("format", "format_version", "hf_asymkv_version", "cache_config", "fingerprint", "max_cache_len",
             "batch_size", "tokens", "token_ids_sha256", "layers", "user")
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I8": "int8", "U8": "uint8",
                       "I32": "int32", "I64": "int64", "BOOL": "bool"}


def token_ids_hash(input_ids: torch.Tensor, tokens: int) -> str:
    """SHA-256 (hex) of the first ``tokens`` ids of every row of ``input_ids`` (``[B, T]`` or ``[T]``, ``T >= tokens``),
    as int64, with the shape: what a file records and a load compares.

    Raises:
        ValueError: not an integer tensor, or fewer than ``tokens`` ids per row.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.dim() not in (1, 2):
        raise ValueError(f"input_ids must be a [batch, tokens] (or [tokens]) integer tensor, got {_describe(input_ids)}")
    ids = input_ids.reshape(1, -1) if input_ids.dim() == 1 else input_ids
    if ids.shape[1] < tokens:
        raise ValueError(f"input_ids hold {ids.shape[1]} tokens per row, the cache {tokens}: they cannot be the ids it "
                         "holds")
    ids = ids[:, :tokens].to("cpu", torch.int64).contiguous()
    return hashlib.sha256(f"{ids.shape[0]}x{tokens}:".encode() + ids.numpy().tobytes()).hexdigest()


def _describe(x) -> str:
    return f"a {x.dim()}-d {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__


def _held_tokens(cache) -> int:
    return max((int(layer.get_seq_length()) for layer in cache.layers
                if getattr(layer, "is_initialized", False) and hasattr(layer, "get_seq_length")), default=0)


def _batch_size(tensors: dict[str, torch.Tensor]) -> int:
    sizes = {t.shape[0] for name, t in tensors.items() if t.dim() and not name.endswith("key_absmax")}
    if len(sizes) > 1:
        raise ValueError(f"the cache's layers hold batches of different sizes {sorted(sizes)}")
    return sizes.pop() if sizes else 0


def _owned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor as one that owns its storage, alone: safetensors writes contiguous tensors and refuses shared storage
    (a live view into a buffer with capacity; the anchors a layer's two stores share)."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach()
        storage = t.untyped_storage()
        whole = t.is_contiguous() and t.storage_offset() == 0 and storage.nbytes() == t.nbytes
        out[name] = t if whole and storage.data_ptr() not in seen else t.clone(memory_format=torch.contiguous_format)
        seen.add(storage.data_ptr())
    return out


def _compact_transformers_layers(cache) -> None:
    """A transformers sliding-window layer keeps its window as a view into the last update's K/V (a whole prefill after
    one): give it a copy of its own, so that memory holds what the file holds (the same values)."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = vars(layer).get(name)
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > t.nbytes and t.dim() == 4:
                setattr(layer, name, t.clone(memory_format=torch.contiguous_format))


def save_prompt_cache(cache, path: str | Path, *, input_ids: torch.Tensor | None = None,
                      metadata: dict[str, str] | None = None) -> Path:
    """Write ``cache`` to ``path`` (one safetensors file, atomically) after settling it (see the module docstring).

    Args:
        cache: the :class:`~hf_asymkv.AsymKVCache` to save (any batch size, dynamic or static).
        input_ids: the ids the cache holds, ``[batch, tokens]``: their hash is recorded, and a load given the ids it
            continues checks them against it. Optional; without it a load cannot check them.
        metadata: strings of your own (model id, source document), returned by :func:`read_prompt_cache_metadata`.

    Returns:
        ``path``.

    Raises:
        ValueError: ``input_ids`` that are not the cache's length or batch, non-string ``metadata``, or a layer holding
            state the format does not carry (recurrent states of linear-attention layers).
        OSError: ``path`` cannot be written (the message names it); nothing is left there.
    """
    if not hasattr(cache, "cache_config"):
        raise ValueError(f"save_prompt_cache saves an AsymKVCache, got {type(cache).__name__}")
    user = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in user.items()):
        raise ValueError(f"metadata must map strings to strings, got {user!r}")
    cache.settle()
    _compact_transformers_layers(cache)
    records, tensors = [], {}
    for i, layer in enumerate(cache.layers):
        try:
            record, named = layer_state(layer, f"layers.{i}")
        except ValueError as exc:
            raise ValueError(f"layer {i}: {exc}") from None
        records.append(record)
        tensors.update(named)
    tokens, batch = _held_tokens(cache), _batch_size(tensors)
    digest = ""
    if input_ids is not None:
        digest = token_ids_hash(input_ids, tokens)
        rows = 1 if input_ids.dim() == 1 else input_ids.shape[0]
        if input_ids.shape[-1] != tokens or rows != batch:
            raise ValueError(f"input_ids are [{rows}, {input_ids.shape[-1]}], the cache holds [{batch}, {tokens}] "
                             "(batch, tokens): pass the ids the cache holds")
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "hf_asymkv_version": __version__,
            "cache_config": json.dumps(cache.cache_config.to_dict(), sort_keys=True),
            "fingerprint": json.dumps(config_fingerprint(cache.model_config), sort_keys=True),
            "max_cache_len": str(cache.max_cache_len or ""), "batch_size": str(batch), "tokens": str(tokens),
            "token_ids_sha256": digest, "layers": json.dumps(records), "user": json.dumps(user)}
    owned = _owned(tensors)
    return atomic_write(path, lambda tmp: save_file(owned, tmp, metadata=meta))


class _FileTensors:
    """The tensors of an open prompt-cache file, each checked (shape, dtype: from the header, before its bytes are
    read) and read once; :meth:`check_all_read` then refuses any the layers did not ask for.

    The bytes are read from ``stream`` into memory of the cache's own (a plain read per tensor, at the offsets of the
    header that ``safe_open`` has validated), not taken as safetensors' views of a private mapping of the file: those
    are read lazily, so a file rewritten in place afterwards (``cp`` over it) would change, or fault, a cache loaded
    from it. Loaded, the cache no longer depends on the file, and the load reads the file once, no more."""

    def __init__(self, handle, stream, device: torch.device):
        self.handle, self.stream, self.device = handle, stream, device
        self.names = set(handle.keys())
        self.read_names: set[str] = set()
        stream.seek(0)
        size = int.from_bytes(stream.read(8), "little")
        header = json.loads(stream.read(size))
        self.spans = {name: (8 + size + header[name]["data_offsets"][0], 8 + size + header[name]["data_offsets"][1])
                      for name in self.names}

    def read(self, name: str, shape: tuple[int | None, ...], dtype: torch.dtype) -> torch.Tensor:
        if name not in self.names:
            raise ValueError(f"tensor {name!r} is missing")
        found = self.handle.get_slice(name)
        found_shape, found_dtype = tuple(found.get_shape()), _SAFETENSORS_DTYPES.get(found.get_dtype())
        wanted = str(dtype).removeprefix("torch.")
        fits = len(found_shape) == len(shape) and all(s is None or s == f for s, f in zip(shape, found_shape))
        if not fits or found_dtype != wanted:
            shown = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"tensor {name!r} is {found_dtype or found.get_dtype()} {list(found_shape)}, expected "
                             f"{wanted} {list(shown)}")
        self.read_names.add(name)
        out = torch.empty(found_shape, dtype=dtype)
        start, end = self.spans[name]
        if end > start:
            self.stream.seek(start)
            if self.stream.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy())) != end - start:
                raise ValueError(f"tensor {name!r} is cut short (the file changed while it was read?)")
        return out if self.device.type == "cpu" else out.to(self.device)

    def check_all_read(self) -> None:
        unexpected = sorted(self.names - self.read_names)
        if unexpected:
            raise ValueError(f"unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} "
                             "(not named by the layers' records)")


@contextmanager
def _open(path: Path):
    """``(safe_open handle, binary file)`` on ``path``; ``ValueError`` for a file safetensors cannot read (the header is
    checked against the file's size there: a truncated file fails here)."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt-cache file {str(path)!r} does not exist")
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{path}: not a readable safetensors file (truncated or foreign?): {exc}") from None
    with handle as f, open(path, "rb") as stream:
        yield f, stream


def _json(meta: dict, key: str, kind: type):
    try:
        value = json.loads(meta[key])
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, kind):
        raise ValueError(f"metadata {key!r} is not a JSON {kind.__name__}: {meta[key][:80]!r}")
    return value


def _count(meta: dict, key: str, low: int) -> int:
    text = meta[key]
    if not text.isdigit() or int(text) < low:
        raise ValueError(f"metadata {key!r} must be an integer >= {low}, got {text!r}")
    return int(text)


def _checked_metadata(meta: dict | None) -> dict:
    """The file's metadata with its JSON and integer fields parsed; ``ValueError`` for anything but a prompt-cache
    file of a supported version."""
    meta = dict(meta or {})
    missing = [k for k in _REQUIRED if k not in meta]
    if meta.get("format") not in (None, FORMAT):
        raise ValueError(f"format is {meta['format']!r}, expected {FORMAT!r} (not a prompt-cache file)")
    if missing:
        raise ValueError(f"not an hf_asymkv prompt-cache file: metadata lacks {missing}")
    if meta["format_version"] not in SUPPORTED_FORMAT_VERSIONS:
        raise ValueError(f"format_version {meta['format_version']!r} is not supported (supported: "
                         f"{list(SUPPORTED_FORMAT_VERSIONS)}; written by hf-asymkv {meta['hf_asymkv_version']}): "
                         "upgrade hf-asymkv, or prefill the document again")
    parsed = {**meta, "cache_config": _json(meta, "cache_config", dict), "fingerprint": _json(meta, "fingerprint", dict),
              "layers": _json(meta, "layers", list), "user": _json(meta, "user", dict),
              "tokens": _count(meta, "tokens", 0), "batch_size": _count(meta, "batch_size", 0),
              "max_cache_len": _count(meta, "max_cache_len", 1) if meta["max_cache_len"] else None}
    if not all(isinstance(r, dict) for r in parsed["layers"]):
        raise ValueError("metadata 'layers' must be a list of JSON objects")
    return parsed


def read_prompt_cache_metadata(path: str | Path) -> dict:
    """The metadata of a prompt-cache file without reading its tensors (``cache_config``, ``fingerprint``, ``layers`` and
    ``user`` parsed from JSON; ``tokens``, ``batch_size`` and ``max_cache_len`` as ints or None).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a readable prompt-cache file of a supported version (the message names the file).
    """
    path = Path(path)
    with _open(path) as (f, _):
        try:
            return _checked_metadata(f.metadata())
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None


def _check_model(saved: dict, config) -> None:
    expected = config_fingerprint(config)
    differ = [k for k in sorted(set(saved) | set(expected)) if saved.get(k) != expected.get(k)]
    if differ:
        k = differ[0]
        raise ValueError(f"saved for another model: the fingerprint differs on {differ} ({k!r} is {saved.get(k)!r} in "
                         f"the file, {expected.get(k)!r} for this model)")


def _check_settings(saved: AsymKVConfig, expected: AsymKVConfig | None) -> None:
    """The file's settings against those the caller expects; a group size left to None in ``expected`` is whatever the
    model resolved it to."""
    if expected is None:
        return
    if not isinstance(expected, AsymKVConfig):
        raise ValueError(f"cache_config must be an AsymKVConfig (or None), got {type(expected).__name__}")
    theirs = saved.settings()
    differ = [f"{k}={theirs[k]!r} in the file, {v!r} expected" for k, v in expected.settings().items()
              if v is not None and theirs[k] != v]
    if differ:
        raise ValueError(f"the file's settings are not the expected cache_config: {'; '.join(differ)}")


def _check_token_ids(meta: dict, input_ids: torch.Tensor | None) -> None:
    if input_ids is None:
        return
    if not meta["token_ids_sha256"]:
        raise ValueError("the file was saved without input_ids, so the ids it continues cannot be checked (save with "
                         "input_ids=..., or load without them)")
    rows = 1 if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1 else len(input_ids)
    if rows != meta["batch_size"]:
        raise ValueError(f"input_ids have {rows} rows, the file holds a batch of {meta['batch_size']}")
    if token_ids_hash(input_ids, meta["tokens"]) != meta["token_ids_sha256"]:
        raise ValueError(f"input_ids do not continue this prompt cache: the hash of their first {meta['tokens']} "
                         "tokens differs from the file's (another document, prompt or tokenizer?)")


class PromptCacheFile:
    """An open prompt-cache file whose metadata :func:`open_prompt_cache` has checked: what a cache for it is built
    with (``cache_config``, ``max_cache_len``, ``key_absmax``), and :meth:`restore` to fill that cache.

    Attributes:
        cache_config: the saved :class:`~hf_asymkv.AsymKVConfig` (resolved for the model).
        max_cache_len: the static cache's length, or None (dynamic).
        key_absmax: ``{layer: Tensor[kv_heads, head_dim]}`` calibrated key ranges the saved layers scaled blocks by.
        metadata: the parsed metadata (see :func:`read_prompt_cache_metadata`).
    """

    def __init__(self, handle, stream, meta: dict, config, device: torch.device):
        self.metadata, self.device = meta, device
        self.cache_config = AsymKVConfig.from_dict(meta["cache_config"], where="metadata 'cache_config'")
        self.max_cache_len = meta["max_cache_len"]
        self.tensors, self.shapes = _FileTensors(handle, stream, device), layer_shapes(config)
        records = meta["layers"]
        if len(records) > len(self.shapes):
            raise ValueError(f"the file holds {len(records)} layers, the model {len(self.shapes)}")
        self.key_absmax = {i: self.tensors.read(f"layers.{i}.key_absmax", (self.shapes[i].kv_heads,
                                                                          self.shapes[i].head_dim), torch.float32)
                           for i, record in enumerate(records) if record.get("key_absmax") is True} or None

    def restore(self, cache) -> None:
        """Write every saved layer into ``cache``, an :class:`~hf_asymkv.AsymKVCache` just built for this model with
        :attr:`cache_config`, :attr:`max_cache_len` and :attr:`key_absmax`; ``ValueError`` where the file does not fit
        it."""
        records, meta = self.metadata["layers"], self.metadata
        if len(records) != len(cache.layers):
            raise ValueError(f"the file holds {len(records)} layers, the model's cache {len(cache.layers)}")
        for i, (layer, record) in enumerate(zip(cache.layers, records)):
            try:
                restore_layer(layer, record, f"layers.{i}", self.tensors, self.shapes[i], meta["batch_size"],
                              self.device)
            except ValueError as exc:
                raise ValueError(f"layer {i}: {exc}") from None
        self.tensors.check_all_read()
        held = _held_tokens(cache)
        if held != meta["tokens"]:
            raise ValueError(f"the layers hold {held} tokens, the metadata says {meta['tokens']}")
        cache.reuse_watch.rewound(held)  # a loaded prefix is continued on purpose: not a new prompt on a used cache


@contextmanager
def open_prompt_cache(path: str | Path, config, *, input_ids: torch.Tensor | None = None,
                      cache_config: AsymKVConfig | None = None, device: str | torch.device = "cpu"
                      ) -> Iterator[PromptCacheFile]:
    """Open ``path`` for the model of ``config`` and check everything its metadata decides (what
    :meth:`AsymKVCache.load <hf_asymkv.AsymKVCache.load>` builds and restores a cache from).

    Args:
        path: a file written by :func:`save_prompt_cache` (``cache.save``).
        config: the model config (``model.config``); the file must be of that model (fingerprint).
        input_ids: the ids the loaded cache is continued with, ``[batch, T]`` (the saved prompt followed by the new
            tokens, ``T >= tokens``: what ``generate`` is given): their first ``tokens`` ids must be the saved ones.
        cache_config: the settings you expect (e.g. ``hf_asymkv.PRESETS["balanced"]``); the file's must equal them.
        device: where the tensors go (the model's device).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is refused, here or inside the ``with`` block (see the module docstring); the message
            names the file and the problem.
    """
    path, device = Path(path), torch.device(device)
    with _open(path) as (handle, stream):
        try:
            meta = _checked_metadata(handle.metadata())
            _check_model(meta["fingerprint"], config)
            opened = PromptCacheFile(handle, stream, meta, config, device)
            _check_settings(opened.cache_config, cache_config)
            _check_token_ids(meta, input_ids)
            yield opened
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
