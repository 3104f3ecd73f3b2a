"""The demo's numbers: first how many times smaller than a bf16 DynamicCache of the same tokens (the README's and
``memory_footprint()["ratio_vs_bf16"]``'s basis) with the tokens held, then KV bytes on bf16 and in the model's
dtype; decode ms/token only when asked for, over interleaved runs (median of each run's timed steps after warm-up),
or nothing."""

import copy

import pytest
import torch
from transformers import BatchEncoding, DynamicCache

import hf_asymkv.evals.demo as demo
from hf_asymkv import AsymKVCache, cache_kwargs
from hf_asymkv.bench.memory import cache_nbytes
from hf_asymkv.evals.demo import WARMUP_STEPS, DemoRow, StepClock, bf16_bytes, format_demo, run_demo

INFO = {"prompt_tokens": 3112, "expected": "3471", "depth": 0.35, "key": "glass door", "dtype": "float32"}


def _rows(timed: bool = True):
    return [DemoRow("DynamicCache", "The code is 3471.", True, 4 * 2**20, 2 * 2**20, 1.0, 3135,
                    [12.0, 14.0, 11.0] if timed else []),
            DemoRow("AsymKVCache", "The code is 3471.", True, 2**20, 2**19 + 2**18, 2.5, 3135)]


def test_format_demo_leads_with_the_bf16_ratio_and_the_tokens():
    text = format_demo(_rows(), {**INFO, "timing_runs": 3})
    assert "3112 tokens" in text and "(3471) sits 35% into the document" in text
    header = text.splitlines()[1]
    assert header.split()[1:5] == ["x", "smaller", "than", "bf16"]
    assert "tokens" in header and "KV MiB bf16" in header and "KV MiB float32" in header
    assert "decode ms/token (range)" in header
    ours = next(line for line in text.splitlines() if line.startswith("AsymKVCache")).split()
    assert ours[1:5] == ["2.50", "3135", "0.75", "1.00"]  # x smaller than bf16, tokens; bf16 MiB, fp32 MiB
    assert ours[5] == "n/a" and "yes" in ours and "3471." in ours  # too few steps: no timing
    assert "12.0 (11.0-14.0)" in next(line for line in text.splitlines() if line.startswith("DynamicCache"))
    assert f"median over 3 interleaved runs of each run's median step after {WARMUP_STEPS} warm-up steps" in text
    assert "the README's basis" in text


def test_the_demo_prints_the_footprint_ratio(llama, prompt):
    """The demo's first column is the cache's own ``ratio_vs_bf16`` for the tokens it holds, what the Quick start
    prints (tests/test_readme.py) and the presets table measures."""
    cache = AsymKVCache(llama.config, residual_length=8, key_block_size=8)
    llama.generate(prompt, **cache_kwargs(cache), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    footprint = cache.memory_footprint()
    row = DemoRow("AsymKVCache", "x", True, cache_nbytes(cache), bf16_bytes(cache, cache_nbytes(cache), 4),
                  footprint["ratio_vs_bf16"], cache.get_seq_length())
    dynamic_bf16 = footprint["bf16_equivalent"]
    assert row.ratio_vs_bf16 == pytest.approx(dynamic_bf16 / row.kv_bytes_bf16) and row.tokens == footprint["tokens"]


def test_format_demo_without_timing_prints_no_speed_figure():
    text = format_demo(_rows(timed=False), INFO)
    assert "ms/token" not in text.splitlines()[1] and "Decode speed is not shown" in text


class _FakeTokenizer:
    def apply_chat_template(self, messages, **kwargs):
        return BatchEncoding({"input_ids": torch.ones(1, 5, dtype=torch.long)})

    def decode(self, ids, **kwargs):
        return "3471"


class _FakeModel:
    """Records which cache each generate call got; stamps 1 prompt + 10 tokens, 1 ms apart."""

    dtype = torch.float32

    def __init__(self, config):
        self.config, self.calls, self.device = config, [], torch.device("cpu")

    def generate(self, input_ids, streamer, max_new_tokens, **kwargs):
        self.calls.append(type(next(v for v in kwargs.values() if hasattr(v, "get_seq_length"))).__name__)
        streamer.stamps = [0.001 * k for k in range(11)]
        return torch.cat([input_ids, torch.ones(1, 10, dtype=torch.long)], dim=1)


@pytest.mark.parametrize("runs, calls", [(0, 2), (3, 6)], ids=["untimed", "three-runs"])
def test_timing_runs_are_interleaved(llama, monkeypatch, runs, calls):
    model = _FakeModel(llama.config)
    monkeypatch.setattr(demo, "make_needle_prompt", lambda *a: type("P", (), {"messages": [], "answer": "3471",
                                                                              "key": "door"})())
    rows, info = run_demo(model, _FakeTokenizer(), timing_runs=runs)
    assert model.calls == ["DynamicCache", "AsymKVCache"] * (calls // 2)
    assert [len(r.run_ms) for r in rows] == [runs, runs] and info["timing_runs"] == runs
    assert all(r.correct for r in rows)


def test_format_demo_on_a_bf16_model_shows_one_set():
    text = format_demo(_rows(), {**INFO, "dtype": "bfloat16"})
    assert text.splitlines()[1].count("KV MiB") == 1 and "KV MiB bfloat16" not in text


def test_step_clock_median_after_warmup():
    clock = StepClock()
    # prompt, first token (prefill), then decode steps: two slow warm-up gaps, then 10, 30, 20 ms
    clock.stamps = [0.0, 1.0, 1.5, 1.9, 1.91, 1.94, 1.96]
    ms, steps = clock.decode_ms()
    assert steps == 3 and ms == pytest.approx(20.0)
    clock.stamps = clock.stamps[:-1]
    assert clock.decode_ms() == (None, 2)


@pytest.mark.parametrize("make", [lambda c: DynamicCache(config=c), lambda c: AsymKVCache(c, residual_length=8,
                                                                                          key_block_size=8)],
                         ids=["dynamic", "asymkv"])
def test_bf16_figure_is_what_a_bf16_model_holds(llama, prompt, make):
    """Computed from the fp32 run, the bf16 figure equals the bytes the same cache holds on a bf16 copy."""
    caches = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = llama if dtype == torch.float32 else copy.deepcopy(llama).to(dtype)
        caches[dtype] = make(model.config)
        model.generate(prompt, **cache_kwargs(caches[dtype]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    fp32 = caches[torch.float32]
    assert bf16_bytes(fp32, cache_nbytes(fp32), 4) == cache_nbytes(caches[torch.bfloat16])


def test_step_clock_sees_every_generated_token(llama, prompt):
    clock = StepClock()
    llama.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, streamer=clock)
    assert len(clock.stamps) == 1 + 8  # the prompt, then one stamp per token
    assert clock.decode_ms() == (pytest.approx(clock.decode_ms()[0]), 8 - 1 - WARMUP_STEPS)
