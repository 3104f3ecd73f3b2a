"""Calibration: `LayerStats` bookkeeping by position bucket, top-k percentiles, `ObservingCache` (must not change
attention), `calibrate_model` + `scales_from_stats` on the tiny Llama, `bucket_report`, and `AsymKVCache` with
calibrated scales (file / object / tensors agree; overflow policies widen, clip and error)."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import FIRST_PLAIN_TOKEN, VOCAB
from helpers import greedy_with_logits
from transformers import DynamicCache

from hf_asymkv import AsymKVCache, cache_kwargs
from hf_asymkv.calibration.calibrate import (
    BUCKETS,
    LayerStats,
    ObservingCache,
    bucket_report,
    calibrate_model,
    format_report,
    percentile_top_k,
    scales_from_stats,
)
from hf_asymkv.core.scales import KVScales

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.releases]

H, D = 2, 16  # the tiny models' kv heads and head_dim
# Quantizes after a handful of tokens. No sinks and unrotated V (the 0.1 defaults): these tests compare a cache
# built on ranges calibrated from the very input against DynamicCache, and quantized V in early layers moves the
# later layers' keys; with rotated V one channel of this tiny model lands 3% beyond its calibrated range.
SMALL = dict(residual_length=8, key_block_size=8, sink_tokens=0, value_rotation=False)


def tokens(n: int, seed: int, batch: int = 1) -> torch.LongTensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_PLAIN_TOKEN, VOCAB, (batch, n), generator=g)


def unit_keys(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """``[B, H, n, D]`` values of magnitude exactly 0.5 with random signs: every bucket's range is 0.5."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (batch, H, n, D), generator=g).float() * 2 - 1) * 0.5


def forward(model, ids, cache, **kw):
    with torch.no_grad():
        return model(input_ids=ids, **cache_kwargs(cache), use_cache=True, **kw)


