"""The long-decode evaluation on the tiny random models: no damage where nothing is quantized, greedy agreement equal
to the common prefix of two real `generate` runs, one token per forward call after the prefill, segments and
tables, bad input refused; `hf-asymkv eval long-decode` and the frontier's long-decode columns end to end."""

from __future__ import annotations

import json
import math

import pytest
from conftest import save_tiny_model
from helpers import LOCAL_TEXT, char_tokenizer

from hf_asymkv import cache_kwargs
from hf_asymkv.bench.schemes import make_cache
from hf_asymkv.cli import main
from hf_asymkv.evals.evaluate import eos_ids
from hf_asymkv.evals.long_decode import long_decode_markdown, run_long_decode, segment_means
from hf_asymkv.evals.ppl import text_windows

pytestmark = pytest.mark.usefixtures("single_thread")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TEXT = LOCAL_TEXT


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_segment_means_by_hand():
    assert segment_means([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.5, 3.5, 5.0]
    assert segment_means([2.0] * 128) == [2.0, 2.0]


@pytest.mark.parametrize("model", ["llama", "hybrid"], indirect=True)
def test_a_window_that_holds_everything_does_no_damage(model, tok):
    """asymkv-w512 keeps all 140 tokens exact: the teacher-forced path itself adds nothing."""
    rows = run_long_decode(model, tok, ["dynamic", "asymkv-w512"], TEXT, 100, 40, segment=16, show_progress=False)
    exact = rows[1]
    assert max(exact.kl) < 1e-9 and exact.agreement == [40] and exact.top1 == 1.0
    assert len(exact.segments) == 3 and len(exact.entropy) == 3 and all(e > 0 for e in exact.entropy)


@pytest.mark.parametrize("scheme", ["asymkv-max", "asymkv-compact", "k4v4-sym"],
                         ids=["diverges-at-1", "diverges-at-2", "never-diverges"])
def test_greedy_agreement_is_the_common_prefix_of_two_generate_runs(llama, tok, scheme):
    """Teacher-forcing full precision's greedy tokens until the first different choice counts exactly what the
    scheme's own greedy `generate` shares with full precision's (the first, prefill token not counted). On this
    prompt the three schemes diverge after 1, 2 and no steps (measured), so both ends and the middle are held."""
    steps = 48
    row = run_long_decode(llama, tok, ["dynamic", scheme], TEXT, 200, steps, show_progress=False)[1]
    ids = text_windows(tok, TEXT, 200, 1)[0]
    runs = []
    for name in ("dynamic", scheme):
        out = llama.generate(ids, **cache_kwargs(make_cache(name, llama.config)), max_new_tokens=steps + 1,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
        runs.append(out.sequences[0, ids.shape[1]:].tolist())
        if name == "dynamic":
            full_logits = out.logits
    shared = next((i for i, (a, b) in enumerate(zip(*runs)) if a != b), steps + 1)
    assert row.agreement == [shared - 1]
    if shared > steps:
        assert row.margins == [None]
    else:  # full precision's own top-1 minus top-2 log-probability where the scheme chose differently
        logp = full_logits[shared][0].float().log_softmax(-1)
        logp[sorted(eos_ids(llama))] = float("-inf")
        top = logp.topk(2).values
        assert row.margins == [pytest.approx(float(top[0] - top[1]), abs=1e-5)] and row.margins[0] >= 0


def test_one_token_per_forward_after_the_prefill(llama, tok):
    calls = []
    hook = llama.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)
    try:
        rows = run_long_decode(llama, tok, ["dynamic", "asymkv-max"], TEXT, 100, 12, show_progress=False)
    finally:
        hook.remove()
    # prefill; 12 sampled + 12 greedy reference steps; 12 teacher-forced steps; greedy agreement, stopped early
    assert calls[0] == 100 and set(calls[1:]) == {1}
    assert len(calls) == 1 + 12 + 12 + 12 + min(rows[1].agreement[0] + 1, 12)


@pytest.mark.slow(reason="generates and teacher-forces hundreds of steps per scheme end to end; fast twin: "
                         "tests/evals/test_long_decode.py::test_a_window_that_holds_everything_does_no_damage")
def test_rows_tables_and_seeds(llama, tok):
    rows = run_long_decode(llama, tok, ["dynamic", "asymkv-max"], TEXT, 100, 70, prompts=2, segment=32,
                           show_progress=False)
    lossy = rows[1]
    assert len(lossy.kl) == 70 and len(lossy.segments) == 3 and len(lossy.agreement) == 2
    assert lossy.segments[0] == pytest.approx(sum(lossy.kl[:32]) / 32) and lossy.kl_mean > 0
    assert lossy.growth == pytest.approx(lossy.segments[-1] / lossy.segments[0])
    assert math.isnan(rows[0].growth) and rows[0].agreement == [70, 70] and rows[0].margins == [None, None]
    assert len(lossy.margins) == 2 and all(m is None or m >= 0 for m in lossy.margins)
    table = long_decode_markdown(rows, 32, {"hf-fp8": "refused"})
    assert "| scheme | 0-31 | 32-63 | 64-69 | last / first |" in table
    assert "| asymkv-max | " in table and "Not run on this model: `hf-fp8` (refused)" in table
    margins = ", ".join("-" if m is None else f"{m:.3f}" for m in lossy.margins)
    assert f"| asymkv-max | {lossy.agreement[0]}, {lossy.agreement[1]} | {margins} | " in table
    assert "| dynamic | 70, 70 | -, - | 70.0 |" in table
    entropy = ", ".join(f"{e:.2f}" for e in rows[0].entropy)
    assert f"Full precision's next-token entropy per segment (nats): {entropy}\n" in table
    again = run_long_decode(llama, tok, ["dynamic", "asymkv-max"], TEXT, 100, 70, prompts=2, segment=32,
                            show_progress=False)[1]
    other = run_long_decode(llama, tok, ["dynamic", "asymkv-max"], TEXT, 100, 70, prompts=2, segment=32, seed=5,
                            show_progress=False)[1]
    assert again.kl == lossy.kl and other.kl != lossy.kl  # the seed decides the sampled continuation


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"steps": 0}, "--steps must be an integer >= 1, got 0"),
    ({"prompts": 0}, "--prompts must be an integer >= 1, got 0"),
    ({"prompt_length": 1000, "steps": 100}, "--prompt-length + --steps: 1100 tokens exceed the model's "
                                            "max_position_embeddings (1024)"),
    ({"schemes": ["asymkv", "dynamic"]}, "the first scheme must be 'dynamic' (the reference), got 'asymkv'"),
], ids=["steps", "prompts", "too-long", "no-reference-first"])
def test_bad_input_is_refused(llama, tok, kwargs, message):
    args = {"schemes": ["dynamic", "asymkv"], "text": TEXT, "prompt_length": 100, "steps": 8, **kwargs}
    with pytest.raises(ValueError) as info:
        run_long_decode(llama, tok, show_progress=False, **args)
    assert message in str(info.value)


