"""`layer_shapes`: the one answer to "what does layer i cache", read by the cache, the scales file, calibration
and export; heterogeneous configs (Gemma4) included."""

from __future__ import annotations

import pytest
import transformers
from conftest import hybrid_config, llama_config, shared_kv_config

from hf_asymkv import AsymKVCache
from hf_asymkv.core.compat import DUMMY_LAYER_CLASSES
from hf_asymkv.core.scales import config_fingerprint
from hf_asymkv.core.shapes import LayerShape, kv_layer_indices, layer_shapes

pytestmark = pytest.mark.releases  # depends on transformers' behaviour: CI reruns it on older releases

needs_gemma4 = pytest.mark.skipif(not hasattr(transformers, "Gemma4TextConfig"),
                                  reason=f"Gemma4 is not in transformers {transformers.__version__} (added in 5.13)")


def test_llama_shapes():
    assert layer_shapes(llama_config()) == [LayerShape("full_attention", 2, 16)] * 2
    assert kv_layer_indices(llama_config()) == [0, 1]


def test_hybrid_shapes():
    shapes = layer_shapes(hybrid_config())
    assert [s.layer_type for s in shapes] == ["sliding_attention", "full_attention"] * 2
    assert [s.quantized for s in shapes] == [False, True, False, True] and all(s.holds_kv for s in shapes)


@needs_gemma4
def test_gemma4_per_layer_head_dim_and_shared_layers():
    """Full-attention layers of Gemma4 have their own head_dim (32 here, 16 for sliding layers); the KV-sharing
    layers hold no cache (``dummy``; transformers < 5.23 leaves them out of the cache)."""
    shapes = layer_shapes(shared_kv_config())
    assert [(s.layer_type, s.head_dim) for s in shapes[:2]] == [("sliding_attention", 16), ("full_attention", 32)]
    assert all(s.layer_type == "dummy" and not s.holds_kv for s in shapes[2:])
    assert len(shapes) == (4 if DUMMY_LAYER_CLASSES else 2)
    assert kv_layer_indices(shared_kv_config()) == [0, 1]


def test_fingerprint_of_a_homogeneous_model_keeps_single_numbers():
    """The form every scales file written so far holds (files of homogeneous models keep matching)."""
    fp = config_fingerprint(llama_config())
    assert (fp["num_key_value_heads"], fp["head_dim"]) == (2, 16)


@needs_gemma4
def test_fingerprint_of_gemma4_is_per_layer():
    """It read the global head_dim, which Gemma4 refuses (calibration crashed after its whole pass)."""
    fp = config_fingerprint(shared_kv_config())
    assert fp["head_dim"][:2] == [16, 32] and fp["num_key_value_heads"][:2] == [2, 2]


@needs_gemma4
def test_cache_sizes_its_layers_from_the_shapes():
    cache = AsymKVCache(shared_kv_config())
    shapes = layer_shapes(shared_kv_config())
    assert sorted(cache.layer_configs) == [i for i, s in enumerate(shapes) if s.quantized] == [1]
    assert cache.cache_config.key_group_size == 32  # resolved for the quantized layer's head_dim
