"""The two test tiers hold their promise: every test marked ``slow`` names a fast test of the same promise, and that
test exists and is in the fast tier (conftest.py deselects ``slow`` unless ``--slow``/``RUN_SLOW=1``).

Read from the source (ast), not from a collection: the check sees every test file, whatever subset a run collects.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import SLOW_TWIN

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _is_mark(node: ast.AST, name: str) -> bool:
    """``pytest.mark.<name>`` or ``pytest.mark.<name>(...)``."""
    node = node.func if isinstance(node, ast.Call) else node
    return isinstance(node, ast.Attribute) and node.attr == name and ast.unparse(node).endswith(f"mark.{name}")


def _marks(node: ast.AST) -> list[ast.AST]:
    """The marks a module-level ``pytestmark = ...`` assignment holds (one mark or a list of them)."""
    return list(node.elts) if isinstance(node, (ast.List, ast.Tuple)) else [node]


def _slow_marks(tree: ast.Module) -> tuple[list[ast.AST], dict[str, list[ast.AST]], dict[str, ast.AST]]:
    """``(module marks, {test: its slow marks}, {test: its node})`` of one test file, test classes' methods as
    ``Class::name`` and plain functions as ``name``."""
    module = [m for node in tree.body if isinstance(node, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
              for m in _marks(node.value) if _is_mark(m, "slow")]
    tests, nodes = {}, {}

    def visit(body, prefix="", inherited=()):
        for node in body:
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                visit(node.body, f"{node.name}::", [*inherited, *(d for d in node.decorator_list if _is_mark(d, "slow"))])
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                tests[prefix + node.name] = [*inherited, *(d for d in node.decorator_list if _is_mark(d, "slow"))]
                nodes[prefix + node.name] = node
    visit(tree.body)
    return module, tests, nodes


def _parsed() -> dict[Path, tuple]:
    return {path: _slow_marks(ast.parse(path.read_text(), str(path))) for path in sorted(TESTS.rglob("test_*.py"))}


FILES = _parsed()
SLOW = [(path, name, marks or module) for path, (module, tests, _) in FILES.items()
        for name, marks in tests.items() if marks or module]


def _reason(mark: ast.AST) -> str:
    if not isinstance(mark, ast.Call):
        return ""
    reason = next((k.value for k in mark.keywords if k.arg == "reason"), None)
    try:
        return str(ast.literal_eval(reason)) if reason is not None else ""
    except ValueError:  # an f-string or a name: read the source as it is
        return ast.unparse(reason)


def test_the_slow_tier_is_not_empty():
    assert len(SLOW) >= 10, "the slow tier holds almost nothing: is the marker still read?"


@pytest.mark.parametrize("path, name, marks", SLOW, ids=[f"{p.relative_to(TESTS)}::{n}" for p, n, _ in SLOW])
def test_slow_test_names_a_fast_twin_that_exists(path, name, marks):
    """The reason of the slow mark names ``tests/<file>.py::<test>``; that test is defined and not slow itself."""
    reasons = [_reason(mark) for mark in marks]
    twins = [twin for reason in reasons for twin in SLOW_TWIN.findall(reason)]
    assert twins, f"{path.name}::{name}: the slow mark's reason names no fast twin (tests/<file>.py::<test>): {reasons}"
    for twin in twins:
        file, test = twin.split("::")
        assert (ROOT / file).is_file(), f"{name}: its fast twin's file {file} does not exist"
        module, tests, _ = FILES[ROOT / file]
        matches = [t for t in tests if t == test or t.endswith(f"::{test}")]
        assert matches, f"{name}: {file} defines no test {test}"
        assert not module and not any(tests[t] for t in matches), f"{name}: its fast twin {twin} is slow itself"


def test_the_conftest_pattern_reads_a_twin():
    assert SLOW_TWIN.findall("interpreter, 40 s; fast twin: tests/core/test_cache.py::test_generate_matrix") == \
        ["tests/core/test_cache.py::test_generate_matrix"]
    assert not re.search(SLOW_TWIN, "no twin named here")


class _Item:
    """What ``conftest._check_twins`` reads of a collected test: its node id and its ``slow`` mark."""

    def __init__(self, nodeid: str, twin: str | None = None):
        self.nodeid, self.mark = nodeid, pytest.mark.slow(reason=f"fast twin: {twin}").mark if twin else None

    def get_closest_marker(self, name: str):
        return self.mark if name == "slow" else None


def test_a_slow_test_run_by_its_node_id_needs_no_twin_beside_it():
    """``pytest --slow tests/x.py::test_slow`` collects the slow test alone: its twin, not selected, is not looked
    for. Where the whole file is collected, a missing or slow twin is refused."""
    from conftest import _check_twins

    slow = _Item("tests/x.py::test_slow[a]", twin="tests/x.py::test_fast")
    _check_twins([slow], narrowed=True)
    with pytest.raises(pytest.UsageError, match="tests/x.py::test_slow -> tests/x.py::test_fast"):
        _check_twins([slow])
    with pytest.raises(pytest.UsageError, match="fast twin is not a fast test"):  # selected, but slow itself
        _check_twins([slow, _Item("tests/x.py::test_fast", twin="tests/y.py::test_z")], narrowed=True)
    _check_twins([slow, _Item("tests/x.py::test_fast")])
