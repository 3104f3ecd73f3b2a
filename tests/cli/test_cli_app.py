"""The command line a newcomer meets first: a fast ``--help``, the command list, and every wrong value refused
while the command line is parsed (named, with the values allowed), before a model loads or a file is written."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

import hf_asymkv.models as models
from hf_asymkv.cli import main
from hf_asymkv.cli.app import build_parser

# Bound on a fresh interpreter's `import hf_asymkv.cli` + build_parser(), interpreter start excluded (measured
# 0.02-0.05 s here; 5 s before the core loaded lazily). A structural check (no torch) comes first.
CLI_IMPORT_SECONDS = 1.0
HEAVY = ("torch", "transformers", "hf_asymkv.core.cache", "hf_asymkv.evals.evaluate", "hf_asymkv.bench.speed")


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of the parser: ("demo",), ("eval", "needle"), ..."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((*prefix, name))
                found += _commands(sub, (*prefix, name))
    return found


COMMANDS = _commands(build_parser())

_PROBE = """
import sys, time
t0 = time.perf_counter()
import hf_asymkv.cli
from hf_asymkv.cli.app import build_parser
build_parser()
print(time.perf_counter() - t0)
for command in {commands!r}:
    try:
        hf_asymkv.cli.main([*command, "--help"])
    except SystemExit as exc:
        assert exc.code == 0, (command, exc.code)
print("HEAVY:", *[m for m in {heavy!r} if m in sys.modules])
"""


@pytest.fixture(scope="module")
def fresh_cli() -> tuple[float, list[str]]:
    """A new interpreter: (seconds to import the CLI and build its parser, best of 3; heavy modules loaded by the
    import plus every command's ``--help``)."""
    code = _PROBE.format(commands=COMMANDS, heavy=HEAVY)
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(3)]
    return min(float(r.splitlines()[0]) for r in runs), runs[0].splitlines()[-1].split()[1:]


def test_help_of_every_command_loads_no_heavy_module(fresh_cli):
    _, heavy = fresh_cli
    assert heavy == [], f"`hf-asymkv ... --help` imported {heavy}"


def test_cli_import_time(fresh_cli):
    seconds, _ = fresh_cli
    assert seconds < CLI_IMPORT_SECONDS, f"import hf_asymkv.cli + build_parser() took {seconds:.2f} s"


def test_every_command_is_found():
    assert {("demo",), ("calibrate",), ("eval", "needle"), ("eval", "synthetic"), ("bench",), ("memory",),
            ("publish",), ("export-vllm",)} <= set(COMMANDS)


@pytest.mark.parametrize("argv", [[], ["eval"]], ids=["top", "eval"])
def test_no_command_prints_the_command_list_and_exits_0(capsys, argv):
    assert main(argv) == 0
    out = capsys.readouterr().out
    names = ["demo", "calibrate", "eval", "bench", "memory"] if not argv else ["synthetic", "needle", "ppl"]
    assert out.startswith(f"usage: hf-asymkv {' '.join(argv)}".rstrip()) and all(n in out for n in names)


def test_top_level_help_names_every_evaluation(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    line = text.split(" eval ", 1)[1].split(" bench ", 1)[0]
    for word in ("synthetic", "needle", "attention", "perplexity", "frontier", "report"):
        assert word in line, line


def _option_helps(help_text: str) -> dict[str, str]:
    """``{--flag: its help text}`` from a formatted ``--help``."""
    chunks = re.split(r"\n  (?=-)", help_text.split("options:", 1)[1])
    return {chunk.split()[0].split(",")[0]: " ".join(chunk.split()) for chunk in chunks if chunk.strip()}


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c) for c in COMMANDS])
def test_help_shows_every_default(capsys, command):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    helps = _option_helps(capsys.readouterr().out)
    parser = build_parser()
    for name in command:  # walk down to the command's own parser
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) and not action.required:
            assert "default" in helps[action.option_strings[0]], (command, action.option_strings)


@pytest.mark.parametrize("command, flag, names", [
    (("memory",), "--schemes", ["asymkv", "hf-fp8", "int8-per-tensor"]),
    (("bench",), "--schemes", ["asymkv-fused", "k4v4-sym"]),
    (("eval", "needle"), "--schemes", ["asymkv-w512", "dynamic"]),
    (("eval", "needle"), "--tasks", ["single", "multikey", "multivalue", "multiquery"]),
    (("demo",), "--dtype", ["float32", "bfloat16", "float16"]),
], ids=["memory-schemes", "bench-schemes", "needle-schemes", "needle-tasks", "dtype"])
def test_help_lists_the_valid_names(capsys, command, flag, names):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = _option_helps(capsys.readouterr().out)[flag].replace("- ", "-")  # argparse wraps at hyphens
    assert all(n in text for n in names), text