# ------------------------------------------------------------------------------------------------ CLI
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("long_decode_cli")
    return {kind: save_tiny_model(root / kind, kind) for kind in ("llama", "hybrid")}


def long_decode(models, out, *extra, model="llama") -> int:
    return main(["eval", "long-decode", "--model", str(models[model]), "--prompt-length", "100", "--steps", "40",
                 "--segment", "16", "--schemes", "asymkv-max,hf-fp8", "--quiet", "--out", str(out), *extra])


@pytest.mark.slow(reason="generates and teacher-forces hundreds of steps per scheme end to end; fast twin: "
                         "tests/evals/test_long_decode.py::test_a_window_that_holds_everything_does_no_damage")
def test_long_decode_writes_json_table_and_plot(models, tmp_path, capsys):
    assert long_decode(models, tmp_path / "run", "--prompts", "2") == 0
    assert capsys.readouterr().out.startswith("Long decode: KL(full || scheme)")
    data = json.loads((tmp_path / "run" / "long_decode.json").read_text())
    assert data["schemes"] == ["dynamic", "asymkv-max", "hf-fp8"] and data["skipped"] == {}
    assert data["meta"]["command"].startswith("hf-asymkv eval long-decode --model ")
    assert (data["meta"]["steps"], data["meta"]["prompts"], data["meta"]["segment"]) == (40, 2, 16)
    rows = {r["scheme"]: r for r in data["rows"]}
    assert len(rows["hf-fp8"]["segments"]) == 3 and len(rows["asymkv-max"]["agreement"]) == 2
    assert (tmp_path / "run" / "long_decode.png").read_bytes().startswith(PNG_MAGIC)
    assert (tmp_path / "run" / "long_decode.md").read_text().startswith("Command: `hf-asymkv eval long-decode")


