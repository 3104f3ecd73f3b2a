"""scripts/layer_step.py: a tiny run writes its table; bad flags exit 2 with argparse's message."""

from __future__ import annotations

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def layer_step():
    return load_script("layer_step")


def test_small_run_writes_table(layer_step, tmp_path, monkeypatch, single_thread):
    monkeypatch.setattr(layer_step, "REPEATS", 2)
    out = tmp_path / "step.md"
    layer_step.main(["--lengths", "384", "--out", str(out)])
    text = out.read_text()
    assert "--lengths 384 --threads 1" in text and text.count("\n| 384 |") == 1


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "4k"], "expected comma-separated integers, got '4k'"),
    (["--lengths", "0"], "expected positive integers, got '0'"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--lengths", "1024,200"], "--lengths must be >= 256 (window + one block, so that something is quantized), got 200"),
], ids=["not-a-number", "zero-length", "zero-threads", "nothing-quantized"])
def test_bad_flags_exit_2(layer_step, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        layer_step.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
