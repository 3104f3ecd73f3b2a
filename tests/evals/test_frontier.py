"""`hf-asymkv eval frontier` end to end on a tiny random Llama saved to disk (files, table, Pareto check), the
Pareto rule on hand-made rows, and bad input refused before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import _build, llama_config
from helpers import char_tokenizer
from transformers import LlamaForCausalLM

from hf_asymkv.cli import main
from hf_asymkv.evals.frontier import FrontierRow, pareto_check, scheme_nbytes

pytestmark = pytest.mark.usefixtures("single_thread")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("frontier") / "llama"
    _build(LlamaForCausalLM, llama_config(), seed=0).save_pretrained(root)
    char_tokenizer().save_pretrained(root)
    return root


def test_frontier_writes_json_table_and_plot(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["eval", "frontier", "--model", str(tiny), "--lengths", "700", "--depths", "0.5", "--tasks",
                 "single", "--attention-length", "700", "--schemes",
                 "asymkv,asymkv-v2,int8-per-tensor,llama-q4_0-rot,kivi-2,vllm-int4-pth,hf-fp8",
                 "--quiet", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Pareto check:" in printed and "| kivi-2 |" in printed
    data = json.loads((out / "frontier.json").read_text())
    rows = {r["scheme"]: r for r in data["rows"]}
    assert list(rows)[0] == "dynamic" and rows["dynamic"]["x_smaller"] == 1.0
    assert rows["asymkv"]["kind"] == "ours" and rows["kivi-2"]["kind"] == "peer"
    assert rows["int8-per-tensor"]["kind"] == "baseline"
    assert all(r["nbytes"] > 0 for r in rows.values()) and rows["kivi-2"]["attention_kl"] >= 0
    assert {c["peer"] for c in data["pareto"]} == {"llama-q4_0-rot", "kivi-2", "vllm-int4-pth", "hf-fp8"}
    assert (out / "frontier.png").read_bytes().startswith(PNG_MAGIC)
    assert (out / "frontier.md").read_text().startswith("Command: `hf-asymkv eval frontier")


def test_bad_scheme_is_refused_with_the_list(tiny, capsys):
    with pytest.raises(SystemExit) as exit_info:  # refused while parsing, before the model loads
        main(["eval", "frontier", "--model", str(tiny), "--schemes", "vllm-int3", "--quiet"])
    assert exit_info.value.code == 2
    assert "known cache schemes" in capsys.readouterr().err


def _row(name, kind, x, lost, kl):
    return FrontierRow(name, kind, 1, x, 1.0, lost, 0, kl)


def test_pareto_needs_no_more_bytes_and_no_more_damage():
    rows = [_row("dynamic", "reference", 1, 0, 0), _row("ours-a", "ours", 2.0, 0, 0.01),
            _row("ours-b", "ours", 4.0, 2, 0.10), _row("peer-ok", "peer", 1.9, 1, 0.02),
            _row("peer-smaller", "peer", 5.0, 0, 0.5), _row("peer-better", "peer", 3.0, 0, 0.05)]
    checks = {c["peer"]: c for c in pareto_check(rows)}
    assert checks["peer-ok"]["passed"] and checks["peer-ok"]["witness"] == "ours-a"
    assert not checks["peer-smaller"]["passed"]  # nothing of ours is as small
    assert not checks["peer-better"]["passed"]  # ours-b is smaller but loses more
    assert checks["peer-better"]["metrics"]["needle lost"] == {"peer": 0, "best_ours": 2, "ok": False}


def test_bytes_of_dynamic_are_bf16():
    config = llama_config()
    # the prefill and one decode step: 101 tokens x layers, K+V, heads, dim, bf16
    assert scheme_nbytes("dynamic", config, 100) == 2 * 2 * 101 * 2 * 16 * 2