def chunked(model, ids, cache, chunk: int) -> list[torch.Tensor]:
    return [forward(model, ids[:, s : s + chunk], cache).logits for s in range(0, ids.shape[1], chunk)]


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(ref || other) of the next-token distributions."""
    p, q = F.log_softmax(ref_logits.float(), -1), F.log_softmax(logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


# ------------------------------------------------------------------------------------------------ LayerStats
def test_buckets_partition_positions():
    assert BUCKETS[0] == ("sinks", 0, 4)
    assert all(BUCKETS[i][2] == BUCKETS[i + 1][1] for i in range(len(BUCKETS) - 1))
    assert BUCKETS[-1][2] == math.inf


@pytest.mark.parametrize(
    "position, bucket", [(0, "sinks"), (3, "sinks"), (4, "<512"), (511, "<512"), (512, "<4k"), (600, "<4k")],
    ids=lambda x: str(x),
)
def test_planted_key_shows_up_in_its_bucket_only(position, bucket):
    k = unit_keys(700)
    k[0, 1, position, 5] = -7.0
    v = unit_keys(700, seed=1)
    v[0, 0, position, 9] = 3.0
    s = LayerStats(H, D)
    s.observe(k, v, start=0)
    assert s.tokens == {"sinks": 4, "<512": 508, "<4k": 188, ">=4k": 0}
    assert s.observed == 700
    assert s.k_absmax[1, 5] == 7.0 and s.v_absmax[0] == 3.0
    for name, *_ in BUCKETS:
        expected_k = torch.full((H, D), 0.5 if s.tokens[name] else 0.0)
        expected_v = torch.full((H,), 0.5 if s.tokens[name] else 0.0)
        if name == bucket:
            expected_k[1, 5], expected_v[0] = 7.0, 3.0
        assert torch.equal(s.k_bucket[name], expected_k), name
        assert torch.equal(s.v_bucket[name], expected_v), name


def test_start_offset_places_tokens_in_the_long_bucket():
    k, v = unit_keys(10), unit_keys(10, seed=1)
    k[0, 0, 7, 2] = 9.0  # position 4090 + 7 = 4097
    s = LayerStats(H, D)
    s.observe(k, v, start=4090)
    assert s.tokens == {"sinks": 0, "<512": 0, "<4k": 6, ">=4k": 4}
    assert s.k_bucket[">=4k"][0, 2] == 9.0 and s.k_bucket["<4k"][0, 2] == 0.5
    assert s.k_bucket["sinks"].max() == 0 and s.k_bucket["<512"].max() == 0


@pytest.mark.parametrize("sizes", [(700,), (3, 1, 508, 100, 88), (1,) * 20 + (680,), (512, 188), (4, 508, 188)],
                         ids=["one-shot", "across-boundaries", "token-by-token-start", "at-512", "at-4"])
def test_chunked_observation_equals_one_shot(sizes):
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, H, 700, D, generator=g), torch.randn(2, H, 700, D, generator=g)
    one = LayerStats(H, D, top_k=50)
    one.observe(k, v, start=0)
    parts = LayerStats(H, D, top_k=50)
    start = 0
    for n in sizes:
        parts.observe(k[:, :, start : start + n], v[:, :, start : start + n], start=start)
        start += n
    assert start == 700
    assert parts.tokens == one.tokens and parts.observed == one.observed == 2 * 700
    assert torch.equal(parts.k_absmax, one.k_absmax) and torch.equal(parts.v_absmax, one.v_absmax)
    for name, *_ in BUCKETS:
        assert torch.equal(parts.k_bucket[name], one.k_bucket[name])
        assert torch.equal(parts.v_bucket[name], one.v_bucket[name])
    assert torch.equal(parts.k_top, one.k_top)


def test_non_finite_inputs_keep_statistics_finite():
    k, v = unit_keys(8), unit_keys(8, seed=1)
    k[0, 0, 1, 0], k[0, 1, 2, 3], v[0, 0, 3, 4] = float("inf"), float("nan"), float("-inf")
    s = LayerStats(H, D)
    s.observe(k, v, start=0)
    assert torch.isfinite(s.k_absmax).all() and torch.isfinite(s.v_absmax).all()
    assert s.k_absmax.max() == 0.5


# ------------------------------------------------------------------------------------------------ percentiles
@pytest.mark.parametrize("percentile", [50.0, 90.0, 99.0, 99.9, 99.99, 100.0])
def test_percentile_from_top_k_equals_torch_quantile(percentile):
    g = torch.Generator().manual_seed(7)
    chunks = [torch.randn(2, H, n, D, generator=g) * torch.linspace(0.5, 3, D) for n in (300, 1, 199, 500)]
    rows = 2 * sum(c.shape[2] for c in chunks)
    s = LayerStats(H, D, top_k=percentile_top_k(percentile, rows))
    start = 0
    for c in chunks:
        s.observe(c, c, start)
        start += c.shape[2]
    everything = torch.cat(chunks, dim=2).abs().permute(1, 3, 0, 2).reshape(H, D, -1)  # [H, D, rows]
    expected = torch.quantile(everything.double(), percentile / 100, dim=-1).float()
    torch.testing.assert_close(s.k_percentile(percentile), expected, rtol=1e-5, atol=1e-6)
    assert (s.k_percentile(percentile) <= s.k_absmax).all()


def test_percentile_needs_enough_kept_values():
    s = LayerStats(H, D, top_k=2)
    s.observe(unit_keys(1000), unit_keys(1000), 0)
    s.k_percentile(99.9)  # rank 1 from the top: fits
    with pytest.raises(ValueError, match=r"percentile 90.0 needs the top \d+ values per channel, only 2 were kept"):
        s.k_percentile(90.0)
    with pytest.raises(ValueError, match=r"percentile must be in \(0, 100\]"):
        s.k_percentile(150)
    with pytest.raises(ValueError, match="no keys observed"):
        LayerStats(H, D, top_k=2).k_percentile(99)


# ------------------------------------------------------------------------------------------------ ObservingCache
def test_observing_cache_does_not_change_attention(model, prompt):
    """Chunked prefill then greedy decoding: bit-identical logits to DynamicCache, and the stats see every
    token at its position (sliding-window layers too)."""
    obs, ref = ObservingCache(model.config), DynamicCache(config=model.config)
    for a, b in zip(chunked(model, prompt, obs, 16), chunked(model, prompt, ref, 16)):
        assert torch.equal(a, b)
    nxt = prompt[:, -1:]
    for _ in range(4):
        a, b = forward(model, nxt, obs).logits, forward(model, nxt, ref).logits
        assert torch.equal(a, b)
        nxt = a[:, -1:].argmax(-1)
    n = prompt.shape[1] + 4
    assert obs.get_seq_length() == ref.get_seq_length() == n
    n_layers = model.config.num_hidden_layers
    assert sorted(obs.stats) == list(range(n_layers))
    for s in obs.stats.values():
        assert s.observed == n and s.tokens == {"sinks": 4, "<512": n - 4, "<4k": 0, ">=4k": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = dict(max_new_tokens=8, do_sample=False)
        a = model.generate(prompt, **cache_kwargs(ObservingCache(model.config)), **kw)
        b = model.generate(prompt, **cache_kwargs(DynamicCache(config=model.config)), **kw)
    assert torch.equal(a, b)


def test_observing_cache_shares_stats_across_caches(llama):
    stats: dict[int, LayerStats] = {}
    forward(llama, tokens(8, 1), ObservingCache(llama.config, stats))
    forward(llama, tokens(8, 2), ObservingCache(llama.config, stats))
    assert all(s.observed == 16 and s.tokens["sinks"] == 8 for s in stats.values())


# ------------------------------------------------------------------------------------------------ calibrate_model
def _recorded_keys(model, samples, chunk: int | None):
    """Per-layer elementwise max of |K| and per-head max of |V| from DynamicCache prefills."""
    k_max, v_max = {}, {}
    for ids in samples:
        cache = DynamicCache(config=model.config)
        chunked(model, ids, cache, chunk or ids.shape[1])
        for i, layer in enumerate(cache.layers):
            k = layer.keys.abs().amax(dim=(0, 2))
            v = layer.values.abs().amax(dim=(0, 2, 3))
            k_max[i] = k if i not in k_max else torch.maximum(k_max[i], k)
            v_max[i] = v if i not in v_max else torch.maximum(v_max[i], v)
    return k_max, v_max


@pytest.fixture(scope="module")
def calibrated(llama):
    """Stats of 3 samples of 96 tokens, chunked by 32, with a top-k buffer for the 99th percentile."""
    samples = [tokens(96, seed) for seed in (10, 11, 12)]
    with torch.no_grad():
        stats = calibrate_model(llama, samples, chunk_size=32, top_k=percentile_top_k(99.0, 3 * 96), progress=False)
    return samples, stats


def test_calibrated_ranges_cover_every_key_seen(llama, calibrated):
    samples, stats = calibrated
    scales = scales_from_stats(stats, llama.config, metadata={"model_id": "tiny"})
    scales.validate(llama.config)
    assert sorted(scales.k_channel_absmax) == [0, 1]
    # Same chunking: the very same keys, so the ranges are exactly their absmax.
    k_max, v_max = _recorded_keys(llama, samples, chunk=32)
    for i in range(2):
        assert torch.equal(scales.k_channel_absmax[i], k_max[i])
        assert torch.equal(scales.v_head_absmax[i], v_max[i])
    # One-shot prefill: the same keys up to float rounding of a differently shaped computation.
    k_one, v_one = _recorded_keys(llama, samples, chunk=None)
    for i in range(2):
        assert (k_one[i] <= scales.k_channel_absmax[i] * (1 + 1e-5) + 1e-6).all()
        assert (v_one[i] <= scales.v_head_absmax[i] * (1 + 1e-5) + 1e-6).all()
    for s in stats.values():
        assert s.observed == 3 * 96 and s.tokens == {"sinks": 12, "<512": 276, "<4k": 0, ">=4k": 0}


def test_percentile_scales_stay_within_absmax(llama, calibrated):
    _, stats = calibrated
    absmax = scales_from_stats(stats, llama.config)
    p99 = scales_from_stats(stats, llama.config, statistic="percentile", percentile=99.0)
    assert p99.metadata["statistic"] == "percentile" and p99.metadata["percentile"] == "99.0"
    for i in absmax.k_channel_absmax:
        assert (p99.k_channel_absmax[i] <= absmax.k_channel_absmax[i]).all()
        assert (p99.k_channel_absmax[i] < absmax.k_channel_absmax[i]).any()
        assert torch.equal(p99.v_head_absmax[i], absmax.v_head_absmax[i])  # V keeps absmax
    with pytest.raises(ValueError, match=r"statistic must be one of \['absmax', 'percentile'\]"):
        scales_from_stats(stats, llama.config, statistic="mean")


def test_scales_from_stats_keeps_ranges_positive(llama):
    s = LayerStats(H, D)
    k = unit_keys(8)
    k[:, 0, :, 3] = 0.0  # a channel that is always zero
    s.observe(k, unit_keys(8), 0)
    scales = scales_from_stats({0: s, 1: s}, llama.config)
    scales.validate(llama.config)
    assert scales.k_channel_absmax[0][0, 3] > 0


# ------------------------------------------------------------------------------------------------ bucket report
def _stats_with_plant(positions_values: dict[int, float], n: int = 700, start: int = 0) -> LayerStats:
    k, v = unit_keys(n), unit_keys(n, seed=1)
    for pos, value in positions_values.items():
        k[0, 1, pos - start, 5] = value
    s = LayerStats(H, D)
    s.observe(k[:, :, :4], v[:, :, :4], 0)  # positions 0..3 always seen (the first chunk of a sample)
    s.observe(k[:, :, 4:], v[:, :, 4:], start + 4)
    return s


def test_bucket_report_warns_on_larger_long_position_keys():
    stats = {0: _stats_with_plant({}), 1: _stats_with_plant({600: 2.0})}
    report = bucket_report(stats)
    assert len(report["warnings"]) == 1
    assert "layer 1:" in report["warnings"][0] and "bucket <4k" in report["warnings"][0]
    assert "x4.00" in report["warnings"][0]
    beyond = report["layers"]["1"]["channels_beyond_short"]["<4k"]
    assert beyond["fraction"] == pytest.approx(1 / (H * D)) and beyond["worst_ratio"] == pytest.approx(4.0)
    assert report["layers"]["0"]["channels_beyond_short"]["<4k"]["fraction"] == 0
    assert report["layers"]["1"]["k_absmax"] == {"sinks": 0.5, "<512": 0.5, "<4k": 2.0}
    json.dumps(report)  # the CLI writes it as JSON
    text = format_report(report)
    assert "WARNING: 1 layers" in text
    assert text.splitlines()[0].split()[:2] == ["layer", "K"]


def test_bucket_report_counts_layers_not_buckets():
    """A layer over its short range in both long buckets is one layer in the summary line."""
    s = _stats_with_plant({4050: 3.0, 4150: 2.0}, n=200, start=4000)
    report = bucket_report({0: s})
    assert len(report["warnings"]) == 2  # one per bucket
    assert {w.split("bucket ")[1].split()[0] for w in report["warnings"]} == {"<4k", ">=4k"}
    assert "WARNING: 1 layers" in format_report(report)


@pytest.mark.parametrize("planted", [None, 0.5, 0.54], ids=["none", "equal", "within-tolerance"])
def test_bucket_report_quiet_when_long_keys_stay_in_range(planted):
    s = _stats_with_plant({} if planted is None else {600: planted})
    report = bucket_report({0: s})
    assert report["warnings"] == []
    assert "No layer's long-context key range exceeds" in format_report(report)


def test_bucket_report_sink_ratio_and_short_only_data():
    s = _stats_with_plant({0: 5.0}, n=100)
    row = bucket_report({0: s})["layers"]["0"]
    assert row["sink_vs_rest_k"] == pytest.approx(10.0)
    assert row["channels_beyond_short"] == {} and set(row["k_absmax"]) == {"sinks", "<512"}


def test_bucket_report_on_a_real_long_sample(llama):
    """640 tokens reach the <4k bucket on the tiny Llama: the report has its row (warning or not)."""
    stats = calibrate_model(llama, [tokens(640, 5)], chunk_size=256, progress=False)
    report = bucket_report(stats)
    for row in report["layers"].values():
        assert row["tokens"] == {"sinks": 4, "<512": 508, "<4k": 128, ">=4k": 0}
        assert set(row["channels_beyond_short"]) == {"<4k"}
    assert len(format_report(report).splitlines()) == 1 + 2 + 1  # header, two layers, summary


# ------------------------------------------------------------------------------------------------ AsymKVCache + scales
_greedy = greedy_with_logits


def test_scales_file_object_and_tensors_give_identical_generations(llama, calibrated, prompt, tmp_path):
    _, stats = calibrated
    scales = scales_from_stats(stats, llama.config, metadata={"model_id": "tiny"})
    path = scales.save(tmp_path / "kv_scales.safetensors")
    runs = {
        "path": AsymKVCache(llama.config, scales=path, **SMALL),
        "str-path": AsymKVCache(llama.config, scales=str(path), **SMALL),
        "object": AsymKVCache(llama.config, scales=scales, **SMALL),
        "loaded": AsymKVCache(llama.config, scales=KVScales.load(path, config=llama.config), **SMALL),
        "key_absmax": AsymKVCache(llama.config, key_absmax=dict(scales.k_channel_absmax), **SMALL),
    }
    outs = {name: _greedy(llama, prompt, cache) for name, cache in runs.items()}
    ref_seq, ref_logits = outs["path"]
    for name, (seq, logits) in outs.items():
        assert torch.equal(seq, ref_seq), name
        assert torch.equal(logits, ref_logits), name
    assert runs["path"].stats()["tokens_quantized"] > 0
    # The calibrated scales are really used: uncalibrated per-block scales decode differently.
    _, uncal = _greedy(llama, prompt, AsymKVCache(llama.config, **SMALL))
    assert not torch.equal(uncal, ref_logits)


@pytest.fixture(scope="module")
def own_scales(llama):
    """Ranges calibrated on the very input used below (64 tokens, chunks of 16)."""
    ids = tokens(64, 1234)
    return ids, scales_from_stats(calibrate_model(llama, [ids], chunk_size=16, progress=False), llama.config)


def _shrunk(scales: KVScales, factor: float) -> KVScales:
    """Emulates a calibration on short samples: every key range ``factor`` x too small."""
    return KVScales({i: k * factor for i, k in scales.k_channel_absmax.items()}, dict(scales.v_head_absmax),
                    dict(scales.metadata))


def _teacher_forced(model, ids, cache) -> torch.Tensor:
    """Logits of the last 16 tokens after a 48-token prefill: attention reads 40 quantized keys then."""
    forward(model, ids[:, :48], cache)
    return forward(model, ids[:, 48:], cache).logits


def test_overflow_policies_on_too_small_ranges(llama, own_scales):
    ids, scales = own_scales
    ref = _teacher_forced(llama, ids, DynamicCache(config=llama.config))
    small = _shrunk(scales, 0.5)
    result = {}
    for policy in ("widen", "clip"):
        cache = AsymKVCache(llama.config, scales=small, overflow_policy=policy, **SMALL)
        result[policy] = (kl(ref, _teacher_forced(llama, ids, cache)), cache.stats())
    exact_cache = AsymKVCache(llama.config, scales=scales, overflow_policy="error", **SMALL)
    kl_exact = kl(ref, _teacher_forced(llama, ids, exact_cache))

    (kl_widen, widen), (kl_clip, clip) = result["widen"], result["clip"]
    assert widen["key_overflow_channels"] > 0 and widen["key_widened_blocks"] > 0
    assert widen["key_clipped_values"] == 0
    assert clip["key_overflow_channels"] > 0 and clip["key_clipped_values"] > 0 and clip["key_widened_blocks"] == 0
    assert exact_cache.stats()["key_overflow_channels"] == 0
    # Widening costs nothing measurable against correct ranges; clipping half the range does damage
    # (measured: KL 7.5e-4 widen vs 1.5e-2 clip).
    assert kl_widen <= 1.5 * kl_exact + 1e-5
    assert kl_clip > 5 * kl_widen


def test_overflow_policy_error_names_the_fix(llama, own_scales):
    ids, scales = own_scales
    cache = AsymKVCache(llama.config, scales=_shrunk(scales, 0.5), overflow_policy="error", **SMALL)
    with pytest.raises(ValueError, match=r"exceed the calibrated absmax \(worst x[\d.]+\) with overflow_policy="
                                         r"'error'; use 'widen' \(default\) or recalibrate on longer samples"):
        forward(llama, ids[:, :48], cache)


@pytest.mark.parametrize("policy", ["widen", "clip"])
def test_dequantized_keys_within_bound_of_originals(llama, own_scales, policy):
    """On one real layer: with "widen" every key decodes within half a (widened) step; with "clip" the
    overflowing ones are saturated at the calibrated range."""
    ids, scales = own_scales
    cache = DynamicCache(config=llama.config)
    forward(llama, ids, cache)
    k, v = cache.layers[1].keys, cache.layers[1].values  # [1, H, 64, D]
    calib = scales.k_channel_absmax[1] * 0.5
    asym = AsymKVCache(llama.config, key_absmax={1: calib.clone()}, overflow_policy=policy, residual_length=0,
                       sink_tokens=0, key_block_size=8)
    layer = asym.layers[1]
    layer.update(k, v)
    keys, _ = layer.update(k[:, :, :0], v[:, :, :0])
    assert layer.key_store.blocks.codes.length == 64
    blocks = k.abs().view(1, H, 8, 8, D).amax(dim=3)  # [B, H, nblk, D]
    scale = layer.key_store.blocks.scales.live.float()  # [B, H, nblk, D]: per block and channel
    step = scale.repeat_interleave(8, dim=2)  # per element
    err = (keys - k).abs()
    if policy == "widen":
        assert layer.stats["key_widened_blocks"] > 0 and layer.stats["key_clipped_values"] == 0
        assert (scale * 127 >= blocks * (1 - 1e-6)).all()  # every block's range covers its keys
        assert (err <= step / 2 * (1 + 1e-5) + 1e-7).all()  # no element clipped: within half a step
    else:
        over = k.abs() > calib[None, :, None, :]
        assert layer.stats["key_clipped_values"] == int(over.sum()) > 0
        assert torch.allclose(scale, (calib / 127)[None, :, None, :].expand_as(scale), rtol=2**-7)  # not widened
        saturated = (k.abs() - 127 * step).clamp(min=0)  # what saturating at the calibrated range loses
        assert ((err - saturated).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()
        assert err.max() > 20 * step.max()  # the damage: many steps off


def test_genuinely_short_calibration_on_a_long_input_widens_never_clips(llama):
    """Calibrated on four 16-token samples, applied to a 256-token input: overflows are counted and widened."""
    stats = calibrate_model(llama, [tokens(16, s) for s in range(4)], chunk_size=16, progress=False)
    scales = scales_from_stats(stats, llama.config)
    ids = tokens(256, 77)
    cache = AsymKVCache(llama.config, scales=scales, **SMALL)
    ref = DynamicCache(config=llama.config)
    forward(llama, ids[:, :192], cache), forward(llama, ids[:, :192], ref)
    logits, ref_logits = forward(llama, ids[:, 192:], cache).logits, forward(llama, ids[:, 192:], ref).logits
    st = cache.stats()
    assert st["tokens_quantized"] >= 240
    assert st["key_overflow_channels"] > 0 and st["key_widened_blocks"] > 0
    assert st["key_clipped_values"] == 0
    uncal = AsymKVCache(llama.config, **SMALL)
    forward(llama, ids[:, :192], uncal)
    kl_uncal = kl(ref_logits, forward(llama, ids[:, 192:], uncal).logits)
    assert kl(ref_logits, logits) <= 2 * kl_uncal + 1e-4  # widening keeps the quality of per-block ranges


def test_calibration_of_gemma4_per_layer_head_dims(shared_kv, tmp_path):
    """Gemma4's full-attention layers have their own head_dim: calibration used to crash on its fingerprint after
    the whole pass; now the file validates and feeds a cache."""
    stats = calibrate_model(shared_kv, [tokens(40, seed=1)], chunk_size=16, progress=False)
    scales = scales_from_stats(stats, shared_kv.config)
    assert {i: tuple(k.shape) for i, k in scales.k_channel_absmax.items()} == {0: (H, D), 1: (H, 32)}
    loaded = KVScales.load(scales.save(tmp_path / "kv_scales.safetensors"), shared_kv.config)
    cache = AsymKVCache(shared_kv.config, scales=loaded)
    assert cache.layers[1].key_absmax.shape == (H, 32)
    greedy_with_logits(shared_kv, tokens(20, seed=2), cache, n=4)


def test_fingerprint_is_checked_before_any_model_pass(llama, monkeypatch):
    import hf_asymkv.core.scales as scales_mod

    def refuse(config):
        raise ValueError("cannot fingerprint this config")

    calls = []
    monkeypatch.setattr(scales_mod, "config_fingerprint", refuse)
    monkeypatch.setattr(llama, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError, match="cannot fingerprint this config"):
        calibrate_model(llama, [tokens(40, seed=1)], chunk_size=16, progress=False)
    assert not calls
