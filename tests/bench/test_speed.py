"""`hf-asymkv bench` on the tiny Llama: rows, ratios, KV bytes, peak RSS, the attention switch and the outputs.

Timings themselves are never asserted (speed targets live in the committed benchmark, not in unit tests)."""

from __future__ import annotations

import json

import pytest
import torch

from hf_asymkv.bench.schemes import make_cache, scheme_attention
from hf_asymkv.bench.speed import PeakRSS, format_speed_table, measure_decode_speed, plot_speed
from hf_asymkv.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def rows(llama):
    return measure_decode_speed(llama, ["asymkv", "asymkv-fused", "hf-quanto-int4"], [300], new_tokens=3, repeats=2)


def test_rows_and_ratios(rows, llama):
    assert [r.scheme for r in rows] == ["dynamic", "asymkv", "asymkv-fused", "hf-quanto-int4"]
    base = rows[0]
    assert base.ratio_vs_dynamic == base.prefill_ratio_vs_dynamic == base.kv_ratio_vs_dynamic == 1.0
    assert all(r.decode_ms_max >= r.decode_ms_median > 0 and r.steps == 3 and r.repeats == 2 for r in rows)
    assert all(r.spike_ratio >= 1.0 and r.prefill_s_median > 0 for r in rows)
    cfg = llama.config  # 2 layers x (K, V) x kv heads x (300 prefill + 1 warm-up + 3 steps) x head_dim x fp32
    assert base.kv_bytes == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 304 * cfg.head_dim * 4
    by = {r.scheme: r for r in rows}
    assert by["asymkv"].kv_bytes == by["asymkv-fused"].kv_bytes  # same storage, only the read-out differs
    assert by["asymkv"].kv_ratio_vs_dynamic > 1.1  # 128 of 304 tokens quantized, the rest in the window
    table = format_speed_table(rows)
    assert table.count("\n") == len(rows) + 1 and "decode x DynamicCache" in table


def test_fused_scheme_switches_attention_and_restores_it(llama):
    before = llama.config._attn_implementation
    with scheme_attention(llama, "asymkv-fused"):
        assert llama.config._attn_implementation == "asymkv_sdpa"
        assert make_cache("asymkv-fused", llama.config).fused_attention
    assert llama.config._attn_implementation == before
    with pytest.raises(ValueError, match="need the model on attn_implementation='asymkv_sdpa'"):
        make_cache("asymkv-fused", llama.config)


@pytest.mark.parametrize("preset", ["balanced", "compact"])
def test_preset_fused_schemes_build_the_preset_on_the_fused_attention(llama, preset):
    from hf_asymkv import PRESETS

    with scheme_attention(llama, f"asymkv-{preset}-fused"):
        cache = make_cache(f"asymkv-{preset}-fused", llama.config)
        c, want = cache.cache_config, PRESETS[preset]
        assert cache.fused_attention and (c.key_format, c.value_bits) == (want.key_format, want.value_bits)
    with pytest.raises(ValueError, match="need the model on attn_implementation='asymkv_sdpa'"):
        make_cache(f"asymkv-{preset}-fused", llama.config)


def test_peak_rss_sees_an_allocation():
    if PeakRSS.rss() is None:
        pytest.skip("no /proc/self/statm on this system")
    with PeakRSS(interval=0.001) as p:
        # 64 MiB, touched: above glibc's largest mmap threshold (32 MiB), so fresh pages rather than freed heap;
        x = torch.ones(64 * 2**20 // 4)  # still alive at exit, so the exit sample sees it whatever the timing
    del x
    assert p.growth >= 56 * 2**20


def test_plot_speed_writes_png(rows, tmp_path):
    pytest.importorskip("matplotlib")
    path = plot_speed(rows, tmp_path / "speed.png", "tiny")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cli_writes_json_markdown_png(workdir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench"
    assert main(["bench", "--model", str(workdir / "model"), "--lengths", "200", "--schemes", "asymkv,asymkv-fused",
                 "--new-tokens", "2", "--repeats", "1", "--out", str(out)]) == 0
    data = json.loads((out / "decode_speed.json").read_text())
    assert [r["scheme"] for r in data["rows"]] == ["dynamic", "asymkv", "asymkv-fused"]
    assert data["meta"]["command"].startswith("hf-asymkv bench --model")
    assert all("spike_ratio" in r and "kv_bytes" in r and "peak_rss_growth_mib" in r for r in data["rows"])
    assert (out / "decode_speed.png").exists() and "KV MiB" in (out / "decode_speed.md").read_text()
    assert "asymkv-fused" in capsys.readouterr().out


def test_bench_cli_rejects_unknown_scheme_before_loading(capsys):
    with pytest.raises(SystemExit) as info:  # refused while parsing, before the model loads
        main(["bench", "--schemes", "asymkv,nope"])
    assert info.value.code == 2
    assert "argument --schemes: unknown cache scheme(s) ['nope']; known cache schemes: dynamic," in capsys.readouterr().err


@pytest.mark.slow(reason="inductor compiles of the bench's static schemes; fast twin: "
                         "tests/core/test_static.py::test_static_generates_the_dynamic_tokens_and_blocks")
def test_static_schemes_compile_once_and_store_alike(llama):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    schemes = ["hf-static-compiled", "asymkv-balanced-static", "asymkv-balanced-static-compiled",
               "asymkv-balanced-static-fused-compiled"]
    # the eager backend: the same tracing (fullgraph, one graph per compiled scheme) without inductor's minutes
    rows = measure_decode_speed(llama, schemes, [300], new_tokens=2, repeats=2, compile_backend="eager")
    assert [r.scheme for r in rows] == ["dynamic", *schemes]
    # two graphs per compiled scheme (the prompt's length and one token: the prefill is compiled too), made in the
    # warm-up and reused by the timed runs; none more, no graph break
    assert counters["stats"]["unique_graphs"] == 2 * 3 and not counters["graph_break"]
    by = {r.scheme: r for r in rows}
    assert (by["asymkv-balanced-static"].kv_bytes == by["asymkv-balanced-static-compiled"].kv_bytes
            == by["asymkv-balanced-static-fused-compiled"].kv_bytes)
    assert by["asymkv-balanced-static"].kv_bytes < by["hf-static-compiled"].kv_bytes


def test_static_scheme_needs_a_length(llama):
    from hf_asymkv.bench.schemes import scheme_forward

    with pytest.raises(ValueError, match="scheme 'hf-static' is a static cache: give max_cache_len"):
        make_cache("hf-static", llama.config)
    assert make_cache("asymkv-compact-static", llama.config, max_cache_len=50).max_cache_len == 50
    assert scheme_forward(llama, "asymkv-compact-static") is llama
