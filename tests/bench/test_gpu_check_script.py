"""scripts/gpu_check.py: ``--dry-run`` runs every part on CPU (tiny shapes, the kernels under Triton's
interpreter) and writes its report, so the GPU script cannot rot; bad flags and requests fail with a message."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


@pytest.mark.slow(reason="runs scripts/gpu_check.py --dry-run in a new process, every part under Triton's interpreter "
                         "(minutes of CPU); fast twin: "
                         "tests/bench/test_gpu_check_script.py::test_decode_plan_runs_eager_schemes_before_the_compiles")
@needs_triton
def test_dry_run_writes_the_report(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], check=True,
                   capture_output=True, text=True, env=env)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    ran = {r["scheme"] for r in report["decode"] if r["status"] == "ok"}
    assert {"dynamic", "dynamic-flash", "balanced-dense", "balanced-triton", "compact-triton", "max-triton",
            "balanced-static-compiled", "balanced-static-fused-compiled", "hf-static-compiled"} <= ran
    assert {(r["batch"], r["context"]) for r in report["decode"]} == {(1, 200), (2, 200)}
    assert [r["impl"] for r in report["attention"]] == ["sdpa-bf16", "triton-balanced", "triton-compact", "triton-max"]
    assert len(report["kernel_check"]) == 6 and all(c["sqnr_db"] >= 60 for c in report["kernel_check"])
    assert report["goals"] and report["fit"] and report["meta"]["complete"] is True
    steps = {(u["preset"], u["step"]) for u in report["update_cost"]}
    assert ("max", "flush") in steps and ("max", "no flush") in steps
    assert (tmp_path / "gpu_check.md").read_text().startswith("# GPU check (dry run")


@pytest.mark.parametrize("argv, message", [
    (["--contexts", "8192", "0"], "--contexts must be >= 1, got [8192, 0]"),
    (["--long-batch", "8", "0"], "--long-batch must be >= 1, got [8, 0]"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--bandwidth-tbps", "0"], "--bandwidth-tbps must be > 0, got 0.0"),
    (["--budget-gib", "-5"], "--budget-gib must be > 0, got -5.0"),
    (["--time-budget", "0"], "--time-budget must be > 0, got 0.0"),
    (["--compiled-contexts", "0"], "--compiled-contexts must be >= 1, got [0]"),
    (["--tune-batches", "1", "0"], "--tune-batches must be >= 1, got [1, 0]"),
    (["--parts", "check,speed"], "--parts: unknown or no parts ['speed']; known: update,check,attention,decode,tune,"),
    (["--parts", ","], "--parts: unknown or no parts []"),
    (["--compile-mode", "fast"], "argument --compile-mode: invalid choice: 'fast'"),
    (["--static-contexts", "0"], "--static-contexts must be >= 1, got [0]"),
    (["--static-batches", "8", "-1"], "--static-batches must be >= 1, got [8, -1]"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1, got 0"),
], ids=["zero-context", "zero-batch-context", "negative-warmup", "zero-bandwidth", "negative-budget", "zero-time-budget",
        "zero-compiled-context", "zero-tune-batch", "unknown-part", "no-part", "unknown-compile-mode",
        "zero-static-context", "negative-static-batch", "zero-prefill-chunk"])
def test_bad_flags_exit_2(gpu_check, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_decode_plan_runs_eager_schemes_before_the_compiles(gpu_check):
    args = gpu_check.parse_args(["--contexts", "8192", "32768", "--compiled-contexts", "32768", "--long-batch", "8",
                                 "32768"])
    plan = gpu_check.decode_plan(args, ["hf-static-compiled", "dynamic", "balanced-triton"])
    assert plan == [("dynamic", 1, 8192), ("balanced-triton", 1, 8192), ("dynamic", 1, 32768),
                    ("balanced-triton", 1, 32768), ("dynamic", 8, 32768), ("balanced-triton", 8, 32768),
                    ("hf-static-compiled", 1, 32768), ("hf-static-compiled", 8, 32768)]


def test_unknown_scheme_is_named(gpu_check):
    with pytest.raises(SystemExit, match=r"unknown schemes \['nope'\]; known: \['dynamic'"):
        gpu_check.main(["--dry-run", "--schemes", "dynamic", "nope"])


def test_unknown_profile_scheme_is_named(gpu_check):
    with pytest.raises(SystemExit, match=r"unknown --profile-schemes \['nope'\]; known: \['dynamic'"):
        gpu_check.main(["--dry-run", "--parts", "profile", "--profile-schemes", "dynamic", "nope"])


@pytest.mark.skipif(importlib.util.find_spec("torch") and __import__("torch").cuda.is_available(),
                    reason="a GPU is here")
def test_without_a_gpu_it_points_at_the_dry_run(gpu_check):
    with pytest.raises(SystemExit, match="no CUDA device here; use --dry-run"):
        gpu_check.main([])


def test_compile_modes_are_the_runners_and_default_to_generates(gpu_check):
    from hf_asymkv.bench.gpu_runs import COMPILE_MODES, compiled_forward

    assert gpu_check.parse_args([]).compile_mode == COMPILE_MODES[0] == "reduce-overhead"
    for mode in COMPILE_MODES:
        assert gpu_check.parse_args(["--compile-mode", mode]).compile_mode == mode
    with pytest.raises(ValueError, match="compile mode 'fast'; expected one of"):
        compiled_forward(None, "fast")


@pytest.mark.slow(reason="the static part of the dry run in a new process, compiled; fast twin: "
                         "tests/bench/test_gpu_check_script.py::test_static_plan_runs_every_batch_and_context_eager_schemes_first")
@needs_triton
def test_dry_run_of_the_static_part(tmp_path):
    """``--parts static``: each scheme's row with launches per step and its baseline (the ratios are checked in
    test_static_report.py); the prefill runs in chunks (64 tokens in the dry run, of 200). One compiled scheme: each
    costs a trace."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    schemes = ["dynamic-flash", "balanced-triton", "balanced-static-fused-compiled"]
    subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--parts", "static", "--static-batches", "2",
                    "--static-schemes", *schemes, "--out", str(tmp_path)], check=True, capture_output=True, text=True,
                   env=env)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {r["scheme"]: r for r in report["static"]}
    assert list(rows) == schemes and all(r["status"] == "ok" and r["context"] == 200 for r in rows.values())
    assert all(r["launches_per_step"] > 0 and r["kernels_per_step"] is None for r in rows.values())  # CPU: aten ops
    assert rows["balanced-static-fused-compiled"]["baseline"] == "hf-static-compiled"
    eager = rows["balanced-triton"]
    assert eager["baseline"] == "dynamic-flash" and eager["ratio"] > 0 and eager["target"] == 1.0
    assert report["meta"]["prefill_chunk"] == 64
    assert "## Compiled static path as generate runs it" in (tmp_path / "gpu_check.md").read_text()


def test_unknown_static_scheme_is_named(gpu_check):
    with pytest.raises(SystemExit, match=r"unknown --static-schemes \['nope'\]; known: \['dynamic'"):
        gpu_check.main(["--dry-run", "--parts", "static", "--static-schemes", "dynamic", "nope"])


def test_static_plan_runs_every_batch_and_context_eager_schemes_first(gpu_check):
    """The issue's grid by default (8k/32k/128k x batch 1 and 8); each setting's baselines run beside its rows."""
    args = gpu_check.parse_args(["--parts", "static"])
    args.static_schemes = ["balanced-static-fused-compiled", "hf-static-compiled", "dynamic-flash"]
    plan = gpu_check.static_plan(args)
    assert plan[:3] == [("dynamic-flash", 1, 8192), ("balanced-static-fused-compiled", 1, 8192),
                        ("hf-static-compiled", 1, 8192)]
    assert {(b, c) for _, b, c in plan} == {(b, c) for b in (1, 8) for c in (8192, 32768, 131072)}
    assert len(plan) == 18
