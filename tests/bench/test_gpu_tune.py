"""hf_asymkv/bench/gpu_tune.py: the launch sweep runs (under Triton's interpreter, tiny shapes), keeps failing
settings as rows, and the report picks the fastest setting; the decode profile names its operators."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hf_asymkv.bench import gpu_runs, gpu_tune

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return gpu_runs.build_model(gpu_runs.DRY_SHAPES, torch.float32, torch.device("cpu"))


@pytest.mark.slow(reason="a launch sweep under Triton's interpreter; fast twin: "
                         "tests/bench/test_gpu_tune.py::test_report_picks_the_fastest_and_lists_failures")
@needs_triton
def test_sweep_rows_agree_with_the_torch_attention(tiny_model, monkeypatch):
    monkeypatch.setattr(gpu_tune, "GRID", {"num_warps": (4,), "num_stages": (1,), "tile": (16, 64, 128)})
    monkeypatch.setattr(gpu_tune, "PROGRAMS_PER_SM", (1, 2))
    rows = gpu_tune.launch_rows(tiny_model, ["lean"], [1], 256, iters=1, dtypes=[torch.float32])
    # the default launch, then tiles 16 (inside lean's 32-token key groups) and 64 (two of them, lean's default) at
    # two split counts each; 128 holds four groups: skipped
    assert [(r["default"], r["tile"], r["programs_per_sm"]) for r in rows] == [
        (True, None, None), (False, 16, 1), (False, 16, 2), (False, 64, 1), (False, 64, 2)]
    assert all(r["sqnr_db"] >= 60 and r["us"] > 0 for r in rows)


def test_a_time_budget_spent_skips_the_rest(tiny_model):
    rows = gpu_tune.launch_rows(tiny_model, ["balanced"], [1, 2], 256, iters=1, dtypes=[torch.float32], deadline=0.0)
    assert [r["status"] for r in rows] == ["skipped: time budget"] * 2


def test_report_picks_the_fastest_and_lists_failures():
    base = {"preset": "balanced", "dtype": "bfloat16", "batch": 1, "context": 32768}
    rows = [{**base, "default": True, "num_warps": None, "num_stages": None, "tile": None, "programs_per_sm": None,
             "us": 100.0},
            {**base, "default": False, "num_warps": 4, "num_stages": 1, "tile": 64, "programs_per_sm": 4, "us": 60.0},
            {**base, "default": False, "num_warps": 8, "num_stages": 3, "tile": 64, "programs_per_sm": 1,
             "status": "failed: OutOfResources: shared memory"},
            {**base, "dtype": "float32", "default": True, "num_warps": None, "num_stages": None, "tile": None,
             "programs_per_sm": None, "status": "failed: OutOfResources: shared memory"}]
    best = gpu_tune.best_rows(rows)
    assert best == [{"preset": "balanced", "dtype": "bfloat16", "batch": 1, "default_us": 100.0, "best_us": 60.0,
                     "best": {"num_warps": 4, "num_stages": 1, "tile": 64, "programs_per_sm": 4}, "x_default": 100 / 60}]
    text = gpu_tune.markdown(rows, [])
    assert "| balanced | bfloat16 | 1 | 100.0 | 60.0 | 1.67 | 4 | 1 | 64 | 4 |" in text
    assert "Settings that failed: 2" in text  # the default launch's None settings sort beside the others


def test_profile_names_the_operators_of_a_step(tiny_model):
    rows = gpu_tune.profile_rows(tiny_model, ["dynamic", "dynamic-flash"], 1, 64, steps=1, top=5)
    assert [r["scheme"] for r in rows] == ["dynamic", "dynamic-flash"]
    for row in rows:
        assert "status" not in row and row["step_ms"] > 0 and row["attn_implementation"] == "sdpa"
        assert len(row["cpu_top"]) == 5 and any(e["op"] == "aten::mm" for e in row["cpu_top"])
    assert "## Profile: dynamic-flash (batch 1, context 64, attention sdpa)" in gpu_tune.markdown([], rows)


def test_attention_rows_compare_with_sdpa_at_their_own_batch():
    from hf_asymkv.bench.gpu_report import attention_table

    rows = [{"impl": impl, "batch": batch, "context": 32768, "bytes": nbytes, "eager_us": us * 2, "graph_us": us}
            for impl, batch, nbytes, us in [("sdpa-bf16", 1, 128, 42.0), ("triton-balanced", 1, 50, 84.0),
                                            ("sdpa-bf16", 8, 1024, 272.0), ("triton-balanced", 8, 400, 544.0)]]
    table = attention_table(rows, bandwidth=1e12)
    # the first H200 run divided the batch-8 rows by the batch-1 SDPA time (0.08x instead of 0.5x)
    assert [r["x_sdpa"] for r in table] == [1.0, 0.5, 1.0, 0.5]
    assert [r["ceiling_x_sdpa"] for r in table] == [1.0, 128 / 50, 1.0, 1024 / 400]
