"""README.md and docs/ stay true to the repository: every relative link reaches a file (and a heading, for an
anchor), every quoted ``hf-asymkv ...`` command parses with the real parser (nothing runs), every quoted script and
repository path exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from hf_asymkv.cli.app import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "scripts" / "studies" / "README.md"]
FENCE = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SHELL_FENCES = ("", "bash", "sh", "shell", "console")
REPO_DIRS = ("results", "scripts", "hf_asymkv", "tests", "docs", "model_cards", ".ci")


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """The page without its fenced blocks (their lines blanked, so line numbers still count)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", _prose(page.read_text()), re.M)
    return {_slug(h) for h in headings}


def _links() -> list[tuple[Path, int, str]]:
    found = []
    for page in PAGES:
        prose = _prose(page.read_text())
        for number, line in enumerate(prose.splitlines(), 1):
            found += [(page, number, target) for target in LINK.findall(line)
                      if not re.match(r"[a-z]+:", target)]  # http(s):, mailto: ... are not files here
    return found


LINKS = _links()


@pytest.mark.parametrize("page, line, target", LINKS, ids=[f"{_name(p)}:{n}:{t}" for p, n, t in LINKS])
def test_relative_link_reaches_a_file_and_heading(page, line, target):
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    assert resolved.exists(), f"{_name(page)}:{line}: {target} -> {resolved} does not exist"
    assert ROOT in resolved.parents or resolved == ROOT, f"{_name(page)}:{line}: {target} leaves the repository"
    if anchor:
        assert resolved.suffix == ".md", f"{_name(page)}:{line}: anchor on a non-markdown file {target}"
        assert anchor in _anchors(resolved), f"{_name(page)}:{line}: no heading #{anchor} in {_name(resolved)}"