@pytest.mark.slow(reason="generates and teacher-forces hundreds of steps per scheme end to end; fast twin: "
                         "tests/evals/test_long_decode.py::test_a_window_that_holds_everything_does_no_damage")
def test_long_decode_on_a_hybrid_model_lists_what_transformers_cannot_run(models, tmp_path, capsys):
    assert long_decode(models, tmp_path, model="hybrid") == 0
    assert "Not run on this model: `hf-fp8`" in capsys.readouterr().out
    assert json.loads((tmp_path / "long_decode.json").read_text())["schemes"] == ["dynamic", "asymkv-max"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["--prompt-length", "1000", "--steps", "100"], "--prompt-length + --steps: 1100 tokens exceed"),
    (["--text-file", "/nonexistent/book.txt"], "--text-file: no such file or folder: '/nonexistent/book.txt'"),
], ids=["steps", "too-long", "missing-text"])
def test_long_decode_bad_input_exits_2_before_any_work(models, tmp_path, capsys, extra, message):
    try:
        code = long_decode(models, tmp_path / "out", *extra)
    except SystemExit as exc:  # refused by argparse
        code = exc.code
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow(reason="generates and teacher-forces hundreds of steps per scheme end to end; fast twin: "
                         "tests/evals/test_long_decode.py::test_a_window_that_holds_everything_does_no_damage")
def test_frontier_long_decode_columns(models, tmp_path):
    from hf_asymkv.evals.frontier_plot import frontier_title

    out = tmp_path / "run"
    assert main(["eval", "frontier", "--model", str(models["llama"]), "--lengths", "600", "--depths", "0.5",
                 "--tasks", "single", "--attention-length", "0", "--ppl-length", "0", "--decode-steps", "20",
                 "--decode-prompt-length", "100", "--schemes", "asymkv-max,kivi-2", "--quiet", "--out", str(out)]) == 0
    data = json.loads((out / "frontier.json").read_text())
    rows = {r["scheme"]: r for r in data["rows"]}
    assert rows["dynamic"]["decode_kl"] == 0 and rows["dynamic"]["decode_agreement"] == 20
    assert rows["asymkv-max"]["decode_kl"] > 0 and 0 <= rows["asymkv-max"]["decode_agreement"] <= 20
    assert rows["kivi-2"]["decode_kl"] == 0  # 120 tokens: all inside KIVI's 128-token exact window
    assert "decode KL" in data["pareto"][0]["metrics"] and data["meta"]["decode_steps"] == 20
    assert "| decode KL, last 64 | greedy agreement |" in (out / "frontier.md").read_text()
    assert [step for step, _ in data["meta"]["timeline"]] == [  # one unit of the run's progress, before the needle
        "long-decode prompts 0 of 1, needle prompts 0 of 1", "long-decode prompts 1 of 1, needle prompts 0 of 1",
        "long-decode prompts 1 of 1, needle prompts 1 of 1"]
    assert "long decode: 20 tokens after 100" in frontier_title(data["meta"])  # and the figure says it


def test_frontier_decode_steps_refused_at_parse_time(models, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "frontier", "--model", str(models["llama"]), "--decode-steps", "-1", "--quiet"])
    assert exit_info.value.code == 2
    assert "argument --decode-steps: must be 0 or >= 1, got -1" in capsys.readouterr().err

