"""CI guards on the compiled decode kernels (issue 37), without a GPU: a fresh compile for the card (through
``scripts/kernel_report.py``, in a process of its own: these tests run the kernels under the interpreter) must not
spill, must fit each card's shared memory, must stay under the register cap, and must not issue more main-loop
instructions per K/V byte than the committed figures (results/gpu/kernel_guard.json, per Triton version).

What is compiled (nothing is cached across runs: a fresh Triton cache each time):
- every preset at issue 37's goal shapes (sm_90a, bf16, head_dim 128, GQA 4, 1 query token);
- on each target, for each tile size and query dtype the launcher can pick, the configuration of the committed report
  that asks the most shared memory (the largest shapes it serves: head_dim 256, 128 query rows).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "results" / "gpu" / "kernel_report.json"
GUARD = ROOT / "results" / "gpu" / "kernel_guard.json"
CONTEXT = 1024  # the code compiled does not depend on it; a short cache builds fast
OTHER_TRITON_SLACK = 1.10  # a Triton release without committed figures: those of the newest one, 10% slack

pytest.importorskip("triton")


def _committed_rows() -> list[dict]:
    return json.loads(REPORT.read_text())["rows"]


def goal_names() -> list[str]:
    return [r["name"] for r in _committed_rows()
            if (r["arch"], r["dtype"], r["head_dim"], r["rows"]) == ("sm_90a", "bf16", 128, "gqa4-q1")]


def shared_names() -> list[str]:
    """Per (target, tile, dtype): the committed configuration asking the most shared memory (partial or merge)."""
    worst: dict[tuple, dict] = {}
    for r in _committed_rows():
        key = (r["arch"], r["tile"], r["dtype"])
        asked = max(r["shared_bytes"], r["merge"]["shared_bytes"])
        if key not in worst or asked > max(worst[key]["shared_bytes"], worst[key]["merge"]["shared_bytes"]):
            worst[key] = r
    return sorted({r["name"] for r in worst.values()} - set(goal_names()))


GOALS, SHARED = goal_names(), shared_names()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("kernel_report")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(out / "triton-cache")  # cache nothing across runs
    subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_report.py"), "--configs", *GOALS, *SHARED,
                    "--context", str(CONTEXT), "--out", str(out), "--quiet"], env=env, check=True, cwd=ROOT)
    return {r["name"]: r for r in json.loads((out / "kernel_report.json").read_text())["rows"]}


@pytest.mark.parametrize("name", GOALS + SHARED)
def test_no_spills_and_under_the_register_cap(compiled, name):
    from hf_asymkv.kernels.sass import REGISTER_CAP

    row = compiled[name]
    assert (row["local_bytes"], row["spill_instructions"]) == (0, 0), f"{name} spills"
    assert (row["merge"]["local_bytes"], row["merge"]["spill_instructions"]) == (0, 0), f"{name}: the merge spills"
    assert row["registers"] < REGISTER_CAP


@pytest.mark.parametrize("name", GOALS + SHARED)
def test_shared_memory_fits_the_card(compiled, name):
    row = compiled[name]
    assert row["shared_bytes"] <= row["shared_limit"], f"{name}: {row['shared_bytes']} B > {row['shared_limit']} B"
    assert row["merge"]["shared_bytes"] <= row["shared_limit"]


def _committed_figure(name: str, version: str) -> float:
    figures = json.loads(GUARD.read_text())["figures"]
    if version in figures and name in figures[version]:
        return figures[version][name]
    newest = max(figures, key=lambda v: tuple(int(p) for p in v.split(".")[:3] if p.isdigit()))
    warnings.warn(f"no committed figures for Triton {version}; comparing with Triton {newest}'s (+10%)", stacklevel=2)
    return figures[newest][name] * OTHER_TRITON_SLACK


@pytest.mark.parametrize("name", GOALS)
def test_instructions_per_byte_at_most_committed(compiled, name):
    import triton

    assert compiled[name]["per_byte"] <= _committed_figure(name, triton.__version__) + 1e-4
