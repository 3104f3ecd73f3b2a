"""`hf-asymkv eval frontier` end to end on a tiny random Llama saved to disk (files, table, Pareto check), the
Pareto rule on hand-made rows, and bad input refused before the model loads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import _build, hybrid_config, llama_config
from helpers import char_tokenizer
from transformers import Gemma3ForCausalLM, LlamaForCausalLM

from hf_asymkv.cli import main
from hf_asymkv.evals.frontier import PPL_TIE_SE, FrontierRow, pareto_check, pareto_markdown, scheme_nbytes

pytestmark = pytest.mark.usefixtures("single_thread")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("frontier") / "llama"
    _build(LlamaForCausalLM, llama_config(), seed=0).save_pretrained(root)
    char_tokenizer().save_pretrained(root)
    return root


@pytest.mark.slow(reason="every scheme of the frontier with perplexity and a plot; fast twin: "
                         "tests/evals/test_frontier.py::test_frontier_without_ppl_has_no_ppl_column_values")
def test_frontier_writes_json_table_and_plot(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["eval", "frontier", "--model", str(tiny), "--lengths", "700", "--depths", "0.5", "--tasks",
                 "single", "--attention-length", "700", "--schemes",
                 "asymkv,asymkv-v2,int8-per-tensor,llama-q4_0-rot,kivi-2,vllm-int4-pth,hf-fp8",
                 "--ppl-length", "600", "--quiet", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Pareto check:" in printed and "| kivi-2 |" in printed
    data = json.loads((out / "frontier.json").read_text())
    rows = {r["scheme"]: r for r in data["rows"]}
    assert list(rows)[0] == "dynamic" and rows["dynamic"]["x_smaller"] == 1.0
    assert rows["asymkv"]["kind"] == "ours" and rows["kivi-2"]["kind"] == "peer"
    assert rows["int8-per-tensor"]["kind"] == "baseline"
    assert all(r["nbytes"] > 0 for r in rows.values()) and rows["kivi-2"]["attention_kl"] >= 0
    assert {c["peer"] for c in data["pareto"]} == {"llama-q4_0-rot", "kivi-2", "vllm-int4-pth", "hf-fp8"}
    # Δppl measured for every scheme: 0 for the reference, and the figure the Pareto check compares
    assert rows["dynamic"]["delta_ppl_pct"] == 0.0 and rows["dynamic"]["ppl"] > 1
    assert all(math.isfinite(r["delta_ppl_pct"]) and r["ppl"] > 0 for r in rows.values())
    # 300 tokens of history: past the 128-token exact windows, so every scheme's Δppl moves
    assert all(r["delta_ppl_pct"] != 0 for s, r in rows.items() if s != "dynamic")
    assert all("Δppl %" in c["metrics"] for c in data["pareto"])
    assert data["meta"]["ppl_length"] == 600 and data["meta"]["ppl_windows"] == 1
    table = (out / "frontier.md").read_text()
    assert "| Δppl % (± s.e.) |" in table
    kivi = next(line for line in table.splitlines() if line.startswith("| kivi-2 |"))
    k = rows["kivi-2"]
    assert k["delta_ppl_se"] > 0
    assert kivi.split("|")[-2].strip() == f"{k['delta_ppl_pct']:.3g} ± {k['delta_ppl_se']:.2g}"
    assert (out / "frontier.png").read_bytes().startswith(PNG_MAGIC)
    assert (out / "frontier.md").read_text().startswith("Command: `hf-asymkv eval frontier")


@pytest.mark.slow(reason="the frontier on the hybrid model with perplexity; fast twin: "
                         "tests/evals/test_frontier.py::test_frontier_without_ppl_has_no_ppl_column_values")
def test_hybrid_model_skips_quantized_cache_and_measures_delta_ppl(tmp_path, capsys):
    model = tmp_path / "gemma3"
    _build(Gemma3ForCausalLM, hybrid_config(), seed=0).save_pretrained(model)
    char_tokenizer().save_pretrained(model)
    out = tmp_path / "run"
    assert main(["eval", "frontier", "--model", str(model), "--lengths", "600", "--depths", "0.5", "--tasks", "single",
                 "--attention-length", "0", "--ppl-length", "400", "--schemes", "asymkv,kivi-2,hf-quanto-int4",
                 "--quiet", "--out", str(out)]) == 0
    assert "Not run on this model: `hf-quanto-int4`" in capsys.readouterr().out
    rows = {r["scheme"]: r for r in json.loads((out / "frontier.json").read_text())["rows"]}
    assert list(rows) == ["dynamic", "asymkv", "kivi-2"]
    assert rows["asymkv"]["delta_ppl_pct"] != 0 and math.isfinite(rows["kivi-2"]["delta_ppl_pct"])


def test_bad_scheme_is_refused_with_the_list(tiny, capsys):
    with pytest.raises(SystemExit) as exit_info:  # refused while parsing, before the model loads
        main(["eval", "frontier", "--model", str(tiny), "--schemes", "vllm-int3", "--quiet"])
    assert exit_info.value.code == 2
    assert "known cache schemes" in capsys.readouterr().err


def _row(name, kind, x, lost, kl, dppl=float("nan")):
    return FrontierRow(name, kind, 1, x, 1.0, lost, 0, kl, delta_ppl_pct=dppl)


def test_pareto_needs_no_more_bytes_and_no_more_damage():
    rows = [_row("dynamic", "reference", 1, 0, 0), _row("ours-a", "ours", 2.0, 0, 0.01),
            _row("ours-b", "ours", 4.0, 2, 0.10), _row("peer-ok", "peer", 1.9, 1, 0.02),
            _row("peer-smaller", "peer", 5.0, 0, 0.5), _row("peer-better", "peer", 3.0, 0, 0.05)]
    checks = {c["peer"]: c for c in pareto_check(rows)}
    assert checks["peer-ok"]["passed"] and checks["peer-ok"]["witness"] == "ours-a"
    assert not checks["peer-smaller"]["passed"]  # nothing of ours is as small
    assert not checks["peer-better"]["passed"]  # ours-b is smaller but loses more
    assert checks["peer-better"]["metrics"]["needle lost"] == {"peer": 0, "best_ours": 2, "ok": False, "tie": False}


def test_bytes_of_dynamic_are_bf16():
    config = llama_config()
    # the prefill and one decode step: 101 tokens x layers, K+V, heads, dim, bf16
    assert scheme_nbytes("dynamic", config, 100) == 2 * 2 * 101 * 2 * 16 * 2


def test_pareto_fails_a_peer_better_only_on_delta_ppl():
    rows = [_row("dynamic", "reference", 1, 0, 0, 0.0), _row("ours", "ours", 3.0, 0, 0.01, 0.5),
            _row("peer-ppl", "peer", 2.5, 0, 0.02, 0.4), _row("peer-worse", "peer", 2.5, 0, 0.02, 0.6),
            _row("peer-negative", "peer", 2.5, 1, 0.02, -0.01)]
    checks = {c["peer"]: c for c in pareto_check(rows)}
    assert not checks["peer-ppl"]["passed"]  # ours wins bytes, needle and KL, but loses on perplexity
    assert checks["peer-ppl"]["metrics"]["Δppl %"] == {"peer": 0.4, "best_ours": 0.5, "ok": False, "tie": False}
    assert checks["peer-worse"]["passed"] and checks["peer-worse"]["witness"] == "ours"
    assert not checks["peer-negative"]["passed"]  # no standard errors given: raw values, -0.01 % beats 0.5 %
    # not measured (NaN) on the peer: Δppl is left out of its check
    assert pareto_check([_row("ours", "ours", 3.0, 0, 0.01, 0.5), _row("p", "peer", 2.5, 0, 0.02)])[0]["passed"]


def test_pareto_delta_ppl_within_noise_is_a_tie():
    """Δppl differences within PPL_TIE_SE combined standard errors tie; beyond them the peer wins."""
    def row(name, kind, dppl, se):
        r = _row(name, kind, 3.0 if kind == "ours" else 2.5, 0, 0.01 if kind == "ours" else 0.02, dppl)
        r.delta_ppl_se = se
        return r

    # 0.5 vs 0.4, se 0.05 each: combined 0.0707, 2 x = 0.141 > 0.1 -> tie
    checks = pareto_check([row("ours", "ours", 0.5, 0.05), row("p", "peer", 0.4, 0.05)])
    assert checks[0]["passed"] and checks[0]["metrics"]["Δppl %"]["tie"]
    assert "tie (within noise)" in pareto_markdown(checks)
    # 0.5 vs 0.3: 0.2 > 0.141 -> the peer is better beyond noise
    checks = pareto_check([row("ours", "ours", 0.5, 0.05), row("p", "peer", 0.3, 0.05)])
    assert not checks[0]["passed"] and "WORSE" in pareto_markdown(checks)
    assert 0.2 > PPL_TIE_SE * math.hypot(0.05, 0.05) > 0.1
    # better outright: ok, not a tie
    checks = pareto_check([row("ours", "ours", 0.2, 0.05), row("p", "peer", 0.3, 0.05)])
    assert checks[0]["metrics"]["Δppl %"] == {"peer": 0.3, "best_ours": 0.2, "ok": True, "tie": False}


def test_frontier_without_ppl_has_no_ppl_column_values(tiny, tmp_path):
    out = tmp_path / "run"
    assert main(["eval", "frontier", "--model", str(tiny), "--lengths", "700", "--depths", "0.5", "--tasks",
                 "single", "--attention-length", "0", "--ppl-length", "0", "--schemes", "asymkv,kivi-2",
                 "--quiet", "--out", str(out)]) == 0
    rows = json.loads((out / "frontier.json").read_text())["rows"]
    assert all(math.isnan(r["delta_ppl_pct"]) for r in rows)
    assert (out / "frontier.png").read_bytes().startswith(PNG_MAGIC)


def test_ppl_length_refused_at_parse_time(tiny, capsys):
    for value, message in (("2", "must be 0 or >= 3, got 2"), ("x", "expected an integer 0 or >= 3, got 'x'")):
        with pytest.raises(SystemExit) as exit_info:
            main(["eval", "frontier", "--model", str(tiny), "--ppl-length", value, "--quiet"])
        assert exit_info.value.code == 2
        assert f"argument --ppl-length: {message}" in capsys.readouterr().err


def test_text_file_without_ppl_is_refused(tiny, tmp_path, capsys):
    text = tmp_path / "book.txt"
    text.write_text("A sentence. " * 50, encoding="utf-8")
    assert main(["eval", "frontier", "--model", str(tiny), "--text-file", str(text), "--ppl-length", "0",
                 "--quiet", "--out", str(tmp_path / "run")]) == 2
    assert "--ppl-length 0 measures no perplexity" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_run_stopped_midway_leaves_what_it_measured(tiny, tmp_path, monkeypatch):
    """Killed on the second of two needle prompts: frontier.json/.md hold the bytes, attention KL, Δppl and the
    first prompt's answers, marked partial; the timeline says when each unit ended."""
    import hf_asymkv.evals.frontier as frontier

    answered = []

    def answer_then_stop(*args, **kwargs):
        if answered:
            raise KeyboardInterrupt
        answered.append(1)
        return real(*args, **kwargs)

    real = frontier.answer_prompt
    monkeypatch.setattr(frontier, "answer_prompt", answer_then_stop)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        main(["eval", "frontier", "--model", str(tiny), "--lengths", "600", "--depths", "0.2,0.8", "--tasks", "single",
              "--attention-length", "600", "--ppl-length", "400", "--schemes", "asymkv,kivi-2", "--quiet",
              "--out", str(out)])
    data = json.loads((out / "frontier.json").read_text())
    status = "attention prompts 1 of 1, ppl windows 1 of 1, needle prompts 1 of 2"
    assert data["meta"]["status"] == status
    assert [step for step, _ in data["meta"]["timeline"]] == [
        "attention prompts 0 of 1, ppl windows 0 of 1, needle prompts 0 of 2",
        "attention prompts 1 of 1, ppl windows 0 of 1, needle prompts 0 of 2",
        "attention prompts 1 of 1, ppl windows 1 of 1, needle prompts 0 of 2", status]
    rows = {r["scheme"]: r for r in data["rows"]}
    assert list(rows) == ["dynamic", "asymkv", "kivi-2"]
    assert all(math.isfinite(r[k]) for r in rows.values() for k in ("attention_kl", "delta_ppl_pct", "tail_kl"))
    assert rows["dynamic"]["needle_accuracy"] in (0.0, 1.0)  # one prompt answered
    md = (out / "frontier.md").read_text()
    assert f"**Partial results**: the run stopped or is still running; measured so far: {status}." in md
    assert not (out / "frontier.png").exists()  # the figure comes with the complete run


