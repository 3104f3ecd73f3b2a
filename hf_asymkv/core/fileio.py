"""Atomic file and folder writes: build in a temp file/folder beside the destination, then rename, so that an
interrupted or failed write never leaves a half-written result where a reader looks."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "atomic_write_text", "check_out_dir", "write_folder_atomically"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` then rename the temp file onto ``path``; on any error remove the temp file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def check_out_dir(out_dir: Path, overwrite: bool, marker: str) -> None:
    """Refuse an ``out_dir`` that is a file, or non-empty without ``overwrite`` and ``marker`` (``ValueError``)."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ValueError(f"output {str(out_dir)!r} exists and is not a folder")
    if not any(out_dir.iterdir()):
        return
    if not overwrite:
        raise ValueError(f"output folder {str(out_dir)!r} exists and is not empty; choose a new folder or "
                         "replace it with overwrite=True (--overwrite)")
    if not (out_dir / marker).is_file():
        raise ValueError(f"refusing to replace {str(out_dir)!r}: it is not empty and holds no {marker}, so it was "
                         "not written by hf-asymkv; choose a new or empty folder")


def write_folder_atomically(out_dir: str | Path, build: Callable[[Path], None], *, overwrite: bool,
                            marker: str) -> Path:
    """Call ``build(tmp)`` on a temp folder next to ``out_dir``, then rename it to ``out_dir``.

    An existing non-empty ``out_dir`` is refused unless ``overwrite`` and it holds ``marker`` (so only a folder
    this tool wrote is ever replaced). On any error nothing is left behind: no temp folder, no ``out_dir``
    (an overwritten folder is restored).
    """
    out_dir = Path(out_dir).expanduser()
    check_out_dir(out_dir, overwrite, marker)  # before any work
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    old_root = None
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; give the folder the usual permissions
        build(tmp)
        check_out_dir(out_dir, overwrite, marker)  # again: something may have appeared meanwhile
        if out_dir.exists():
            if any(out_dir.iterdir()):
                old_root = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
                os.rename(out_dir, old_root / "old")
            else:
                out_dir.rmdir()
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if old_root is not None:
                os.rename(old_root / "old", out_dir)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # already renamed on success
        if old_root is not None:
            shutil.rmtree(old_root, ignore_errors=True)
    return out_dir
