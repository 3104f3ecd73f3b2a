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


@needs_triton
def test_dry_run_writes_the_report(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], check=True,
                   capture_output=True, text=True, env=env)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    ran = {r["scheme"] for r in report["decode"] if r["status"] == "ok"}
    assert {"dynamic", "balanced-dense", "balanced-triton", "compact-triton", "max-triton",
            "balanced-static-compiled", "balanced-static-fused-compiled", "hf-static-compiled"} <= ran
    assert {(r["batch"], r["context"]) for r in report["decode"]} == {(1, 200), (2, 200)}
    assert [r["impl"] for r in report["attention"]] == ["sdpa-bf16", "triton-balanced", "triton-compact", "triton-max"]
    assert len(report["kernel_check"]) == 6 and all(c["sqnr_db"] >= 60 for c in report["kernel_check"])
    assert report["goals"] and report["fit"]
    steps = {(u["preset"], u["step"]) for u in report["update_cost"]}
    assert ("max", "flush") in steps and ("max", "no flush") in steps
    assert (tmp_path / "gpu_check.md").read_text().startswith("# GPU check (dry run")


@pytest.mark.parametrize("argv, message", [
    (["--contexts", "8192", "0"], "--contexts must be >= 1, got [8192, 0]"),
    (["--long-batch", "8", "0"], "--long-batch must be >= 1, got [8, 0]"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--bandwidth-tbps", "0"], "--bandwidth-tbps must be > 0, got 0.0"),
    (["--budget-gib", "-5"], "--budget-gib must be > 0, got -5.0"),
], ids=["zero-context", "zero-batch-context", "negative-warmup", "zero-bandwidth", "negative-budget"])
def test_bad_flags_exit_2(gpu_check, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_scheme_is_named(gpu_check):
    with pytest.raises(SystemExit, match=r"unknown schemes \['nope'\]; known: \['dynamic'"):
        gpu_check.main(["--dry-run", "--schemes", "dynamic", "nope"])


@pytest.mark.skipif(importlib.util.find_spec("torch") and __import__("torch").cuda.is_available(),
                    reason="a GPU is here")
def test_without_a_gpu_it_points_at_the_dry_run(gpu_check):
    with pytest.raises(SystemExit, match="no CUDA device here; use --dry-run"):
        gpu_check.main([])
