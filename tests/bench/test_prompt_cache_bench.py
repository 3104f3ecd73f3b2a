"""hf_asymkv.bench.prompt_cache: the baselines the command compares against, and the load measured in a fresh
process."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import DynamicCache

from hf_asymkv import AsymKVCache, cache_kwargs
from hf_asymkv.bench.prompt_cache import (
    _load_in_this_process,
    bf16_dynamic_cache_bytes,
    measure_load_rss,
    mlx_bytes_per_element,
)


@pytest.mark.parametrize("arch, settings", [("llama", {}), ("hybrid", {}), ("hybrid", {"quantize_sliding": True})],
                         ids=["llama", "hybrid", "hybrid-quantized-sliding"])
def test_bf16_dynamic_cache_bytes_are_a_real_dynamic_caches_file(request, arch, settings, prompt, tmp_path,
                                                                 single_thread):
    """The same prompt in transformers' DynamicCache, its K/V cast to bf16 and written with save_file: the same size
    as the baseline computed from an AsymKVCache holding those tokens (sliding windows included, exact or quantized:
    the baseline holds their last window - 1 tokens either way)."""
    model = request.getfixturevalue(arch)
    dynamic, ours = DynamicCache(config=model.config), AsymKVCache(model.config, **settings)
    with torch.no_grad():
        for cache in (dynamic, ours):
            model(prompt, **cache_kwargs(cache))
    ours.save(tmp_path / "ours.safetensors")  # (gives the sliding windows a copy of their own, as DynamicCache's)
    tensors = {f"layers.{i}.{name}": getattr(layer, name).to(torch.bfloat16).contiguous()
               for i, layer in enumerate(dynamic.layers) for name in ("keys", "values")}
    save_file(tensors, str(tmp_path / "dynamic.safetensors"))
    assert bf16_dynamic_cache_bytes(ours, tmp_path) == (tmp_path / "dynamic.safetensors").stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dynamic.safetensors", "ours.safetensors"]


def test_mlx_bytes_per_element_follow_its_format():
    """mlx-lm's QuantizedKVCache: bits per element plus a scale and a bias (model dtype) per group of 64."""
    assert mlx_bytes_per_element(8) == 1 + 4 / 64 and mlx_bytes_per_element(4) == 0.5 + 4 / 64
    assert mlx_bytes_per_element(4, group_size=32, scale_bytes=4) == 0.5 + 8 / 32


def test_load_in_a_process_reports_time_and_rss(llama, prompt, tmp_path, single_thread):
    cache = AsymKVCache(llama.config)
    with torch.no_grad():
        llama(prompt, **cache_kwargs(cache))
    llama.config.save_pretrained(tmp_path / "config")
    figures = _load_in_this_process(str(cache.save(tmp_path / "doc.safetensors")), str(tmp_path / "config"), "cpu")
    assert figures["tokens"] == prompt.shape[1] and figures["load_s"] > 0 and figures["peak_rss_growth_bytes"] >= 0


@pytest.mark.slow(reason="starts a Python process that imports torch and transformers (~10 s); fast twin: "
                         "tests/bench/test_prompt_cache_bench.py::test_load_in_a_process_reports_time_and_rss")
def test_load_rss_in_a_fresh_process(llama, prompt, tmp_path):
    cache = AsymKVCache(llama.config)
    with torch.no_grad():
        llama(prompt, **cache_kwargs(cache))
    figures = measure_load_rss(cache.save(tmp_path / "doc.safetensors"), llama.config)
    assert figures["tokens"] == prompt.shape[1] and figures["rss_before_bytes"] > 0
