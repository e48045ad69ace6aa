"""The package's shape, computed from the source (nothing listed by hand):
no import cycle anywhere in jaxbatch/ (lazy, function-level and `if TYPE_CHECKING:` imports
included), the host-only layers never import jax, directly or through anything they import, and
the top of jaxbatch/ holds at most five modules (the rest live in their subsystem's package)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import REPO

PKG = pathlib.Path(REPO) / "jaxbatch"
DEVICE_LIBS = {"jax", "jaxlib", "flax", "orbax"}
# host-only: every module under these packages, and these modules
HOST_ONLY_PACKAGES = ("jaxbatch.core", "jaxbatch.planner", "jaxbatch.api")
HOST_ONLY_MODULES = ("jaxbatch.config", "jaxbatch.batch.files",
                     "jaxbatch.batch.records", "jaxbatch.engine.client", "jaxbatch.lora",
                     "jaxbatch.lora.slots", "jaxbatch.spec_decode.ngram",
                     "jaxbatch.planner.live")
MAX_MODULES_PER_FOLDER = 15
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 100


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(name: str, path: pathlib.Path, modules: set[str], eager_only: bool = False
             ) -> tuple[set[str], set[str]]:
    """-> (jaxbatch modules imported, top-level third-party names imported), from every import
    statement in the file, those under `if TYPE_CHECKING:` included (a loop a type checker
    must resolve is still a loop); with `eager_only`, only those that run when the module is
    imported (not inside a function, not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    deferred = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    skip = {id(n) for t in ast.walk(tree)
            if eager_only and (_is_type_checking(t) or isinstance(t, deferred))
            for n in ast.walk(t) if n is not t or _is_type_checking(t)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    internal, external = set(), set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod when there is one
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            targets = subs if len(subs) == len(node.names) else [base, *subs]
        for t in targets:
            if t == "jaxbatch" or t.startswith("jaxbatch."):
                while t not in modules:  # `import jaxbatch.x.y` of a name inside a module
                    t = t.rpartition(".")[0]
                internal.add(t)
            else:
                external.add(t.split(".")[0])
    internal.discard(name)
    return internal, external


@pytest.fixture(scope="module")
def graph():
    mods = _modules()
    return {n: _imports(n, p, set(mods)) for n, p in mods.items()}


@pytest.fixture(scope="module")
def eager_graph():
    """Imports that run at import time (a package's lazy __getattr__ does not)."""
    mods = _modules()
    return {n: _imports(n, p, set(mods), eager_only=True) for n, p in mods.items()}


def test_graph_is_read_from_the_source(graph):
    """A guard against a vacuous pass: the parser sees the engine's real imports."""
    assert "jaxbatch.core.scheduler" in graph["jaxbatch.engine.engine"][0]
    assert "jax" in graph["jaxbatch.worker.runner"][1]
    assert len(graph) > 40


def test_type_checking_imports_are_in_the_graph(tmp_path):
    """A guard for the cycle test: an import under `if TYPE_CHECKING:` is an edge."""
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                 "    from jaxbatch.core.request import Request\n")
    mods = {"jaxbatch.core.request", "jaxbatch.m"}
    assert _imports("jaxbatch.m", f, mods)[0] == {"jaxbatch.core.request"}
    assert _imports("jaxbatch.m", f, mods, eager_only=True)[0] == set()


def test_top_level_holds_at_most_five_modules():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 5, top


def test_no_folder_holds_more_than_fifteen_modules():
    """A package per role: a folder past fifteen modules is several rooms in one."""
    crowded = {}
    for d in [PKG, *(p for p in PKG.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        mods = [p.name for p in d.glob("*.py") if p.name != "__init__.py"]
        if len(mods) > MAX_MODULES_PER_FOLDER:
            crowded[str(d.relative_to(PKG.parent))] = len(mods)
    assert not crowded, crowded


def test_files_and_functions_stay_short():
    """No product module over 500 lines, no function over 100 (split where a name explains the
    part)."""
    long_files, long_funcs = {}, {}
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        rel = str(path.relative_to(PKG.parent))
        if text.count("\n") > MAX_FILE_LINES:
            long_files[rel] = text.count("\n")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_funcs[f"{rel}:{node.name}"] = n
    assert not long_files, long_files
    assert not long_funcs, long_funcs


def test_no_import_cycles(graph):
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v][0]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def _host_only(graph) -> list[str]:
    return sorted(m for m in graph if m in HOST_ONLY_MODULES
                  or any(m == p or m.startswith(p + ".") for p in HOST_ONLY_PACKAGES))


def test_host_only_layers_never_import_jax(graph, eager_graph):
    """Everything a host-only module imports, at any depth and inside functions too, is free of
    jax; importing a module also runs its parent packages' __init__ (their eager imports)."""
    host = _host_only(graph)
    assert "jaxbatch.core.scheduler" in host and "jaxbatch.planner.step" in host
    bad = {}
    for start in host:
        todo, seen = [start], set()
        parents_seen: set[str] = set()
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            todo += graph[m][0]
            for i in range(1, m.count(".") + 1):
                parent = ".".join(m.split(".")[:i])
                if parent not in parents_seen:
                    parents_seen.add(parent)
                    todo += eager_graph[parent][0]
                    if eager_graph[parent][1] & DEVICE_LIBS:
                        bad.setdefault(start, []).append(f"{parent} imports a device library")
        hits = sorted(f"{m} imports {lib}" for m in seen for lib in graph[m][1] & DEVICE_LIBS)
        if hits:
            bad.setdefault(start, []).extend(hits)
    assert not bad, bad


def test_host_only_layers_import_without_jax_at_run_time(graph):
    names = ", ".join(_host_only(graph))
    code = (f"import sys; import {names}; "
            "bad = [m for m in sys.modules if m.split('.')[0] in {'jax', 'jaxlib', 'flax', "
            "'orbax'}]; assert not bad, bad[:5]")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
