"""CI guards on the compiled decode kernels (issue 37), without a GPU: a fresh compile for the card (through
``scripts/kernel_report.py``, in a process of its own: the other kernel tests run the kernels under the interpreter)
must not spill, must stay under the register cap, must fit the card's shared memory, and must not issue more
main-loop warp instructions per K/V byte than the committed figure (results/gpu/kernel_guard.json, per Triton
version; rewritten by ``scripts/kernel_report.py --guard-into``).

What is compiled, in three processes (one per test, so that pytest-xdist spreads the tests and no configuration is
compiled twice; each process starts from an empty Triton cache):
- every preset at issue 37's goal shapes (sm_90a, bf16, head_dim 128, GQA 4, 1 query token);
- on sm_89, the card with the least shared memory (99 KiB), the launch that asks the most of it at those shapes: the
  128-token tiles of ``balanced`` (the fast path's largest; with 2 pipeline stages it asked 129 KiB);
- every preset at Gemma-3's decode shapes (sm_90a, bf16, head_dim 256, GQA 4, 1 query token): values with two scale
  groups per token, on the fast path since 2026-12-06 (on the generic path they issued 0.8-2.2 warp instructions per
  byte and ``max`` spilled 488 B on sm_80). Registers are not bounded there: ``tight`` takes 254 without
  spilling (``balanced`` 253), and 8 warps would issue more (``balanced`` 17% more when it took 255).

Not guarded (they do not fit, before the rewrite and after: results/gpu/kernel_report_before.md): the largest shapes
the launcher accepts, head_dim 256 with 128 query rows (float32 on sm_90a, bf16 on sm_89).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
GUARD = ROOT / "results" / "gpu" / "kernel_guard.json"
REPORT = ROOT / "results" / "gpu" / "kernel_report.json"  # the committed report: spills and conversions as measured
CONTEXT = 1024  # the code compiled does not depend on it (kernel_report.py); a short cache builds fast
OTHER_TRITON_SLACK = 1.10  # a Triton release without committed figures: the newest release's, 10% slack
GOAL_SHAPE = "bf16-d128-gqa4-q1"
PRESETS = ("quality", "balanced", "lean", "compact", "tight", "max")
GOALS = [f"{preset}-{GOAL_SHAPE}-sm_90a" for preset in PRESETS]
SHARED = [f"balanced-{GOAL_SHAPE}-sm_89"]
GEMMA = [f"{preset}-bf16-d256-gqa4-q1-sm_90a" for preset in PRESETS]
JOINED = ("quality", "compact", "tight", "max")  # 6-bit values (4 + 2), 3-bit values, int3 keys, int3 keys (2 + 1)
CONVERSION_GUARDED = ("balanced", "lean")  # int8 and int4 codes: issue 37 asks <= 0.01 conversions per byte
# Both are under 0.01 since the kernel's query rows pad to 4 (kernel_report.md: balanced 0.0054 since its int8 keys'
# products convert their int32 scores, lean 0.0030 with two key blocks per tile); the bound is 0.01, or a committed
# figure above it.


def _compile(names: list[str], out: Path, *flags: str) -> dict[str, dict]:
    """The report rows of configurations ``names``, compiled now in one process (``flags``: more of kernel_report.py's;
    one process for several configurations: importing torch and transformers costs it ~11 s of each compile's ~18)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(out / "triton-cache")  # an empty cache: compile, do not look up
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_report.py"), "--configs", *names,
                           "--context", str(CONTEXT), "--out", str(out), "--quiet", "--threads", "1", *flags],
                          env=env, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"kernel_report.py failed on {names}:\n{done.stderr[-3000:]}"
    rows = {row["name"]: row for row in json.loads((out / "kernel_report.json").read_text())["rows"]}
    assert sorted(rows) == sorted(names), sorted(rows)
    return rows


def _committed_figure(name: str, version: str) -> float:
    figures = json.loads(GUARD.read_text())["figures"]
    if version in figures:
        return figures[version][name]
    newest = max(figures, key=lambda v: tuple(int(p) for p in v.split(".")[:3] if p.isdigit()))
    warnings.warn(f"no committed figures for Triton {version}; comparing with Triton {newest}'s (+10%)", stacklevel=2)
    return figures[newest][name] * OTHER_TRITON_SLACK


def _committed_row(name: str) -> dict | None:
    return next((r for r in json.loads(REPORT.read_text())["rows"] if r["name"] == name), None)


