"""Atomic file and folder writes: build in a temp file/folder beside the destination, then rename, so that an
interrupted or failed write never leaves a half-written result where a reader looks.

A failed write raises an ``OSError`` that names the destination in plain words (:func:`output_problem`), never
the hidden temp name it was building. :func:`output_problem` is also what the command line checks its output
flags with while it parses them, so the same problem reads the same before the run and at the write.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["OUTPUT_KINDS", "atomic_write", "atomic_write_text", "check_out_dir", "output_problem",
           "usual_mode", "write_folder_atomically"]

OUTPUT_KINDS = ("file", "folder", "any")
"""What an output path must be: a file written whole, a folder (written into or replaced whole), or either."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def usual_mode(folder: bool = False) -> int:
    """The permissions a new file (or folder) gets here: ``0o666`` (``0o777``) less the process umask."""
    return (0o777 if folder else 0o666) & ~_umask()


def _writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK | os.X_OK)


def _nearest_existing(path: Path) -> Path:
    """``path``'s closest ancestor that exists (``Path(".")`` for a relative path whose first part is missing)."""
    for parent in path.parents:
        if parent.exists():
            return parent
    return Path(".")


def output_problem(path: str | Path, kind: str = "any", *, whole: bool = False) -> str | None:
    """Why ``path`` cannot be written as an output of ``kind``, in plain words; None when it can.

    Looks only at the file system (no write): an existing entry of the other kind, a missing parent that cannot
    be created because an ancestor is a file (``notes.txt/out``), or no permission to write where the file (or
    the temp file built beside it) goes. A root user passes every permission check, as the write itself would.

    Args:
        kind: ``"file"`` (written whole, through a temp file beside it), ``"folder"`` (files written into it) or
            ``"any"`` (the caller decides the kind later).
        whole: a folder built beside itself and renamed into place (publish, export): its parent must be
            writable too.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in OUTPUT_KINDS:
        raise ValueError(f"kind must be one of {list(OUTPUT_KINDS)}, got {kind!r}")
    shown = str(path)
    path = Path(path).expanduser()
    if path.exists():
        if kind == "file" and path.is_dir():
            return f"{shown!r} is a folder; give a file name"
        if kind == "folder" and not path.is_dir():
            return f"{shown!r} is a file; give a folder"
        where = path if path.is_dir() and not whole else path.parent
        if path.is_dir() and not _writable(path):
            return f"{shown!r} cannot be written: no permission to write in {str(path)!r}"
        if not _writable(where):
            return f"{shown!r} cannot be written: no permission to write in {str(where)!r}"
        return None
    ancestor = _nearest_existing(path)
    if not ancestor.is_dir():
        return f"{shown!r} cannot be created: {str(ancestor)!r} is a file, not a folder"
    if not _writable(ancestor):
        return f"{shown!r} cannot be created: no permission to write in {str(ancestor)!r}"
    return None


def _is_ours(name: Path, tmp: Path, final: Path) -> bool:
    """Whether ``name`` is the destination, the temp being built, or inside either (temp names start with
    ``.<final name>.``)."""
    hidden = f".{final.name}."
    return any(p in (tmp, final) or (p.parent == final.parent and p.name.startswith(hidden))
               for p in (name, *name.parents))


def _write_error(exc: OSError, tmp: Path, final: Path, kind: str, whole: bool = False) -> OSError:
    """``exc`` reworded to name ``final`` (never the temp name ``tmp`` it happened on, nor a file inside it), with
    the same type and errno; an error about another file (a source being read) is returned as it is."""
    reason = output_problem(final, kind, whole=whole)
    if reason is None:
        names = [Path(f) for f in (exc.filename, exc.filename2) if f]
        if names and not any(_is_ours(n, tmp, final) for n in names):
            return exc
        name = names[0] if names else final
        if name == tmp or tmp in name.parents:
            name = final / name.relative_to(tmp)
        elif not (name == final or final in name.parents):
            name = final  # a sibling temp (an earlier folder moved aside)
        detail = exc.strerror or str(exc).replace(str(tmp), str(final))
        reason = f"cannot write {str(name)!r}: {detail}"
    error = type(exc)(reason)
    error.errno = exc.errno
    return error


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` then rename the temp file onto ``path``; on any error remove the temp file.

    Raises:
        OSError: ``path`` cannot be written; the message names ``path`` (see :func:`output_problem`).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise _write_error(exc, path, path, "file") from None
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, usual_mode())  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise _write_error(exc, Path(tmp), path, "file") from None
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
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    except OSError as exc:
        raise _write_error(exc, out_dir, out_dir, "folder", whole=True) from None
    try:
        _build_and_rename(out_dir, tmp, build, overwrite, marker)
    except OSError as exc:
        raise _write_error(exc, tmp, out_dir, "folder", whole=True) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # already renamed on success
    return out_dir


def _build_and_rename(out_dir: Path, tmp: Path, build: Callable[[Path], None], overwrite: bool, marker: str) -> None:
    """The body of :func:`write_folder_atomically`: build in ``tmp``, then swap it with ``out_dir`` (an earlier
    folder there is moved aside first and restored if the rename fails)."""
    old_root = None
    try:
        os.chmod(tmp, usual_mode(folder=True))  # mkdtemp makes it 0700; give the folder the usual permissions
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
        if old_root is not None:
            shutil.rmtree(old_root, ignore_errors=True)
