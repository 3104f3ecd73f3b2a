"""The frontier figure stays legible with the 25 schemes of a real run: no label covers another, counts get
integer ticks, one panel per measured metric (tail KL included), and `eval report` redraws a committed run from
its JSON."""

from __future__ import annotations

import json
import shutil
from itertools import combinations
from pathlib import Path

import pytest

from hf_asymkv.cli import main
from hf_asymkv.evals.frontier import FrontierRow
from hf_asymkv.evals.frontier_plot import PANELS, frontier_title, plot_frontier
from hf_asymkv.plots import count_axis, place_labels, require_matplotlib

RESULTS = Path(__file__).resolve().parents[2] / "results" / "frontier"
SMOLLM2 = RESULTS / "smollm2" / "frontier.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows() -> list[FrontierRow]:
    return [FrontierRow(**row) for row in json.loads(SMOLLM2.read_text())["rows"]]


@pytest.fixture
def plt():
    plt = require_matplotlib()
    yield plt
    plt.close("all")


def _label_boxes(ax):
    renderer = ax.figure.canvas.get_renderer()
    return [t.get_window_extent(renderer) for t in ax.texts if t.get_text()]


@pytest.mark.parametrize("field", ["lost", "tail_kl"], ids=["count-panel", "log-panel"])
def test_labels_of_the_25_committed_schemes_do_not_overlap(plt, field):
    """The committed SmolLM2 run: 15 schemes share 0 prompts lost, 4 peers sit at 3.55-3.56x."""
    rows = [r for r in _rows() if r.kind != "reference"]
    fig, ax = plt.subplots(figsize=(6.2, 4.6))
    points = [(r.x_smaller, getattr(r, field), str(n), "black") for n, r in enumerate(rows, 1)]
    ax.scatter([p[0] for p in points], [p[1] for p in points])
    if field == "lost":
        count_axis(ax, [int(p[1]) for p in points])
    else:
        ax.set_yscale("log")
    fig.canvas.draw()
    place_labels(ax, points)
    boxes = _label_boxes(ax)
    assert len(boxes) == 24
    assert not [(a, b) for a, b in combinations(boxes, 2) if a.overlaps(b)]


def test_a_count_axis_has_integer_ticks_and_shows_zero(plt):
    fig, ax = plt.subplots()
    ax.scatter([1, 2, 3], [0, 0, 0])
    count_axis(ax, [0, 0, 0])
    fig.canvas.draw()
    ticks = [t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
    assert ticks == [int(t) for t in ticks] and 0 in ticks  # not -0.04 .. 0.04
    assert ax.get_ylim() == (-0.5, 1.5)


@pytest.mark.slow(reason="draws the full frontier figure; fast twin: "
                         "tests/evals/test_frontier_plot.py::test_a_count_axis_has_integer_ticks_and_shows_zero")
def test_one_panel_per_measured_metric_and_the_number_table(plt, tmp_path, monkeypatch):
    drawn = []
    real = plt.Figure.add_subplot

    def record(fig, *args, **kwargs):
        ax = real(fig, *args, **kwargs)
        drawn.append(ax)
        return ax

    monkeypatch.setattr(plt.Figure, "add_subplot", record)
    rows = _rows()
    for r in rows:
        r.attention_kl = float("nan")  # not measured: its panel is left out
        r.decode_kl = r.tail_kl * 2  # measured (the committed run has no long decode): its panel is drawn
    path = plot_frontier(rows, "t", tmp_path / "f.png")
    assert path.read_bytes().startswith(PNG_MAGIC)
    labels = [ax.get_ylabel().split("\n")[0] for ax in drawn if ax.axison]
    assert labels == [label for label, field, _ in PANELS if field != "attention_kl"]
    table = [t.get_text() for ax in drawn if not ax.axison for t in ax.texts]
    assert table[0].split() == ["#", "scheme", "(x", "smaller)"] and len(table) == 1 + 24
    assert table[1].split() == ["1", "asymkv-v8", "(1.84)"]  # numbered by compression


def test_title_counts_in_words():
    meta = {"model": "org/m", "lengths": [2048], "depths": [0.5], "tasks": ["single"], "samples": 1,
            "ppl_length": 2048, "ppl_windows": 1}
    assert frontier_title(meta) == ("m: damage per byte, ours vs peers (1 needle prompt at 2048 tokens; Δppl on 1 "
                                    "2048-token text window)")


@pytest.mark.slow(reason="redraws a committed run's figure; fast twin: "
                         "tests/evals/test_frontier_plot.py::test_a_count_axis_has_integer_ticks_and_shows_zero")
def test_report_redraws_a_committed_run_from_its_json(tmp_path, capsys):
    folder = tmp_path / "smollm2"
    shutil.copytree(SMOLLM2.parent, folder)
    (folder / "frontier.png").unlink()
    assert main(["eval", "report", str(folder)]) == 0
    table = (folder / "frontier.md").read_text()
    assert table.startswith("Command: `hf-asymkv eval frontier") and "no setting of ours reaches this compression" in table
    assert "vs - WORSE" not in table and table.split("\n", 2)[2].strip() == capsys.readouterr().out.strip()
    assert (folder / "frontier.png").read_bytes().startswith(PNG_MAGIC)