def _resource_problems(row: dict, register_cap: bool = True) -> list[str]:
    from hf_asymkv.kernels.sass import REGISTER_CAP

    name, problems = row["name"], []
    was = _committed_row(name) or {"local_bytes": 0, "spill_instructions": 0}
    if row["local_bytes"] > was["local_bytes"] or row["spill_instructions"] > was["spill_instructions"]:
        problems.append(f"{name} spills: {row['local_bytes']} B, {row['spill_instructions']} LDL/STL")
    if (row["merge"]["local_bytes"], row["merge"]["spill_instructions"]) != (0, 0):
        problems.append(f"{name}: the merge spills")
    if register_cap and row["registers"] >= REGISTER_CAP:
        problems.append(f"{name}: {row['registers']} registers")
    # JOIN_ASM rotates four packed bytes by the first one's amount: they must be one token's channels
    if row["join_problems"]:
        problems.append(f"{name}: {row['join_problems']}")
    for kernel, used in (("partial", row["shared_bytes"]), ("merge", row["merge"]["shared_bytes"])):
        if used > row["shared_limit"]:
            problems.append(f"{name}: the {kernel} kernel asks {used} B > {row['shared_limit']} B")
    return problems


def _instruction_problems(row: dict) -> list[str]:
    import triton

    committed = _committed_figure(row["name"], triton.__version__)
    if row["per_byte"] > committed + 1e-4:
        return [f"{row['name']}: {row['per_byte']:.4f} warp instr/byte > {committed:.4f}"]
    return []


@pytest.mark.slow(reason="compiles the decode kernel for sm_90a/sm_89 with Triton and reads its SASS (~45 s of CPU "
                         "each); fast twin: tests/kernels/test_kernel_guards.py::test_guard_file_names_every_goal")
def test_goal_shapes_within_committed_instructions(tmp_path):
    # every preset at the goal shapes, and sm_89's largest tiles (SHARED), compiled in one process
    rows = _compile(GOALS + SHARED, tmp_path)
    problems = [p for name in SHARED for p in _resource_problems(rows[name])]
    for name in GOALS:
        row = rows[name]
        problems += _resource_problems(row) + _instruction_problems(row)
        if row["preset"] in CONVERSION_GUARDED:
            bound = max(0.01, _committed_row(name)["per_byte_by_class"]["conversion"])
            if row["per_byte_by_class"]["conversion"] > bound + 1e-5:
                problems.append(f"{name}: {row['per_byte_by_class']['conversion']:.4f} conversions per byte")
        # codes of two plane sets are joined into one operand (keys of tight and max, values of quality and compact):
        # the layout check above is not vacuous there
        if (row["joined_ops"] > 0) != (row["preset"] in JOINED):
            problems.append(f"{name}: {row['joined_ops']} joins")
    assert not problems, "\n".join(problems)


@pytest.mark.slow(reason="compiles the decode kernel for sm_90a/sm_89 with Triton and reads its SASS (~45 s of CPU "
                         "each); fast twin: tests/kernels/test_kernel_guards.py::test_guard_file_names_every_goal")
def test_head_dim_256_within_committed_instructions(tmp_path):
    rows = _compile(GEMMA, tmp_path)
    problems = [p for name in GEMMA for p in _resource_problems(rows[name], register_cap=False)
                + _instruction_problems(rows[name])]
    assert not problems, "\n".join(problems)


def test_guard_file_names_every_goal():
    figures = json.loads(GUARD.read_text())["figures"]
    for version, by_name in figures.items():
        missing = sorted(set(GOALS + GEMMA) - set(by_name))
        assert not missing, f"Triton {version}: no figure for {missing}"


@pytest.mark.slow(reason="compiles the decode kernel for sm_90a/sm_89 with Triton and reads its SASS (~45 s of CPU "
                         "each); fast twin: tests/kernels/test_kernel_guards.py::test_guard_file_names_every_goal")
def test_source_lines_account_for_the_whole_code_loop(tmp_path):
    # kernel_report.py --lines: the code loop's instructions by source line (nvdisasm's line table) sum to the loop the
    # report counts, the most expensive line is the codes' own (in triton_codes.py), and the lines name what each
    # format compiles to: the values' conversion (PRMT) and the int8 keys' products (IMMA)
    name = f"balanced-{GOAL_SHAPE}-sm_90a"
    row = _compile([name], tmp_path, "--lines", "1000")[name]
    assert sum(entry["instructions"] for entry in row["lines"]) == row["loop_instructions"]
    assert row["lines"][0]["file"] == "triton_codes.py", row["lines"][0]
    ops = [entry["opcodes"] for entry in row["lines"] if entry["file"] == "triton_codes.py"]
    assert any(o.get("PRMT", 0) >= 64 for o in ops) and sum(o.get("IMMA", 0) for o in ops) == 16, ops
