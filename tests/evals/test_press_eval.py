"""`hf-asymkv eval press` without kvpress: its arguments refused with a message, the install command named before
the model loads, unknown presses and ratios refused, and the table's arithmetic (bytes, exact share, flips)."""

from __future__ import annotations

import re
import sys

import pytest
from helpers import cli_exit_code

from hf_asymkv.evals.press_eval import PressRun, preset_label
from hf_asymkv.evals.press_report import press_markdown, press_summary
from hf_asymkv.evals.presses import MissingExtraError, make_press, require_kvpress


@pytest.mark.parametrize("argv, message", [
    (["--compression-ratio", "1.0"], r"expected a number in \[0, 1\) \(the fraction of tokens a press drops\), "
                                     r"got '1.0'"),
    (["--compression-ratio", "half"], r"got 'half'"),
    (["--presses", "KnormPress,FooPress"], r"FooPress"),
    (["--presets", "tiny"], r"tiny"),
    (["--window", "-1"], r"argument --window: must be >= 0, got -1"),
], ids=["ratio-1", "ratio-text", "press", "preset", "window"])
def test_eval_press_refuses_a_bad_argument(argv, message, capsys):
    assert cli_exit_code(["eval", "press", *argv]) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.fixture
def no_kvpress(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvpress", None)  # `import kvpress` raises ImportError


def test_without_kvpress_the_command_names_the_install_before_loading_a_model(no_kvpress, monkeypatch, capsys):
    import hf_asymkv.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded a model without kvpress"))
    assert cli_exit_code(["eval", "press", "--lengths", "512", "--quiet"]) != 0
    assert re.search(r'^error: presses come from NVIDIA kvpress, which is not installed .*: pip install kvpress '
                     r'"transformers>=5.0,<5.3"$', capsys.readouterr().err.strip())
    with pytest.raises(MissingExtraError, match=r"presses come from NVIDIA kvpress"):
        require_kvpress()


@pytest.mark.parametrize("name, ratio, message", [
    ("FooPress", 0.5, r"unknown press 'FooPress'; presses: \['ExpectedAttentionPress', 'SnapKVPress'"),
    ("KnormPress", 1.0, r"compression ratio must be in \[0, 1\) .*got 1.0"),
    ("KnormPress", -0.1, r"got -0.1"),
], ids=["name", "ratio-1", "ratio-negative"])
def test_make_press_refuses_before_importing_kvpress(no_kvpress, name, ratio, message):
    with pytest.raises(ValueError, match=message):
        make_press(name, ratio)


def test_a_preset_with_its_window_overridden_is_named_so():
    assert preset_label("compact", None) == "compact" and preset_label("compact", 16) == "compact, window 16"


def _run(run: str, press: str, preset: str, length: int, depth: float, correct: bool, nbytes: int, exact: int,
         kept: int = 100) -> PressRun:
    return PressRun(run, press, preset, "single", length, depth, 0, 100, kept, nbytes, nbytes, exact, 4000, "42",
                    correct, 0.0 if run == "full" else 0.5, 0.1 if press and preset else float("nan"))


def test_the_summary_adds_bytes_per_length_exact_share_and_flips():
    runs = []
    for length, depth, full_ok, press_ok, both_ok in ((2048, 0.2, True, True, False), (4096, 0.5, True, False, True)):
        runs += [_run("full", "", "", length, depth, full_ok, 4000, 4000),
                 _run("KnormPress", "KnormPress", "", length, depth, press_ok, 2000, 2000, kept=50),
                 _run("KnormPress x compact", "KnormPress", "compact", length, depth, both_ok, 500, 100, kept=50)]
    rows = {r["run"]: r for r in press_summary(runs)}
    both = rows["KnormPress x compact"]
    assert list(rows) == ["full", "KnormPress", "KnormPress x compact"]
    assert both["x_smaller"] == 8.0 and both["x_smaller_by_length"] == {"2048": 8.0, "4096": 8.0}
    assert both["exact_share"] == 0.2 and rows["full"]["exact_share"] == 1.0
    assert both["lost_gained_vs_full"] == (1, 0) and both["lost_gained_vs_press"] == (1, 1)
    assert rows["KnormPress"]["lost_gained_vs_press"] is None and both["kept_fraction"] == 0.5
    table = press_markdown(list(rows.values()), 2, 0.5)
    assert "| KnormPress x compact | 50% | 0.0 | 20% | 8.00 | 8.00 | 8.00 | 50% | 1 / 0 | 1 / 1 |" in table
