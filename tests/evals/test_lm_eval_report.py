"""The intervals and tables of `eval lm-eval`, and the response file that lets a long run resume (no lm-eval needed)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hf_asymkv.evals.lm_eval_report import compare_schemes, lm_eval_markdown, paired_difference, wilson_interval
from hf_asymkv.evals.lm_eval_store import ResponseStore, request_key


@pytest.mark.parametrize(("mean", "n", "expected"), [(0.5, 50, (0.3664, 0.6336)), (1.0, 50, (0.9287, 1.0)),
                                                     (0.0, 20, (0.0, 0.1611))], ids=["half", "all", "none"])
def test_wilson_interval_matches_hand_computed_values(mean, n, expected):
    lo, hi = wilson_interval(mean, n)
    assert (lo, hi) == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize(("mean", "n"), [(1.2, 10), (0.5, 0)], ids=["mean", "n"])
def test_wilson_interval_refuses_what_is_not_a_proportion(mean, n):
    with pytest.raises(ValueError, match=f"n={n}, mean={mean}"):
        wilson_interval(mean, n)


def test_paired_difference_counts_and_interval():
    got = paired_difference([1, 0, 1, 1], [1, 1, 1, 0])
    assert got["diff"] == 0 and (got["lower"], got["higher"]) == (1, 1)
    lo, hi = got["diff_interval"]
    assert lo == pytest.approx(-hi) and hi == pytest.approx(1.959964 * (2 / 3) ** 0.5 / 2)
    assert paired_difference([1, 0], [1, 0])["diff_interval"] == (0.0, 0.0)
    with pytest.raises(ValueError, match="equally long"):
        paired_difference([1], [1, 0])


def test_compare_and_markdown_say_where_a_scheme_falls_outside():
    full = [1.0] * 45 + [0.0] * 5  # 0.90, Wilson [0.786, 0.957]
    compared = {"niah": compare_schemes({"dynamic": full, "good": full[:-1] + [1.0], "bad": [0.0] * 10 + full[10:]})}
    rows = compared["niah"]
    assert rows["good"]["within"] and not rows["bad"]["within"]
    assert rows["bad"]["lower"] == 10 and rows["bad"]["diff"] == pytest.approx(-0.2)
    table = lm_eval_markdown(compared, {"dynamic": "full"}, "T", skipped={"hf-fp8": "refuses sliding layers"})
    assert "| full | 0.90 [0.79, 0.96] |" in table
    assert "| bad | 0.70 [0.56, 0.81] -0.20 **out** |" in table
    assert "- bad, niah: 0.70, 0.09 below the interval [0.79, 0.96] (10 samples lower, 0 higher)" in table
    assert "- hf-fp8: not run (refuses sliding layers)" in table and "### niah" in table


def _request(task="t", doc=0):
    return SimpleNamespace(task_name=task, doc_id=doc)


def test_store_keeps_answers_and_a_rerun_finds_them(tmp_path):
    path, settings = tmp_path / "r.jsonl", {"model": "m", "max_length": 4096}
    store = ResponseStore(path, settings)
    key = request_key("generate_until", "prompt", ["</s>"], 128, True)
    assert store.missing(key, ["dynamic", "b"]) == ["dynamic", "b"]
    store.add(key, _request(), {"dynamic": {"text": " 1"}, "b": {"text": " 2"}})
    again = ResponseStore(path, settings)
    assert again.missing(key, ["dynamic", "b", "c"]) == ["c"] and again.get(key, "b") == {"text": " 2"}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0] == {"settings": settings} and rows[1]["task"] == "t" and rows[1]["doc_id"] == 0
    assert request_key("generate_until", "prompt", ["</s>"], 128, False) != key


@pytest.mark.parametrize(("content", "message"), [(None, r"other settings \(\{'max_length': \(4096, 8192\)\}"),
                                                  ("not json\n", "not a response file")], ids=["settings", "garbage"])
def test_store_refuses_a_file_it_cannot_resume(tmp_path, content, message):
    path = tmp_path / "r.jsonl"
    if content is None:
        ResponseStore(path, {"max_length": 4096})
    else:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        ResponseStore(path, {"max_length": 8192})
