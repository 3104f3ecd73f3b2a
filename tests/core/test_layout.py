"""The package layout holds: the core imports no tool, ``import hf_asymkv`` loads nothing heavy and its public
names load the core only and quickly, and no module imports another module's ``_private`` name."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hf_asymkv"
CORE = PACKAGE / "core"
KERNELS = PACKAGE / "kernels"
# What the core may import from the package besides itself: the version string and the kernels (the ground floor
# below the core: they import nothing else from the package).
CORE_ALLOWED = ("hf_asymkv.core", "hf_asymkv.version", "hf_asymkv.kernels")
TOOLING_THIRD_PARTY = ("matplotlib", "datasets", "safetensors.torch", "accelerate", "triton")
IMPORT_SECONDS = 1.0  # our own import time on top of torch + transformers (measured: ~0.02 s)


def _module_name(path: Path, root: Path = PACKAGE.parent) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path = PACKAGE.parent) -> list[tuple[str, list[str], int]]:
    """``(absolute module, imported names, line)`` for every import statement in ``path`` (nested ones too: inside
    functions and classes)."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            names = [alias.name for alias in node.names]
            # `from . import x` imports the module `package.x`
            found.append((target, names, node.lineno))
            if node.module is None:
                found += [(f"{target}.{name}", [], node.lineno) for name in names]
    return found


CORE_FILES = sorted(CORE.rglob("*.py"))
PACKAGE_FILES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", CORE_FILES, ids=[p.name for p in CORE_FILES])
def test_core_imports_no_tool(path):
    bad = [(target, line) for target, _, line in _imports(path)
           if target.startswith("hf_asymkv") and not target.startswith(CORE_ALLOWED)]
    assert not bad, f"{path.relative_to(PACKAGE.parent)} imports tooling: {bad}"


KERNEL_FILES = sorted(KERNELS.rglob("*.py"))


@pytest.mark.parametrize("path", KERNEL_FILES, ids=[p.name for p in KERNEL_FILES])
def test_kernels_import_nothing_else_from_the_package(path):
    bad = [(target, line) for target, _, line in _imports(path)
           if target.startswith("hf_asymkv") and not target.startswith("hf_asymkv.kernels")]
    assert not bad, f"{path.relative_to(PACKAGE.parent)} imports from the package: {bad}"


@pytest.mark.parametrize("path", PACKAGE_FILES, ids=[str(p.relative_to(PACKAGE)) for p in PACKAGE_FILES])
def test_no_private_name_imported_from_another_module(path):
    bad = [(target, name, line) for target, names, line in _imports(path) for name in names
           if target.startswith("hf_asymkv") and name.startswith("_") and not name.startswith("__")]
    assert not bad, f"{path.relative_to(PACKAGE.parent)} imports private names: {bad}"


def test_walker_sees_relative_imports():
    """The checks above are only as good as the import walker: it must resolve relative imports."""
    targets = {t for t, _, _ in _imports(CORE / "cache.py")}
    assert {"hf_asymkv.core.layer", "hf_asymkv.core.config", "hf_asymkv.core.pretrained"} <= targets
    targets = {t for t, _, _ in _imports(PACKAGE / "cli" / "app.py")}
    assert "hf_asymkv.models" in targets and "hf_asymkv.cli.demo" in targets


def _import_loops(files: list[Path], root: Path = PACKAGE.parent) -> list[list[str]]:
    """Every import loop among ``files`` (modules importing each other directly or through others), module-level or
    inside functions: the strongly connected components of more than one module of the graph "module -> the
    package modules it imports" (``from pkg import submodule`` is an edge to the submodule)."""
    modules = {_module_name(p, root): p for p in files}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for target, names, _ in _imports(path, root):
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            targets.update(submodules or ([target] if target in modules else []))
        graph[name] = targets - {name}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                loops.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return loops


def test_no_import_loop_in_the_package():
    assert not _import_loops(PACKAGE_FILES), "modules import each other (at module level or inside functions)"


