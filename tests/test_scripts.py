"""scripts/ holds only what the docs cite; one-off studies live in scripts/studies/, each with a line in its README."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
DOCS = "".join(page.read_text() for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").iterdir() if p.is_file() and p.suffix in (".py", ".sh"))
STUDIES = sorted(p.name for p in (ROOT / "scripts" / "studies").glob("*.py"))


@pytest.mark.parametrize("name", SCRIPTS, ids=SCRIPTS)
def test_every_script_is_cited_by_the_docs(name):
    assert f"scripts/{name}" in DOCS, f"scripts/{name} is cited nowhere in README.md or docs/: a study belongs in scripts/studies/"


@pytest.mark.parametrize("name", STUDIES, ids=STUDIES)
def test_every_study_says_what_it_measured_and_when(name):
    rows = [line for line in (ROOT / "scripts" / "studies" / "README.md").read_text().splitlines()
            if line.startswith(f"| `{name}` |")]
    assert len(rows) == 1, f"scripts/studies/README.md has no row for {name}"
    what, when = [cell.strip() for cell in rows[0].strip("|").split("|")][1:3]
    assert what and when[:4].isdigit(), rows[0]


def test_llmcompressor_studies_find_the_committed_fixture():
    """Both scripts moved one folder down: their paths to the test fixture must still resolve."""
    fixture = load_script("studies/llmcompressor_kv_fixture").OUT
    assert fixture == load_script("studies/compare_llmcompressor").FIXTURE
    assert (fixture / "config.json").is_file()
