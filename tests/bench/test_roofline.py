"""The roofline's parts (read bandwidth, weight bytes) and caches filled with random K/V instead of a prefill."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_asymkv import AsymKVCache
from hf_asymkv.bench.roofline import fill_random, kv_shape, median_bandwidth, read_bandwidth, weight_bytes
from hf_asymkv.bench.speed import bandwidth_line, format_speed_table, measure_decode_speed

pytestmark = pytest.mark.usefixtures("single_thread")


def test_read_bandwidth_is_a_rate():
    assert read_bandwidth(1, reads=1) > 1e8  # any machine streams a few hundred MB/s at least
    assert median_bandwidth([3.0, 1.0, 2.0]) == 2.0 and median_bandwidth([]) == 0.0


def test_weight_bytes_counts_each_storage_once():
    lin = torch.nn.Linear(8, 8, bias=False)
    model = torch.nn.Sequential(lin, lin)  # the same weight twice, as tied embeddings are
    model.register_buffer("table", torch.zeros(4, dtype=torch.float16))
    assert weight_bytes(model) == 8 * 8 * 4 + 4 * 2


def test_kv_shape(llama):
    cfg = llama.config
    assert kv_shape(cfg) == (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)


@pytest.mark.parametrize("kind", ["dynamic", "asymkv"])
def test_fill_random_writes_every_layer(llama, kind):
    cache = DynamicCache(config=llama.config) if kind == "dynamic" else AsymKVCache(llama.config)
    spent = fill_random(cache, llama.config, 300, torch.float32)
    assert spent > 0 and cache.get_seq_length() == 300
    assert all(cache.get_seq_length(i) == 300 for i in range(llama.config.num_hidden_layers))
    if kind == "asymkv":
        assert cache.stats()["tokens_quantized"] > 0
    again = DynamicCache(config=llama.config)
    fill_random(again, llama.config, 300, torch.float32)
    if kind == "dynamic":  # the same K/V for every cache of a seed
        assert torch.equal(again.layers[1].keys, cache.layers[1].keys)


def test_filled_contexts_and_the_roofline(llama):
    rows = measure_decode_speed(llama, ["asymkv-balanced-fused"], [200, 300], new_tokens=2, repeats=1, fill_from=300)
    by = {(r.scheme, r.context): r for r in rows}
    assert not by["dynamic", 200].filled and by["dynamic", 300].filled
    cfg, weights = llama.config, weight_bytes(llama)
    dynamic = by["dynamic", 300]  # 300 filled + 1 warm-up + 2 steps, fp32
    assert dynamic.kv_bytes == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 303 * cfg.head_dim * 4
    for r in rows:
        assert r.step_bytes == weights + r.kv_bytes and r.bandwidth_gbs > 0
        assert r.roofline_ms == pytest.approx(r.step_bytes / (r.bandwidth_gbs * 1e9) * 1e3)
        assert r.x_roofline == pytest.approx(r.decode_ms_median / r.roofline_ms) and r.decode_rss_growth_mib >= 0
    table = format_speed_table(rows)
    assert "x roofline" in table and table.count("(fill)") == 2 and "decode RSS growth MiB" in table
    assert bandwidth_line(rows).count("GB/s") == 2
