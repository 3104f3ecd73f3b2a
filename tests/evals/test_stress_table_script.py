"""scripts/stress_table.py: plain vs stress attention KL per scheme from two attention.json files; a stress file
that was not measured with --stress-outliers is refused."""

from __future__ import annotations

import json

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def stress_table():
    return load_script("stress_table")


def write(path, kl: dict[str, list[float]], stress: dict | None = None):
    meta = {"command": f"hf-asymkv eval attention --out {path.parent}", **({"stress_outliers": stress} if stress else {})}
    path.write_text(json.dumps({"meta": meta, "rows": [{"scheme": s, "kl": v} for s, v in kl.items()]}))
    return path


def test_table_rows_by_stress_kl(stress_table, tmp_path):
    base = write(tmp_path / "base.json", {"dynamic": [0, 0, 0], "a": [1e-3, 1e-3, 1e-3], "b": [1e-3, 2e-3, 3e-3]})
    hit = write(tmp_path / "hit.json", {"dynamic": [0, 0, 0], "a": [1e-1, 1e-3, 4e-1], "b": [1e-3, 2e-3, 3e-3]},
                {"spec": "qwen"})
    assert stress_table.main(["--base", str(base), "--stress", str(hit), "--out", str(tmp_path / "t.md")]) == 0
    lines = (tmp_path / "t.md").read_text().splitlines()
    assert "`--stress-outliers qwen`" in lines[0]
    assert lines[-2] == "| b | 2.00e-03 | 2.00e-03 | 1.00 | 1.0e-03 -> 1.0e-03 | 3.0e-03 -> 3.0e-03 | L2 (3.0e-03) |"
    assert lines[-1] == "| a | 1.00e-03 | 1.67e-01 | 167.00 | 1.0e-03 -> 1.0e-01 | 1.0e-03 -> 4.0e-01 | L2 (4.0e-01) |"


def test_a_stress_file_without_outliers_is_refused(stress_table, tmp_path, capsys):
    base = write(tmp_path / "base.json", {"a": [1e-3]})
    assert stress_table.main(["--base", str(base), "--stress", str(base), "--out", str(tmp_path / "t.md")]) == 2
    assert "was not measured with --stress-outliers" in capsys.readouterr().err
    assert not (tmp_path / "t.md").exists()
