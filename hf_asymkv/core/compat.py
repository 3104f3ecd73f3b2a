"""Every difference between the transformers releases hf_asymkv supports (``>=5.0,<6``), in one place.

Nothing else in the package (nor in its scripts, evaluations and tests) compares transformers versions: it
asks this module. Each shim names the releases it serves and why, so that raising the floor later means
deleting the shims whose range fell below it.

- :func:`cache_kwargs`: the keyword ``generate()`` and ``forward()`` take the cache under (``cache=`` from 5.24,
  ``past_key_values=`` before; each spelling is wrong on the other side, see :data:`CACHE_KWARG`).
- :class:`LayerAPICompat`: layer-API names older releases call (``get_max_cache_shape`` below 5.13).
- :func:`mask_query_length`: the argument of ``get_mask_sizes`` (``cache_position`` below 5.4).
- :func:`crop_tokens_to_remove`: the argument of ``crop`` ("length to keep" below 5.14, a 0-d tensor in 5.14-5.17).
- :func:`cache_layer_types`: per-layer cache types (``get_layer_types_and_kwargs`` exists from 5.14).
- :data:`DYNAMIC_CACHE_RESET_EMPTIES`, :func:`reset_layer`: transformers' ``DynamicCache.reset()`` empties its
  layers from 5.18 only; ``reset_layer`` empties them on every release.
- :data:`DUMMY_LAYER_CLASSES`: transformers' placeholder layer for KV-less layers (from 5.23).
- :data:`GENERATE_RECORDS_PAST`: whether ``generate`` calls ``activate_past_recording`` before assisted
  decoding (from 5.14), which makes deep rollbacks exact; from 5.25 it passes ``recurrent_states_to_keep=``, which
  our layers accept and ignore (it concerns recurrent layers).
- :func:`update_position_ids`: the ``position_ids`` of the tokens of a cache update (passed from 5.24 only), which
  anchor a left-padded row's sinks at its first real token (:data:`UPDATE_GETS_POSITION_IDS`).
"""

from __future__ import annotations

import torch
import transformers
from packaging.version import Version

__all__ = [
    "CACHE_KWARG",
    "CROP_TAKES_LENGTH_TO_KEEP",
    "DYNAMIC_CACHE_RESET_EMPTIES",
    "DUMMY_LAYER_CLASSES",
    "GENERATE_RECORDS_PAST",
    "TRANSFORMERS_VERSION",
    "UPDATE_GETS_POSITION_IDS",
    "LayerAPICompat",
    "cache_kwargs",
    "cache_layer_types",
    "crop_tokens_to_remove",
    "mask_query_length",
    "reset_layer",
    "transformers_at_least",
    "update_position_ids",
]

TRANSFORMERS_VERSION: tuple[int, int] = Version(transformers.__version__).release[:2]
"""``(major, minor)`` of the installed transformers."""


def transformers_at_least(major: int, minor: int) -> bool:
    """Whether the installed transformers is ``major.minor`` or newer (pre-releases count as their release)."""
    return TRANSFORMERS_VERSION >= (major, minor)


# 5.24 renamed the cache argument of generate() and of every model's forward() to `cache`. Before 5.24 generate()
# has no `cache` argument and forward() swallows `cache=` into **kwargs and silently runs without any cache; from
# 5.24 `past_key_values=` still works but raises a FutureWarning (removal announced for 5.40 in forward, 6.0 in
# generate). So the name must follow the installed release, in both directions.
CACHE_KWARG: str = "cache" if transformers_at_least(5, 24) else "past_key_values"
"""The keyword ``generate()`` and ``model(...)`` take a cache under on the installed transformers."""

# 5.14 made generate() call `cache.activate_past_recording()` before assisted decoding (and, in 5.15+, on the
# caches it may roll back); below 5.14 nothing announces a rollback, so a crop deeper than the exact window
# returns dequantized tokens to the window (counted in stats()["requantized_tokens"]).
GENERATE_RECORDS_PAST: bool = transformers_at_least(5, 14)


def cache_kwargs(cache) -> dict:
    """``{CACHE_KWARG: cache}``: pass a cache to ``generate`` or ``forward`` on any supported release.

    Example::

        out = model.generate(**inputs, **cache_kwargs(AsymKVCache(model.config)), max_new_tokens=64)
    """
    return {CACHE_KWARG: cache}


class LayerAPICompat:
    """Mixin for our cache layers (listed before ``CacheLayerMixin``): the layer methods older releases call.

    ``get_max_cache_shape``: transformers < 5.13 declares it abstract (and calls it) under this name; 5.13
    renamed it ``get_max_length`` and kept the old name as a deprecated alias, so defining it on every release is
    harmless.
    """

    def get_max_cache_shape(self) -> int:
        return self.get_max_length()


def mask_query_length(query_length_or_positions: int | torch.Tensor) -> int:
    """The query length ``get_mask_sizes`` is asked about.

    transformers < 5.4 passes ``cache_position`` (``[q_len]`` positions of the new tokens) instead of ``q_len``.
    """
    if isinstance(query_length_or_positions, torch.Tensor):
        return int(query_length_or_positions.shape[0])
    return int(query_length_or_positions)


