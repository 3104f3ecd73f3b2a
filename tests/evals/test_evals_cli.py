"""`hf-asymkv eval needle | attention | ppl | report` end to end on a tiny random Llama (and a tiny Gemma3 hybrid)
saved to disk with an offline character-level tokenizer: files written, tables printed, the command recorded,
and bad input rejected with exit code 2 and a message before anything is written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import _build, hybrid_config, llama_config
from helpers import char_tokenizer, cli_exit_code
from transformers import Gemma3ForCausalLM, LlamaForCausalLM

from hf_asymkv.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """``{"llama": folder, "hybrid": folder}`` (model + tokenizer), and ``text.txt`` beside them."""
    root = tmp_path_factory.mktemp("eval_cli")
    out = {}
    for name, cls, config in (("llama", LlamaForCausalLM, llama_config()),
                              ("hybrid", Gemma3ForCausalLM, hybrid_config())):
        _build(cls, config, seed=0).save_pretrained(root / name)
        char_tokenizer().save_pretrained(root / name)
        out[name] = root / name
    (root / "text.txt").write_text(" ".join(f"Sentence {i} of a local book about rivers and hills." for i in
                                            range(300)), encoding="utf-8")
    out["text"] = root / "text.txt"
    return out


def needle(models, out: Path, *extra: str, model: str = "llama") -> int:
    return cli_exit_code(["eval", "needle", "--model", str(models[model]), "--lengths", "600,800", "--depths", "0.2,0.8",
                 "--tasks", "single,multikey", "--schemes", "asymkv,k4v4-sym", "--quiet", "--out", str(out), *extra])


@pytest.mark.slow(reason="a needle grid with heatmaps; fast twin: "
                         "tests/evals/test_evals_cli.py::test_needle_text_haystack_from_a_file")
def test_needle_writes_json_table_and_heatmaps(models, tmp_path, capsys):
    assert needle(models, tmp_path / "run") == 0
    printed = capsys.readouterr().out
    assert printed.startswith("Needle accuracy") and "| asymkv |" in printed and "| k4v4-sym |" in printed
    data = json.loads((tmp_path / "run" / "needle.json").read_text())
    assert data["schemes"] == ["dynamic", "asymkv", "k4v4-sym"] and data["skipped"] == {}
    assert data["meta"]["command"].startswith("hf-asymkv eval needle --model ")
    assert data["meta"]["seed"] == 0 and "transformers" in data["meta"]["versions"]
    assert len(data["rows"]) == 2 * 2 * 2 * 3
    assert set(data["heatmaps"]) == set(data["schemes"]) and len(data["heatmaps"]["asymkv"]) == 2
    assert (tmp_path / "run" / "needle_heatmaps.png").read_bytes().startswith(PNG_MAGIC)
    assert (tmp_path / "run" / "needle.md").read_text().startswith("Command: `hf-asymkv eval needle")


def test_needle_text_haystack_from_a_file(models, tmp_path):
    assert needle(models, tmp_path, "--haystack", "text", "--haystack-file", str(models["text"])) == 0
    data = json.loads((tmp_path / "needle.json").read_text())
    assert data["meta"]["haystack"] == "text" and data["meta"]["text_source"] == str(models["text"])


def test_hybrid_model_lists_what_transformers_cannot_run(models, tmp_path, capsys):
    assert needle(models, tmp_path, "--schemes", "asymkv,hf-quanto-int4", model="hybrid") == 0
    assert "Not run on this model: `hf-quanto-int4`" in capsys.readouterr().out
    assert json.loads((tmp_path / "needle.json").read_text())["schemes"] == ["dynamic", "asymkv"]


@pytest.mark.slow(reason="attention, perplexity and the report end to end; fast twin: "
                         "tests/evals/test_evals_cli.py::test_needle_text_haystack_from_a_file")
def test_attention_ppl_and_report(models, tmp_path, capsys):
    base = ["--model", str(models["llama"]), "--schemes", "asymkv,int8-per-tensor", "--quiet", "--out", str(tmp_path)]
    assert main(["eval", "attention", "--length", "600", "--samples", "1", "--queries", "16", *base]) == 0
    assert main(["eval", "ppl", "--length", "400", "--windows", "1", "--text-file", str(models["text"]), *base]) == 0
    assert needle(models, tmp_path, "--schemes", "asymkv,int8-per-tensor") == 0
    capsys.readouterr()
    assert main(["eval", "report", str(tmp_path)]) == 0
    summary = capsys.readouterr().out
    assert summary.splitlines()[0] == ("| scheme | needle acc (all) | needle acc @ 800 | needle lost / gained vs full "
                                       "| attn KL mean | attn top-8 | ppl | Δppl % |")
    assert summary.splitlines()[2].startswith("| dynamic | ") and "| 0 / 0 |" in summary.splitlines()[2]
    assert len(summary.splitlines()) == 2 + 3
    assert (tmp_path / "summary.md").read_text() == summary
    for figure in ("attention_layers.png", "ppl.png", "summary.png", "needle_heatmaps.png"):
        assert (tmp_path / figure).read_bytes().startswith(PNG_MAGIC)
    attention = json.loads((tmp_path / "attention.json").read_text())
    assert len(attention["induction"]) == 2 and len(attention["rows"][1]["kl"]) == 2
    ppl = json.loads((tmp_path / "ppl.json").read_text())
    assert ppl["meta"]["text_source"] == str(models["text"]) and ppl["rows"][0]["delta_ppl"] == 0.0


@pytest.mark.parametrize(("extra", "message"), [
    (["--schemes", "asymkv,nope"], "argument --schemes: unknown cache scheme(s) ['nope']; known cache schemes: "
                                   "dynamic, hf-quanto-int4"),
    (["--depths", "0.5,1.5"], "argument --depths: must be in [0, 1], got [1.5]"),
    (["--lengths", "600,4096"], "--lengths: 4096 tokens exceed the model's max_position_embeddings (1024)"),
    (["--tasks", "single,needle"], "argument --tasks: unknown task(s) ['needle']; known tasks: single, multikey"),
    (["--haystack", "text", "--haystack-file", "/nonexistent/book.txt"],
     "--haystack-file: no such file or folder: '/nonexistent/book.txt'"),
    (["--haystack-file", "{text}"], "add --haystack text (got --haystack noise)"),
], ids=["scheme", "depth", "length", "task", "missing-file", "file-without-text"])
def test_needle_bad_input_exits_2(models, tmp_path, capsys, extra, message):
    extra = [e.format(text=models["text"]) for e in extra]
    assert needle(models, tmp_path / "out", *extra) == 2
    err = capsys.readouterr().err
    assert "error: " in err and message in err
    assert not (tmp_path / "out").exists()


def test_ppl_and_attention_bad_input_exit_2(models, tmp_path, capsys):
    model = ["--model", str(models["llama"]), "--quiet"]
    assert main(["eval", "ppl", *model, "--length", "4096", "--text-file", str(models["text"])]) == 2
    assert "--length: 4096 tokens exceed" in capsys.readouterr().err
    assert main(["eval", "attention", *model, "--length", "600", "--queries", "400"]) == 2
    assert "--queries must be in [1, 300], got 400" in capsys.readouterr().err
    assert main(["eval", "report", str(tmp_path)]) == 2
    assert "holds no needle.json, attention.json, ppl.json or frontier.json" in capsys.readouterr().err


def test_missing_matplotlib_is_named_before_the_run(models, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert needle(models, tmp_path / "out") == 2
    assert 'pip install "hf_asymkv[eval]"' in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