def test_the_loop_check_sees_a_loop_through_a_function_level_import(tmp_path):
    """A fixture package: ``a`` imports ``b`` at module level, ``b`` imports ``a`` inside a function (what
    ``bench/peers.py`` and ``bench/schemes.py`` did, issue 41); ``c`` imports both without a loop."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import B\nA = 1\n")
    (package / "b.py").write_text("B = 2\n\ndef late():\n    from . import a\n    return a.A\n")
    (package / "c.py").write_text("from pkg import a, b\n")
    assert _import_loops(sorted(package.glob("*.py")), tmp_path) == [["pkg.a", "pkg.b"]]
    (package / "b.py").write_text("B = 2\n")
    assert _import_loops(sorted(package.glob("*.py")), tmp_path) == []


_PROBE = """
import sys, time
t0 = time.perf_counter()
import torch, transformers
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache
before = set(sys.modules)
t1 = time.perf_counter()
import hf_asymkv
hf_asymkv.AsymKVCache, hf_asymkv.KVScales, hf_asymkv.register_attention
t2 = time.perf_counter()
print(t2 - t1)
print(" ".join(sorted(m for m in sys.modules if m.startswith("hf_asymkv"))))
print(" ".join(sorted(set(sys.modules) - before)))
"""


@pytest.fixture(scope="module")
def fresh_import() -> tuple[float, list[str], set[str]]:
    """``import hf_asymkv`` in a new interpreter after torch and transformers' cache module: (our seconds, best of 3),
    our modules, every module that import added (transformers 5.0 loads safetensors.torch itself)."""
    runs = [subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout
            for _ in range(3)]
    seconds = min(float(r.splitlines()[0]) for r in runs)
    lines = runs[0].splitlines()
    return seconds, lines[1].split(), set(lines[2].split())


def test_import_loads_the_core_only(fresh_import):
    _, ours, _ = fresh_import
    tools = [m for m in ours if not m.startswith(CORE_ALLOWED) and m != "hf_asymkv"]
    assert not tools, f"import hf_asymkv loaded tooling modules: {tools}"
    assert "hf_asymkv.core.cache" in ours


def test_import_loads_no_tool_dependency(fresh_import):
    _, _, modules = fresh_import
    assert not [m for m in TOOLING_THIRD_PARTY if m in modules]


def test_import_time(fresh_import):
    seconds, _, _ = fresh_import
    assert seconds < IMPORT_SECONDS, f"import hf_asymkv took {seconds:.2f} s beyond torch + transformers"


def test_bare_import_loads_neither_torch_nor_transformers():
    """``import hf_asymkv`` (what ``hf-asymkv --help`` pays for) defers the core to the first public name used."""
    code = ("import sys, hf_asymkv; print(' '.join(m for m in ('torch', 'transformers', 'hf_asymkv.core') "
            "if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []


def test_public_names_resolve_and_unknown_names_fail():
    import hf_asymkv
    from hf_asymkv.core.config import KEY_FORMATS, VALUE_BITS

    assert hf_asymkv.KEY_FORMATS is KEY_FORMATS and hf_asymkv.VALUE_BITS is VALUE_BITS
    assert all(getattr(hf_asymkv, name) is not None for name in hf_asymkv.__all__)
    assert set(hf_asymkv.__all__) <= set(dir(hf_asymkv))
    with pytest.raises(AttributeError, match="no attribute 'KEY_FORMAT'.*public names"):
        hf_asymkv.KEY_FORMAT


# Settings flow as one object: layers and stores take a LayerConfig / QuantSpec / Growth, not loose settings.
MAX_SETTINGS_ARGUMENTS = 5


def _settings_arguments() -> dict[str, list[str]]:
    """``{callable: [its parameters named like an AsymKVConfig field]}`` for every public callable of the core
    (functions, classes, methods) apart from AsymKVConfig itself."""
    import dataclasses
    import importlib
    import inspect

    from hf_asymkv.core.config import AsymKVConfig

    names = {f.name for f in dataclasses.fields(AsymKVConfig)} | {"block_size"}
    found = {}
    for path in CORE_FILES:
        module = importlib.import_module(_module_name(path))
        for public in getattr(module, "__all__", ()):
            obj = getattr(module, public)
            targets = [(public, obj)] if callable(obj) else []
            if inspect.isclass(obj) and obj is not AsymKVConfig:
                targets += [(f"{public}.{n}", m) for n, m in vars(obj).items() if inspect.isfunction(m)]
            elif obj is AsymKVConfig:
                targets = []
            for name, fn in targets:
                try:
                    params = inspect.signature(fn).parameters
                except (TypeError, ValueError):
                    continue
                found[f"{module.__name__}.{name}"] = [p for p in params if p in names]
    return found


def test_no_core_callable_takes_more_than_five_settings():
    found = _settings_arguments()
    assert "hf_asymkv.core.layer.AsymKVLayer" in found  # the walker sees the layer
    too_many = {name: params for name, params in found.items() if len(params) > MAX_SETTINGS_ARGUMENTS}
    assert not too_many, f"pass an AsymKVConfig / LayerConfig instead of loose settings: {too_many}"


# Names and facts defined once (issue 23): a constant assigned in two modules drifts (two SUPPORTED_CONFIG_VERSIONS
# with different meanings, FP8_E4M3_MAX twice).
ONCE = ("FP8_E4M3_MAX", "SUPPORTED_")


def _assigned_names(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [target.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Name)]


def test_constants_are_defined_once():
    where: dict[str, list[str]] = {}
    for path in PACKAGE_FILES:
        for name in _assigned_names(path):
            if name.startswith(ONCE):
                where.setdefault(name, []).append(str(path.relative_to(PACKAGE)))
    assert "FP8_E4M3_MAX" in where and "SUPPORTED_CONFIG_VERSIONS" in where
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"define each constant in one module and import it elsewhere: {twice}"


# Dependencies point one way (issue 24): evaluations build on the benchmarks' schemes, never the reverse; tools
# use only what a core module exports.
SCRIPTS = PACKAGE.parent / "scripts"
TOOL_FILES = [p for p in PACKAGE_FILES if CORE not in p.parents] + sorted(SCRIPTS.glob("*.py"))


@pytest.mark.parametrize("path", sorted((PACKAGE / "bench").rglob("*.py")), ids=lambda p: p.name)
def test_bench_does_not_import_evals(path):
    bad = [(target, line) for target, _, line in _imports(path) if target.startswith("hf_asymkv.evals")]
    assert not bad, f"{path.relative_to(PACKAGE.parent)} imports the evaluations (they import bench): {bad}"


def _core_exports(module: str) -> set[str]:
    import importlib

    return set(getattr(importlib.import_module(module), "__all__", ()))


@pytest.mark.parametrize("path", TOOL_FILES, ids=[str(p.relative_to(PACKAGE.parent)) for p in TOOL_FILES])
def test_tools_import_only_exported_core_names(path):
    bad = [(target, name, line) for target, names, line in _imports(path) if target.startswith("hf_asymkv.core.")
           for name in names if name not in _core_exports(target)]
    assert not bad, f"{path.relative_to(PACKAGE.parent)} imports core names outside their module's __all__: {bad}"


def test_registry_and_scheme_names_load_without_torch():
    """The command line lists presets, formats and scheme names from plain modules (``--help`` stays fast)."""
    code = ("import sys; import hf_asymkv.core.registry, hf_asymkv.bench.schemes; "
            "print(' '.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []
