"""scripts/soak.py (issue 56): many requests in one process leave no process-wide table growing. A benchmark that
prints (RSS and every table per checkpoint), not a timed test: RSS is printed, the tables are checked."""

from __future__ import annotations

import pytest
from helpers import load_script

soak = load_script("soak")


def test_twenty_requests_grow_no_table(tmp_path, single_thread, capsys):
    """Two presets x five kinds, twice: the tables after the first round equal those after the second."""
    out = tmp_path / "soak.md"
    verdict = soak.main(["--requests", "20", "--every", "10", "--baseline", "10", "--presets", "lean,compact",
                         "--kinds", "new,reuse,crop,beam,static", "--max-prompt", "100", "--max-new", "6", "--out",
                         str(out)])
    assert verdict["grown_tables"] == {}, verdict
    assert "| 20 |" in out.read_text() and "RSS growth" in capsys.readouterr().out


@pytest.mark.slow(reason="200 requests of every preset and kind on the tiny model: ~60 s; fast twin: "
                         "tests/test_soak.py::test_twenty_requests_grow_no_table")
def test_two_hundred_requests_grow_no_table(tmp_path, single_thread, capsys):
    """The CI soak: every preset x every kind (42 requests a round), 200 requests."""
    verdict = soak.main(["--requests", "200", "--every", "50", "--baseline", "50", "--out", str(tmp_path / "s.md")])
    with capsys.disabled():
        print(f"\nsoak, 200 requests: RSS growth from request 50 {verdict['rss_growth']:+.2%}, "
              f"grown tables {verdict['grown_tables'] or 'none'}, gc objects {verdict['gc_objects']}")
    assert verdict["grown_tables"] == {}, verdict