def test_partial_rows_before_any_needle_prompt_show_no_needle_figures():
    from hf_asymkv.evals.frontier import FrontierProgress, frontier_markdown

    state = FrontierProgress(["dynamic", "asymkv", "kivi-2"], {"dynamic": 400, "asymkv": 100, "kivi-2": 200},
                             {"attention prompts": [0, 0], "ppl windows": [0, 1], "needle prompts": [0, 6]})
    rows = state.rows()
    assert rows[1].x_smaller == 4.0 and math.isnan(rows[1].needle_accuracy) and not state.complete
    assert "| asymkv | ours | 100 | 4.00 | - | - | - | - | - | - |" in frontier_markdown(rows, 6)
    assert state.status() == "ppl windows 0 of 1, needle prompts 0 of 6"
    check = pareto_check(rows)[0]  # nothing measured yet: no metric to compare, so no pass
    assert check["metrics"] == {} and not check["passed"]
    assert "| kivi-2 | 2.00 | FAIL | - | nothing measured yet |" in pareto_markdown([check])


def test_one_prompt_is_singular_and_an_unreachable_peer_says_so():
    from hf_asymkv.evals.frontier import frontier_markdown

    rows = [_row("dynamic", "reference", 1, 0, 0), _row("ours", "ours", 2.0, 0, 0.01),
            _row("tiny-peer", "peer", 6.4, 5, 3.1)]
    assert "(1 needle prompt)" in frontier_markdown(rows, 1)
    text = pareto_markdown(pareto_check(rows))
    assert "| tiny-peer | 6.40 | FAIL | - | no setting of ours reaches this compression |" in text
    assert "WORSE" not in text and "vs -" not in text
