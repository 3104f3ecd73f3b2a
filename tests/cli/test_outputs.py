"""Every command that writes checks where it writes while its command line is parsed: the wrong kind of entry
already there, a path under a file, a folder it may not write in. The message is plain (no errno, no temp
name), nothing is written, no model (not even a config) loads, and torch is never imported, so the refusal comes
within the second rather than after the run."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import permissions_enforced

import hf_asymkv.models as models
from hf_asymkv.cli import main

# (id, argv before the output path, the output flag (None: positional), kind of output)
COMMANDS = [
    ("calibrate", ["calibrate", "--data", "org/corpus"], "--out", "file"),
    ("calibrate-offload", ["calibrate", "--data", "org/corpus", "--device-map", "auto"], "--offload-folder", "folder"),
    ("eval-synthetic", ["eval", "synthetic"], "--out", "folder"),
    ("eval-needle", ["eval", "needle"], "--out", "folder"),
    ("eval-attention", ["eval", "attention"], "--out", "folder"),
    ("eval-ppl", ["eval", "ppl"], "--out", "folder"),
    ("eval-frontier", ["eval", "frontier"], "--out", "folder"),
    ("eval-lm-eval", ["eval", "lm-eval", "--tasks", "niah_single_1"], "--out", "folder"),
    ("eval-report", ["eval", "report"], None, "existing folder"),
    ("bench", ["bench"], "--out", "folder"),
    ("memory", ["memory"], "--out", "file"),
    ("publish", ["publish", "--scales", "kv.safetensors"], "--out", "folder"),
    ("export-vllm", ["export-vllm", "--scales", "kv.safetensors"], "--out", "folder"),
    ("export-vllm-model", ["export-vllm", "--scales", "kv.safetensors", "--model", "smollm2-135m-instruct"], "--out",
     "folder"),
    ("export-vllm-import", ["export-vllm", "--from-checkpoint", "ckpt"], "--out", "file"),
]
IDS = [c[0] for c in COMMANDS]


def _argv(command: list[str], flag: str | None, out: str) -> list[str]:
    return [*command, *([flag, out] if flag else [out])]


def _wrong_kind(kind: str) -> tuple[str, str]:
    """An output path of the other kind (it exists in the work folder) and the message it gets."""
    if kind == "file":
        return "folder", "'folder' is a folder; give a file name"
    return "notes.txt", "'notes.txt' is a file; give a folder"


@pytest.fixture
def workdir(monkeypatch, tmp_path) -> Path:
    """An empty-looking work folder holding what the commands read (a notes file, a folder, a scales file, a
    checkpoint folder); loading a model or its config fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(models, "load_config", refuse)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "folder").mkdir()
    (tmp_path / "kv.safetensors").write_bytes(b"not read")
    (tmp_path / "ckpt").mkdir()
    return tmp_path


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def _refused(argv: list[str], capsys) -> str:
    """Run the command; it must exit 2 (from argparse or from the command) and say one thing on stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "Errno" not in err and ".tmp" not in err, err
    return err


@pytest.mark.parametrize("command, flag, kind", [c[1:] for c in COMMANDS], ids=IDS)
def test_output_of_the_wrong_kind(workdir, capsys, command, flag, kind):
    before = _snapshot(workdir)
    out, message = _wrong_kind("folder" if kind == "existing folder" else kind)
    assert message in _refused(_argv(command, flag, out), capsys)
    assert _snapshot(workdir) == before


@pytest.mark.parametrize("command, flag, kind", [c[1:] for c in COMMANDS], ids=IDS)
def test_output_under_a_file(workdir, capsys, command, flag, kind):
    """``notes.txt/results``: a folder cannot be made inside a file (root cannot either)."""
    before = _snapshot(workdir)
    err = _refused(_argv(command, flag, "notes.txt/results/out"), capsys)
    if kind == "existing folder":
        assert "no such file or folder: 'notes.txt/results/out'" in err
    else:
        assert "'notes.txt/results/out' cannot be created: 'notes.txt' is a file, not a folder" in err
    assert _snapshot(workdir) == before


@pytest.mark.skipif(not permissions_enforced(), reason="this process (root) may write in any folder whatever its "
                    "mode, so a read-only folder cannot be refused; the path-under-a-file case covers root")
@pytest.mark.parametrize("command, flag, kind", [c[1:] for c in COMMANDS], ids=IDS)
def test_output_in_a_folder_without_write_permission(workdir, capsys, command, flag, kind):
    locked = workdir / "locked"
    locked.mkdir()
    (locked / "inside").mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    (locked / "inside").chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        before = _snapshot(workdir)
        out = "locked/inside" if kind == "existing folder" else "locked/out"
        assert f"no permission to write in '{'locked/inside' if kind == 'existing folder' else 'locked'}'" in \
            _refused(_argv(command, flag, out), capsys)
        assert _snapshot(workdir) == before
    finally:
        locked.chmod(stat.S_IRWXU)
        (locked / "inside").chmod(stat.S_IRWXU)


_PROBE = """
import os, sys
os.chdir({workdir!r})
import hf_asymkv.cli
for argv in {argvs!r}:
    try:
        code = hf_asymkv.cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2, (argv, code)