def _shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command) for every line of a page's shell fences (continuations joined) and every inline
    code span, each a candidate command."""
    found = []
    for fence in FENCE.finditer(text):
        if fence.group(1) not in SHELL_FENCES:
            continue
        first = text[:fence.start(2)].count("\n") + 1
        pending, pending_line = "", 0
        for i, raw in enumerate(fence.group(2).splitlines()):
            pending, pending_line = (pending + " " + raw, pending_line) if pending else (raw, first + i)
            if pending.endswith("\\"):  # a continued line: join it with the next
                pending = pending[:-1]
            elif pending.strip():
                found.append((pending_line, pending))
                pending = ""
    prose = _prose(text)
    for span in re.finditer(r"`([^`]+)`", prose):
        found.append((prose[:span.start()].count("\n") + 1, " ".join(span.group(1).split())))
    return found


def _commands(kind: str, pages: list[Path] = PAGES) -> list[tuple[Path, int, list[str]]]:
    """``kind="cli"``: the argv after every ``hf-asymkv`` word; ``kind="script"``: every ``scripts/...`` path that
    a ``python``/``bash`` word runs."""
    found = []
    for page in pages:
        for number, line in _shell_lines(page.read_text()):
            try:
                lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
                lexer.whitespace_split, lexer.commenters = True, "#"
                words = list(lexer)
            except ValueError:  # an unbalanced quote in prose: not a command
                continue
            segments, current = [], []
            for word in words:
                if word in ("&&", "||", ";", "|", "&"):
                    segments.append(current)
                    current = []
                else:
                    current.append(word)
            segments.append(current)
            for seg in segments:
                programs = [i for i, w in enumerate(seg) if w == "hf-asymkv" or w.endswith("/hf-asymkv")]
                if kind == "cli" and programs:
                    found.append((page, number, seg[programs[0] + 1:]))
                runners = [i for i, w in enumerate(seg[:-1]) if w in ("python", "python3", "bash")]
                if kind == "script" and runners and seg[runners[0] + 1].startswith("scripts/"):
                    found.append((page, number, [seg[runners[0] + 1]]))
    return found


CLI = _commands("cli")
SCRIPTS = _commands("script")


@pytest.mark.parametrize("heading, anchor", [
    ("Speed: decode against DynamicCache at 1k-16k (the 0.1 default, CPU)",
     "speed-decode-against-dynamiccache-at-1k-16k-the-01-default-cpu"),
    ("Publishing scales (`hf-asymkv publish`, `AsymKVCache.from_pretrained`)",
     "publishing-scales-hf-asymkv-publish-asymkvcachefrom_pretrained"),
    ("0.2.0 (unreleased)", "020-unreleased"),
], ids=["punctuation", "code-and-underscore", "version"])
def test_slug_is_githubs(heading, anchor):
    assert _slug(heading) == anchor


def test_extraction_finds_fenced_continued_inline_and_chained_commands(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run `hf-asymkv memory --lengths\n4096` or:\n\n   ```bash\n   OMP_NUM_THREADS=1 hf-asymkv bench \\\n"
                    "     --lengths 1024 # a comment\n   pip install x && python scripts/layer_step.py --threads 1\n   ```\n")
    assert [(n, argv) for _, n, argv in _commands("cli", [page])] == [
        (5, ["bench", "--lengths", "1024"]), (1, ["memory", "--lengths", "4096"])]
    assert [(n, s) for _, n, s in _commands("script", [page])] == [(7, ["scripts/layer_step.py"])]


def test_a_wrong_documented_command_would_fail(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text("```bash\nhf-asymkv memory --schemes bogus\n```\n")
    (_, _, argv), = _commands("cli", [page])
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2 and "bogus" in capsys.readouterr().err


def test_the_docs_quote_commands():
    """The extraction itself works: the pages quote many commands, of every kind."""
    assert len(CLI) >= 30 and len(SCRIPTS) >= 8
    assert {argv[0] for _, _, argv in CLI if argv} >= {"demo", "calibrate", "eval", "bench", "memory", "publish",
                                                         "export-vllm"}


@pytest.mark.parametrize("page, line, argv", CLI, ids=[f"{_name(p)}:{n}:{' '.join(a)[:60]}" for p, n, a in CLI])
def test_documented_command_parses(page, line, argv, monkeypatch, capsys, tmp_path):
    """Parse only (argparse and the parse-time checks; no model loads, nothing is written), from the repository
    root, where the documented input files (results/...) are.

    A command named in prose without options (`hf-asymkv calibrate`) must name a real command: it is parsed with
    ``--help``. A ``~/...`` path (the Gemma-3 GGUF the measurements used) exists on the machine that measured, not
    here: the parse-time checks find an empty stand-in under a temporary home instead.
    """
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HOME", str(tmp_path))
    for word in argv:
        if word.startswith("~/"):
            stand_in = tmp_path / word[2:]
            if stand_in.suffix:
                stand_in.parent.mkdir(parents=True, exist_ok=True)
                stand_in.touch()
            else:
                stand_in.mkdir(parents=True, exist_ok=True)
    if argv and not any(word.startswith("-") for word in argv):
        argv = [*argv, "--help"]
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:  # --help exits 0; an argparse error exits 2 with its message on stderr
        assert exc.code == 0, f"{_name(page)}:{line}: hf-asymkv {shlex.join(argv)}\n{capsys.readouterr().err}"


@pytest.mark.parametrize("page, line, script", SCRIPTS, ids=[f"{_name(p)}:{n}:{s[0]}" for p, n, s in SCRIPTS])
def test_documented_script_exists(page, line, script):
    assert (ROOT / script[0]).is_file(), f"{_name(page)}:{line}: {script[0]} does not exist"


def _repo_paths() -> list[tuple[Path, int, str]]:
    """Inline code spans that are a bare repository path (``results/presets/smollm2.md``, ``scripts/``)."""
    found = []
    pattern = re.compile(r"`((?:%s)/[^`\s{}*<>]*)`" % "|".join(re.escape(d) for d in REPO_DIRS))
    for page in PAGES:
        prose = _prose(page.read_text())
        found += [(page, prose[:m.start()].count("\n") + 1, m.group(1)) for m in pattern.finditer(prose)]
    return found


PATHS = _repo_paths()


@pytest.mark.parametrize("page, line, path", PATHS, ids=[f"{_name(p)}:{n}:{s}" for p, n, s in PATHS])
def test_quoted_repository_path_exists(page, line, path):
    assert (ROOT / path).exists(), f"{_name(page)}:{line}: {path} does not exist"
