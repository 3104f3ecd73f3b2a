"""Atomic writes say what went wrong in plain words, naming the destination, never the hidden temp name they were
building (`hf_asymkv.core.fileio`); `output_problem` is the check the command line runs while parsing."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from helpers import permissions_enforced

from hf_asymkv.core.fileio import atomic_write, atomic_write_text, output_problem, usual_mode, write_folder_atomically


@pytest.fixture
def here(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    Path("notes.txt").write_text("keep me")
    Path("folder").mkdir()
    return tmp_path


@pytest.mark.parametrize("path, kind, expected", [
    ("new.json", "file", None),
    ("deep/new/x.json", "file", None),
    ("folder", "folder", None),
    ("folder", "file", "'folder' is a folder; give a file name"),
    ("notes.txt", "folder", "'notes.txt' is a file; give a folder"),
    ("notes.txt", "file", None),  # replaced atomically
    ("notes.txt/a.safetensors", "file", "'notes.txt/a.safetensors' cannot be created: 'notes.txt' is a file, not a folder"),
    ("notes.txt/x/y", "any", "'notes.txt/x/y' cannot be created: 'notes.txt' is a file, not a folder"),
], ids=["new-file", "new-nested", "folder", "folder-for-file", "file-for-folder", "existing-file", "under-a-file",
        "deep-under-a-file"])
def test_output_problem(here, path, kind, expected):
    assert output_problem(path, kind) == expected


@pytest.mark.skipif(not permissions_enforced(), reason="this process (root) may write in any folder whatever its "
                    "mode, so a read-only folder cannot be refused; the path-under-a-file case covers root")
@pytest.mark.parametrize("path, whole, expected", [
    ("folder/locked/out", False, "'folder/locked/out' cannot be created: no permission to write in 'folder/locked'"),
    ("folder/locked/inside", False, None),  # files go into 'inside', which is writable
    ("folder/locked/inside", True, "'folder/locked/inside' cannot be written: no permission to write in "
                                   "'folder/locked'"),  # replaced whole: its parent must take the new folder
], ids=["new-in-locked", "into-writable", "replace-in-locked"])
def test_output_problem_without_write_permission(here, path, whole, expected):
    locked = here / "folder" / "locked"
    (locked / "inside").mkdir(parents=True)
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        assert output_problem(path, "folder", whole=whole) == expected
    finally:
        locked.chmod(stat.S_IRWXU)


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match=r"kind must be one of \['file', 'folder', 'any'\], got 'dir'"):
        output_problem("x", "dir")


def test_a_path_under_a_file_is_named_in_plain_words(here):
    with pytest.raises(FileExistsError) as info:
        atomic_write_text("notes.txt/a.json", "{}")
    assert str(info.value) == "'notes.txt/a.json' cannot be created: 'notes.txt' is a file, not a folder"
    assert Path("notes.txt").read_text() == "keep me"


def test_a_failing_writer_names_the_destination_not_the_temp_file(here):
    def fail(tmp: str) -> None:
        raise PermissionError(13, "Permission denied", tmp)

    with pytest.raises(PermissionError) as info:
        atomic_write("folder/out.png", fail)
    assert str(info.value) == "cannot write 'folder/out.png': Permission denied" and info.value.errno == 13
    assert list(Path("folder").iterdir()) == []  # the temp file is gone


def test_a_folder_build_names_the_file_inside_the_destination(here):
    with pytest.raises(FileNotFoundError) as info:
        write_folder_atomically("out", lambda tmp: (tmp / "sub" / "f.txt").write_text("x"), overwrite=False,
                                marker="m")
    assert str(info.value) == "cannot write 'out/sub/f.txt': No such file or directory"
    assert sorted(p.name for p in here.iterdir()) == ["folder", "notes.txt"]


def test_an_error_about_a_source_file_is_left_as_it_is(here):
    with pytest.raises(FileNotFoundError) as info:
        write_folder_atomically("out", lambda tmp: Path("missing.bin").read_bytes(), overwrite=False, marker="m")
    assert "missing.bin" in str(info.value) and "cannot write" not in str(info.value)


def test_written_files_get_the_usual_permissions(here):
    atomic_write_text("a.txt", "x")
    out = write_folder_atomically("pub", lambda tmp: (tmp / "b.txt").write_text("y"), overwrite=False, marker="m")
    assert Path("a.txt").stat().st_mode & 0o777 == usual_mode() == 0o666 & ~_umask()
    assert out.stat().st_mode & 0o777 == usual_mode(folder=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
