"""scripts/kernel_report.py and hf_asymkv.bench.kernel_report without compiling (the compiles run in
tests/kernels/test_kernel_guards.py): configuration names, bad flags, the markdown with its before column."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import load_script

from hf_asymkv.bench import kernel_report as kr


@pytest.fixture(scope="module")
def script():
    return load_script("kernel_report")


def test_configuration_names_round_trip():
    config = kr.Config.parse("compact-fp16-d64-gqa4-q5-sm_89")
    assert (config.preset, config.dtype, config.head_dim, config.rows, config.arch) == ("compact", "fp16", 64,
                                                                                        "gqa4-q5", "sm_89")
    assert config.name == "compact-fp16-d64-gqa4-q5-sm_89"


BAD_NAMES = {"no-form": ("balanced", "expected PRESET-DTYPE"),
             "preset": ("fastest-bf16-d128-gqa4-q1-sm_90a", "unknown preset 'fastest'; allowed: \\['quality'"),
             "target": ("balanced-bf16-d128-gqa4-q1-sm_70", "unknown target 'sm_70'; allowed: \\['sm_90a'")}


@pytest.mark.parametrize("case", list(BAD_NAMES), ids=list(BAD_NAMES))
def test_bad_configuration_names_are_refused(case):
    name, message = BAD_NAMES[case]
    with pytest.raises(ValueError, match=message):
        kr.Config.parse(name)


BAD_FLAGS = {"baseline": (["--baseline", "/nonexistent/kernel_report.json"], "--baseline /nonexistent"),
             "context": (["--context", "100"], "--context must be >= 512"),
             "head-dim": (["--head-dims", "512"], "--head-dims must be in \\[1, 256\\], got \\[512\\]"),
             "configs": (["--configs", "balanced-bf16"], "expected PRESET-DTYPE"),
             "lines": (["--lines", "-3"], "--lines must be >= 0 \\(source lines to print per configuration\\), got -3")}


@pytest.mark.parametrize("case", list(BAD_FLAGS), ids=list(BAD_FLAGS))
def test_bad_flags_exit_with_a_message(script, case, capsys):
    argv, message = BAD_FLAGS[case]
    with pytest.raises(SystemExit):
        script.parse_args(argv)
    assert re.search(message, capsys.readouterr().err)


def test_a_baseline_of_another_shape_is_refused_before_compiling(script, capsys):
    guard = Path(__file__).resolve().parents[2] / "results" / "gpu" / "kernel_guard.json"  # JSON, not a report
    with pytest.raises(SystemExit):
        script.parse_args(["--baseline", str(guard)])
    assert re.search(r"--baseline .*kernel_guard\.json: not a kernel_report\.json .*'meta'", capsys.readouterr().err)


def _row(preset: str, per_byte: float) -> dict:
    """A report row of the goal shape with made-up counts (this test reads the table, not the figures)."""
    classes = dict.fromkeys(("global", "conversion", "integer", "float", "mma", "shared_sync", "other"), 0.01)
    return {"preset": preset, "dtype": "bf16", "head_dim": 128, "rows": "gqa4-q1", "arch": "sm_90a",
            "name": f"{preset}-bf16-d128-gqa4-q1-sm_90a", "tile": 64, "num_warps": 4, "num_stages": 1,
            "tile_bytes": 1000.0, "registers": 100, "local_bytes": 0, "spill_instructions": 0, "shared_bytes": 1024,
            "loop_instructions": 10, "per_byte": per_byte, "per_byte_by_class": classes,
            "merge": {"registers": 32, "local_bytes": 0, "spill_instructions": 0, "shared_bytes": 0},
            "shared_limit": 227 * 1024}


def test_markdown_puts_the_baseline_beside(tmp_path):
    meta = {"command": "python scripts/kernel_report.py", "triton": "3.6.0", "torch": "2.13.0", "commit": "abc1234",
            "context": 1024}
    earlier = {"meta": {**meta, "commit": "0b85056"}, "rows": [_row("balanced", 0.318)]}
    path = tmp_path / "before.json"
    path.write_text(json.dumps(earlier))
    report = {"meta": meta, "rows": [_row("balanced", 0.2), _row("max", 1.5)], "baseline": kr.baseline(path)}
    text = kr.markdown(report)
    assert "| balanced | 64 | 4 | 1 | 1000 | **0.200** | 0.318 | 0.10 |" in text
    assert "| max | 64 | 4 | 1 | 1000 | **1.500** | - | 0.25 |" in text  # no figure before
    assert "at commit 0b85056" in text and "| H200 | sm_90a | 132 | 1.98 | 4.8 | 0.218 |" in text