print("HEAVY:", *[m for m in ("torch", "transformers") if m in sys.modules])
"""


def test_refusals_import_no_torch(workdir):
    """The checks need only the file system: torch and transformers (seconds to import) never load."""
    argvs = [_argv(c, f, out) for _, c, f, kind in COMMANDS
             for out in (_wrong_kind("folder" if kind == "existing folder" else kind)[0], "notes.txt/x/out")]
    done = subprocess.run([sys.executable, "-c", _PROBE.format(workdir=str(workdir), argvs=argvs)],
                          capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[-1].split()[1:] == [], done.stdout


# (id, argv with the missing path as {missing}); every command names it the same way
MISSING = [
    ("demo-model", ["demo", "--model", "{missing}"], "model '{missing}': no such folder"),
    ("calibrate-model", ["calibrate", "--data", "org/corpus", "--model", "{missing}"], "model '{missing}': no such folder"),
    ("needle-model", ["eval", "needle", "--model", "{missing}"], "model '{missing}': no such folder"),
    ("memory-model", ["memory", "--model", "{missing}"], "model '{missing}': no such folder"),
    ("publish-model", ["publish", "--scales", "kv.safetensors", "--out", "o", "--model", "{missing}"],
     "model '{missing}': no such folder"),
    ("export-model", ["export-vllm", "--scales", "kv.safetensors", "--out", "o", "--model", "{missing}"],
     "model '{missing}': no such folder"),
    ("publish-scales", ["publish", "--scales", "{missing}", "--out", "o"], "no such file or folder: '{missing}'"),
    ("export-scales", ["export-vllm", "--scales", "{missing}", "--out", "o"], "no such file or folder: '{missing}'"),
    ("export-checkpoint", ["export-vllm", "--from-checkpoint", "{missing}", "--out", "o.safetensors"],
     "no such file or folder: '{missing}'"),
    ("publish-eval", ["publish", "--scales", "kv.safetensors", "--out", "o", "--eval-results", "{missing}"],
     "no such file or folder: '{missing}'"),
    ("calibrate-data", ["calibrate", "--data", "{missing}"], "no such file or folder: '{missing}'"),
    ("ppl-text", ["eval", "ppl", "--text-file", "{missing}"], "no such file or folder: '{missing}'"),
    ("report-folder", ["eval", "report", "{missing}"], "no such file or folder: '{missing}'"),
]


@pytest.mark.parametrize("argv, message", [m[1:] for m in MISSING], ids=[m[0] for m in MISSING])
def test_a_missing_path_reads_the_same_in_every_command(workdir, capsys, argv, message):
    missing = "./nowhere/x.txt"
    before = _snapshot(workdir)
    err = _refused([a.format(missing=missing) for a in argv], capsys)
    assert message.format(missing=missing) in err
    assert _snapshot(workdir) == before


def test_missing_inputs_are_refused_without_torch(workdir):
    """publish and export-vllm took 8-16 s to say that a file is missing: they imported torch first."""
    argvs = [[a.format(missing="./nowhere/x.txt") for a in argv] for _, argv, _ in MISSING]
    done = subprocess.run([sys.executable, "-c", _PROBE.format(workdir=str(workdir), argvs=argvs)],
                          capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[-1].split()[1:] == [], done.stdout