# Below 5.14 transformers' layers read a positive crop argument as the length to keep (generate() rolls back with
# `crop(new_length - 1)`); 5.14 switched every caller to a negative count of tokens to remove, and from 5.17 layers
# refuse a positive argument.
CROP_TAKES_LENGTH_TO_KEEP: bool = not transformers_at_least(5, 14)


def crop_tokens_to_remove(argument: int | torch.Tensor, seq_length: int) -> int:
    """The argument of ``Cache.crop`` as a number of tokens to remove (``<= 0``; positive means a bad call).

    - transformers < 5.14 (:data:`CROP_TAKES_LENGTH_TO_KEEP`): ``crop(max_length)``, a positive length to keep
      (``generate`` passes ``new_len - 1``), or a negative number of tokens to remove; 0 keeps everything here
      (no transformers caller asks for an empty cache that way);
    - 5.14-5.17: ``crop(-n)``, ``n`` sometimes a 0-d tensor (assisted decoding's rejected-draft count);
    - 5.18 and newer: ``crop(tokens_to_remove)`` with a plain ``int <= 0``.

    Args:
        argument: what transformers passed to ``crop``.
        seq_length: the layer's current length (for the "length to keep" form).
    """
    n = int(argument)
    if n > 0 and CROP_TAKES_LENGTH_TO_KEEP:
        return min(0, n - seq_length)
    return n


# DynamicCache.reset() before 5.18 zeroes its layers' tensors but keeps their length, so a reset DynamicCache
# cannot be reused (generate() fails on it); from 5.18 it empties them. AsymKVCache.reset() empties on every release.
DYNAMIC_CACHE_RESET_EMPTIES: bool = transformers_at_least(5, 18)


def reset_layer(layer) -> None:
    """``layer.reset()``, leaving transformers' dynamic layers (the sliding windows AsymKVCache keeps) empty.

    Below 5.18 (:data:`DYNAMIC_CACHE_RESET_EMPTIES`) ``DynamicLayer.reset`` only zeroes its tensors, so the layer
    still reports the old length and the next ``generate`` fails on a mask of the wrong size; here the layer is
    then emptied as 5.18's ``DynamicLayer.reset`` does (tensors dropped, not initialized, length 0).
    """
    layer.reset()
    if DYNAMIC_CACHE_RESET_EMPTIES:
        return
    from transformers.cache_utils import DynamicLayer

    if isinstance(layer, DynamicLayer):
        layer.keys = layer.values = None
        layer.is_initialized = False
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = 0


def cache_layer_types(config) -> list[str]:
    """Per-layer cache types of a (text) config, as transformers' own ``DynamicCache`` sees them.

    5.14 and newer: ``get_layer_types_and_kwargs`` (the resolution ``DynamicCache`` itself uses; KV-sharing and
    KV-less layers come back as ``"dummy"`` from 5.23). Below 5.14 that function does not exist, so the types
    are read off the layers ``DynamicCache(config=...)`` builds: ``"sliding_attention"`` for its sliding-window
    layers, ``"full_attention"`` for plain dynamic layers, the layer's class name for anything else (kept as
    transformers built it). KV-sharing consumer layers get no layer at all there, hence a shorter list.
    """
    if transformers_at_least(5, 14):
        from transformers.cache_utils import get_layer_types_and_kwargs

        return list(get_layer_types_and_kwargs(config)[0])
    types = getattr(config, "layer_types", None)
    if types is None:
        from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

        types = ["sliding_attention" if isinstance(layer, DynamicSlidingWindowLayer) else "full_attention"
                 for layer in DynamicCache(config=config).layers]
    shared = getattr(config, "num_kv_shared_layers", None)
    return list(types[:-shared] if shared else types)


def _dummy_layer_classes() -> tuple[type, ...]:
    # `DummyLayer` (the placeholder DynamicCache builds for KV-sharing and KV-less layers) exists from 5.23; older
    # releases build no layer object for them.
    from transformers import cache_utils

    return (cache_utils.DummyLayer,) if hasattr(cache_utils, "DummyLayer") else ()


DUMMY_LAYER_CLASSES: tuple[type, ...] = _dummy_layer_classes()
"""``(DummyLayer,)`` on transformers 5.23+, ``()`` before."""


# From 5.24 the attention modules call `cache.update(key, value, layer_idx, kwargs=kwargs)`: the layer receives the
# attention kwargs, `position_ids` among them (generate gives a left-padded row's first real token position 0).
# 5.0-5.23 pass `cache_kwargs` (5.0: sin, cos, cache_position, one for all rows) or nothing: no row's positions.
UPDATE_GETS_POSITION_IDS: bool = transformers_at_least(5, 24)


def update_position_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The ``[B, n]`` (or ``[1, n]``, or multimodal ``[3, B, n]``) ``position_ids`` of a layer update's tokens, as
    transformers 5.24+ passes them (``kwargs={"position_ids": ..., ...}``); None before 5.24 or when the model
    passes none."""
    inner = kwargs.get("kwargs")
    positions = inner.get("position_ids") if isinstance(inner, dict) else None
    return positions if isinstance(positions, torch.Tensor) else None
