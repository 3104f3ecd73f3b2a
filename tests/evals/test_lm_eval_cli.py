"""`hf-asymkv eval lm-eval` end to end, offline (every socket refused): lm-eval's RULER niah_single_1, two samples,
two schemes, on a tiny random Llama with a character tokenizer; the run resumes from its response file; bad input is
refused before the model loads; and our lm-eval model answers as lm-eval's own HF wrapper does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import save_tiny_model
from helpers import cli_exit_code, refuse_network

pytest.importorskip("lm_eval")
pytest.importorskip("punkt")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from hf_asymkv.evals import lm_eval_model  # noqa: E402
from hf_asymkv.evals.lm_eval_model import SchemeLM, answers_complete  # noqa: E402
from hf_asymkv.evals.lm_eval_store import ResponseStore  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    refuse_network(monkeypatch)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("lm_eval") / "llama")


def run(tiny: Path, out: Path, *extra: str) -> int:
    return cli_exit_code(["eval", "lm-eval", "--model", str(tiny), "--schemes", "dynamic,asymkv-balanced", "--tasks",
                          "niah_single_1", "--limit", "2", "--max-length", "1024", "--out", str(out), *extra])


@pytest.mark.slow(reason="lm-eval's RULER generator and two schemes end to end; fast twin: "
                         "tests/evals/test_lm_eval_cli.py::test_full_precision_answers_are_lm_evals_own")
def test_two_ruler_samples_two_schemes_offline_then_resumed(tiny, tmp_path, monkeypatch, capsys):
    assert run(tiny, tmp_path) == 0
    data = json.loads((tmp_path / "lm_eval.json").read_text())
    task = data["tasks"]["niah_single_1"]
    assert data["schemes"] == ["dynamic", "asymkv-balanced"] and data["skipped"] == {}
    assert task["metric"] == "1024" and task["doc_ids"] == [0, 1]
    assert {s: len(v) for s, v in task["scores"].items()} == {"dynamic": 2, "asymkv-balanced": 2}
    assert set(task["compared"]["asymkv-balanced"]) >= {"score", "interval", "diff", "diff_interval", "within"}
    assert data["meta"]["command"].startswith("hf-asymkv eval lm-eval --model ")
    rows = [json.loads(line) for line in (tmp_path / "responses.jsonl").read_text().splitlines()]
    assert rows[0]["settings"]["max_length"] == 1024 and len(rows) == 3
    assert all(set(r["answers"]) == {"dynamic", "asymkv-balanced"} and r["task"] == "niah_single_1" for r in rows[1:])
    assert all(0 < a["tokens"] <= 128 for r in rows[1:] for a in r["answers"].values())
    table = (tmp_path / "lm_eval.md").read_text()
    assert table.startswith("Command: `hf-asymkv eval lm-eval") and "| asymkv-balanced |" in table
    capsys.readouterr()

    def no_model(*args, **kwargs):
        raise AssertionError("a resumed run must not answer again")

    monkeypatch.setattr(lm_eval_model, "generate_per_scheme", no_model)
    assert run(tiny, tmp_path) == 0
    assert json.loads((tmp_path / "lm_eval.json").read_text())["tasks"]["niah_single_1"]["scores"] == task["scores"]
    assert run(tiny, tmp_path, "--stop-when-scored") == 2
    assert "other settings" in capsys.readouterr().err


@pytest.mark.parametrize(("extra", "message"), [
    (["--tasks", "ruler_qa_squad"], "cannot run offline"),
    (["--tasks", "niah_single_1,niah_single_1"], "tasks repeated"),
    (["--tasks", "niah_single_1", "--haystack", "/no/such/haystack"], "no such file or folder"),
    (["--tasks", "niah_single_1", "--schemes", "dynamic,bogus"], "unknown cache scheme"),
    (["--tasks", "niah_single_1", "--max-length", "100"], "must be >= 256, got 100"),
    (["--tasks", "niah_single_1", "--max-length", "4096"], "exceed the model's max_position_embeddings"),
], ids=["network-task", "repeated", "haystack", "scheme", "too-short", "too-long"])
def test_bad_input_is_refused_before_anything_runs(tiny, tmp_path, capsys, extra, message):
    argv = ["eval", "lm-eval", "--model", str(tiny), "--out", str(tmp_path / "o"), *extra]
    assert cli_exit_code(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o" / "responses.jsonl").exists()


def test_missing_lm_eval_names_the_extra(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    assert run(tiny, tmp_path) == 2
    assert 'pip install "hf-asymkv[eval-lm]"' in capsys.readouterr().err


@pytest.fixture(scope="module")
def wrappers(tiny):
    """``(lm-eval's HFLM, our SchemeLM with full precision only)`` over the same tiny model."""
    from hf_asymkv.models import load_model

    model, tokenizer = load_model(str(tiny))
    return (HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1),
            SchemeLM(model, tokenizer, ["dynamic"], ResponseStore(None, {})))


def _instance(kind: str, args: tuple, i: int) -> Instance:
    return Instance(kind, {}, args, i, metadata=("t", i, 1))


def test_full_precision_answers_are_lm_evals_own(wrappers):
    hflm, ours = wrappers
    prompts = [("The grass is green. " * 12 + f"Number {i}:", {"until": ["."], "max_gen_toks": 24,
                                                                "do_sample": False}) for i in range(3)]
    requests = [_instance("generate_until", p, i) for i, p in enumerate(prompts)]
    assert ours.generate_until(requests) == hflm.generate_until(requests)


def test_full_precision_likelihoods_are_lm_evals_own(wrappers):
    hflm, ours = wrappers
    requests = [_instance("loglikelihood", ("The sky is blue. " * 10, f" The sun is {w}."), i)
                for i, w in enumerate(["yellow", "green"])]
    for (got, greedy), (expected, expected_greedy) in zip(ours.loglikelihood(requests), hflm.loglikelihood(requests)):
        assert got == pytest.approx(expected, rel=1e-5) and greedy == expected_greedy


def test_sampling_is_refused(wrappers):
    request = _instance("generate_until", ("Hi", {"until": ["."], "do_sample": True, "temperature": 1.0}), 0)
    with pytest.raises(ValueError, match="only greedy answers"):
        wrappers[1].generate_until([request])


@pytest.mark.parametrize(("expected", "text", "complete"), [(["1234"], " It is 1234.", True),
                                                             (["ab", "CD"], "cd and AB", True),
                                                             (["ab", "cd"], "ab only", False)],
                         ids=["one", "case", "missing"])
def test_answers_complete(expected, text, complete):
    assert answers_complete(expected, text) is complete
