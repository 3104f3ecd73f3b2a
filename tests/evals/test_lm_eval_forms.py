"""`hf-asymkv eval lm-eval` in the forms of hf_asymkv.evals.forms: full precision answers as lm-eval's own HF wrapper
in every form, the question found in RULER's documents (or refused clearly), and the CI smoke of both new forms at a
tiny length, offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import save_tiny_model
from helpers import cli_exit_code, refuse_network

pytest.importorskip("lm_eval")
pytest.importorskip("punkt")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from hf_asymkv.evals.lm_eval_model import SchemeLM  # noqa: E402
from hf_asymkv.evals.lm_eval_store import ResponseStore  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

FORMS = ("one-pass", "question", "chunk40")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    refuse_network(monkeypatch)


@pytest.fixture(scope="module")
def wrappers(tmp_path_factory):
    """``(lm-eval's HFLM, our SchemeLM: full precision in every form)`` over the same tiny model."""
    from hf_asymkv.models import load_model

    model, tokenizer = load_model(str(save_tiny_model(tmp_path_factory.mktemp("forms") / "llama")))
    ours = SchemeLM(model, tokenizer, ["dynamic"], ResponseStore(None, {}), forms=FORMS[:2], shared_chunk=64)
    ours.variants.append("dynamic@chunk40")
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1), ours


def _ruler_request(i: int, text: str | None = None) -> Instance:
    """A RULER-shaped request: the document's ``input`` ends with its question line; the context adds the answer's
    prefix after it, as lm-eval's ``gen_prefix`` does."""
    doc_input = text or ("A special magic number is hidden in the text below.\n" + "The grass is green. " * 9
                         + f"The number is {i}{i}.\nWhat is the special magic number mentioned in the text?")
    context = doc_input + " The special magic number is"
    return Instance("generate_until", {"input": doc_input}, (context, {"until": ["."], "max_gen_toks": 16,
                                                                      "do_sample": False}), i,
                    metadata=("niah", i, 1))


@pytest.mark.parametrize("form", ["dynamic", "dynamic@question", "dynamic@chunk40"], ids=FORMS)
def test_full_precision_answers_are_lm_evals_own_in_every_form(wrappers, form):
    hflm, ours = wrappers
    requests = [_ruler_request(i) for i in range(3)]
    ours.scheme = form
    assert ours.generate_until(requests) == hflm.generate_until(requests)


def test_a_document_without_a_question_line_is_refused(wrappers):
    _, ours = wrappers
    ours.scheme = "dynamic@question"
    with pytest.raises(ValueError, match="cannot tell the question from the document"):
        ours.generate_until([_ruler_request(7, text="one line only, no question")])


def _run(tiny: Path, out: Path, *extra: str) -> int:
    return cli_exit_code(["eval", "lm-eval", "--model", str(tiny), "--schemes", "dynamic,asymkv-balanced", "--tasks",
                          "niah_single_1", "--limit", "1", "--max-length", "512", "--out", str(out),
                          "--forms", "one-pass,question", "--prefill-chunk", "128", "--shared-prefill-chunk", "200",
                          *extra])


@pytest.mark.slow(reason="lm-eval's RULER generator, both forms end to end (CI runs it in the slow tier); fast twin: "
                         "tests/evals/test_lm_eval_forms.py::test_full_precision_answers_are_lm_evals_own_in_every_form")
def test_ci_smoke_both_forms_side_by_side(tmp_path):
    out = tmp_path / "out"
    assert _run(save_tiny_model(tmp_path / "llama"), out) == 0
    data = json.loads((out / "lm_eval.json").read_text())
    assert data["forms"] == ["one-pass", "question", "chunk128"]
    names = ["dynamic", "asymkv-balanced", "dynamic@question", "asymkv-balanced@question", "dynamic@chunk128",
             "asymkv-balanced@chunk128"]
    assert sorted(data["tasks"]["niah_single_1"]["scores"]) == sorted(names)
    rows = [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]
    assert rows[0]["settings"]["shared_prefill_chunk"] == 200
    answers, cost = rows[1]["answers"], rows[1]["cost"]
    assert sorted(answers) == sorted(names) and 0 < cost["question_tokens"] < cost["prompt_tokens"]
    assert answers["dynamic@question"] == answers["dynamic"] == answers["dynamic@chunk128"]
    table = (out / "lm_eval.md").read_text()
    assert "| niah_single_1 (n=1), one-pass | niah_single_1 (n=1), question | niah_single_1 (n=1), chunk128 |" in table
    assert "question minus one-pass" in table


def test_an_unknown_form_is_refused(tmp_path, capsys):
    argv = ["eval", "lm-eval", "--forms", "bogus", "--tasks", "niah_single_1", "--model", str(tmp_path)]
    assert cli_exit_code(argv) == 2
    assert "unknown form(s) ['bogus']" in capsys.readouterr().err