BAD = [
    (["memory", "--schemes", "bogus"], "argument --schemes: unknown cache scheme(s) ['bogus']; known cache "
                                       "schemes: dynamic, hf-quanto-int4, hf-quanto-int2, hf-fp8, asymkv,"),
    (["memory", "--schemes", "asymkv-fused"], "unknown cache scheme(s) ['asymkv-fused']"),
    (["memory", "--schemes", "asymkv,asymkv"], "cache schemes repeated in 'asymkv,asymkv'"),
    (["memory", "--decode-tokens", "-1"], "argument --decode-tokens: must be >= 0, got -1"),
    (["memory", "--kv-dtype", "int8"], "argument --kv-dtype: invalid choice: 'int8'"),
    (["memory", "--lengths", "0"], "argument --lengths: expected positive integers, got '0'"),
    (["bench", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    (["bench", "--new-tokens", "x"], "argument --new-tokens: expected an integer >= 1, got 'x'"),
    (["bench", "--new-tokens", "0"], "argument --new-tokens: must be >= 1, got 0"),
    (["bench", "--threads", "-2"], "argument --threads: must be >= 0, got -2"),
    (["demo", "--model", "/nonexistent"], "argument --model: model '/nonexistent': no such folder"),
    (["demo", "--model", "./foo"], "argument --model: model './foo': no such folder"),
    (["demo", "--model", "missing.gguf"],
     "argument --model: GGUF file 'missing.gguf' does not exist (no such file"),
    (["demo", "--depth", "1.5"], "argument --depth: must be in [0, 1], got 1.5"),
    (["demo", "--context", "10"], "argument --context: must be >= 64, got 10"),
    (["eval", "needle", "--tasks", "single,bogus"], "argument --tasks: unknown task(s) ['bogus']; known tasks: "
                                                    "single, multikey, multivalue, multiquery"),
    (["eval", "needle", "--depths", "-0.1"], "argument --depths: must be in [0, 1], got [-0.1]"),
    (["eval", "needle", "--samples", "0"], "argument --samples: must be >= 1, got 0"),
    (["eval", "attention", "--queries", "0"], "argument --queries: must be >= 1, got 0"),
    (["eval", "ppl", "--windows", "0"], "argument --windows: must be >= 1, got 0"),
    (["eval", "ppl", "--length", "2"], "argument --length: must be >= 3, got 2"),
    (["eval", "synthetic", "--seeds", "0"], "argument --seeds: must be >= 1, got 0"),
    (["calibrate", "--data", "org/corpus", "--seq-len", "0"], "argument --seq-len: must be >= 1, got 0"),
]


@pytest.fixture
def no_model(monkeypatch, tmp_path):
    """Run in an empty folder; loading a model or its config fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(models, "load_config", refuse)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(argv) for argv, _ in BAD])
def test_bad_value_is_refused_before_anything_loads(no_model, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--out", "out"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert list(no_model.iterdir()) == []  # nothing written


@pytest.mark.parametrize("argv, message", [
    (["bench", "--out", "taken.txt"], "argument --out: 'taken.txt' is a file; give a folder"),
    (["eval", "needle", "--out", "taken.txt"], "argument --out: 'taken.txt' is a file; give a folder"),
    (["memory", "--out", "folder"], "argument --out: 'folder' is a folder; give a file name"),
    (["calibrate", "--data", "org/corpus", "--out", "folder"], "argument --out: 'folder' is a folder; give a file name"),
], ids=["bench", "needle", "memory", "calibrate"])
def test_output_path_of_the_wrong_kind_is_refused_before_the_run(no_model, capsys, argv, message):
    (no_model / "taken.txt").write_text("keep me")
    (no_model / "folder").mkdir()
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert (no_model / "taken.txt").read_text() == "keep me" and not any((no_model / "folder").iterdir())


@pytest.mark.parametrize("argv, message", [
    (["eval", "attention", "--length", "64", "--queries", "40"], "--queries must be in [1, 32], got 40"),
    (["eval", "ppl", "--length", "64", "--prefix", "63"], "--prefix must be in [1, 62], got 63"),
], ids=["queries-vs-length", "prefix-vs-length"])
def test_values_checked_together_fail_before_the_model(no_model, capsys, argv, message):
    assert main([*argv, "--out", "out"]) == 2
    assert message in capsys.readouterr().err
    assert list(no_model.iterdir()) == []


def test_memory_refuses_peer_emulations(no_model, capsys):
    """`memory` counts real tensor bytes: a peer's emulation holds dequantized tensors, so it is not offered."""
    with pytest.raises(SystemExit):
        main(["memory", "--schemes", "kivi-2", "--out", "out"])
    assert "unknown cache scheme(s) ['kivi-2']" in capsys.readouterr().err
