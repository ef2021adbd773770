"""The package's module structure (docs/architecture.md): every module imports on its own, in a
fresh interpreter, and the module-level imports between aluminum_py's modules form no cycle.

A cycle is found from the source, not by importing: the graph has an edge A -> B for every
``import``/``from ... import`` in A (at module level or deferred inside a function: a deferred
import only hides a cycle from the interpreter, not from the reader; ``if TYPE_CHECKING:``
excluded) that names module B of the package, or names a package B (its ``__init__``) for
``from B import name`` where ``name`` is not a submodule. A package's ``__init__`` importing its
own submodules is the one allowed kind of edge back (the public re-exports)."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import aluminum_py

ROOT = Path(aluminum_py.__file__).parent
PACKAGE = "aluminum_py"


def modules() -> dict[str, Path]:
    """Every module of the package (pure-Python sources; compiled extensions have no imports of
    ours at module level), by dotted name."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_in(tree: ast.Module):
    """Every import statement of the module, at module level or deferred inside a function,
    except those under ``if TYPE_CHECKING:`` (never run)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and is_type_checking(node):
            todo += node.orelse
        else:
            todo += list(ast.iter_child_nodes(node))


def edges(name: str, path: Path, known: set[str]) -> set[str]:
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in imports_in(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
            for t in targets:
                while t and t not in known:
                    t = t.rpartition(".")[0]
                if t:
                    out.add(t)
            continue
        if node.level:
            base = here.split(".")
            base = base[:len(base) - (node.level - 1)]
            base = ".".join(base + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        if base not in known:
            continue
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            out.add(sub if sub in known else base)
    out.discard(name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, result = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                result.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return result


def compiled() -> set[str]:
    """The compiled extensions (aluminum_py._core, ...): modules too, with no imports of ours."""
    return {f"{PACKAGE}.{p.name.split('.')[0]}" for p in ROOT.glob("*.so")}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    names = set(known) | compiled()
    graph = {name: edges(name, path, names) for name, path in known.items()}
    return graph


def test_the_graph_sees_the_imports_it_must():
    """The parser finds known module-level imports (so an empty graph cannot pass for acyclic)."""
    graph = import_graph()
    assert "aluminum_py.errors" in graph["aluminum_py.communicator"]
    assert "aluminum_py.communicator" in graph["aluminum_py"]
    assert sum(len(e) for e in graph.values()) > 30


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    """In a cycle, neither module can be read, tested or changed without the other, and which
    names exist depends on import order (or on imports deferred into functions to dodge it)."""
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


MODULES = sorted(modules())
OPTIONAL = {f"{PACKAGE}.torch": "torch"}      # module -> the third-party package it needs


def importable(name: str) -> bool:
    """Whether the third-party package `name` needs (OPTIONAL) is installed."""
    import importlib.util
    return name not in OPTIONAL or importlib.util.find_spec(OPTIONAL[name]) is not None


@pytest.fixture(scope="module")
def imported_alone() -> dict:
    """Every module's `import <module>` in a fresh interpreter, several at once (each takes
    a fraction of a second of CPU, most of it importing numpy, mpi4py and torch): {name: the
    process}.  `import a.b.c` runs the ``__init__`` of `a`, then of `a.b`, first, so for a module
    that one of its packages already imports it is that package's import: the packages are
    imported alone first (each lists what it imported), then the modules none of them did."""
    from concurrent.futures import ThreadPoolExecutor
    env = dict(os.environ, PYTHONPATH=str(ROOT.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    paths = modules()

    def run(name):
        return subprocess.run(
            [sys.executable, "-c", f"import {name}; import sys; print(*sorted(sys.modules))"],
            capture_output=True, text=True, env=env, timeout=600)

    def alone(names) -> dict:
        with ThreadPoolExecutor(max_workers=2 * (os.cpu_count() or 1)) as pool:
            return dict(zip(names, pool.map(run, names)))

    wanted = [name for name in MODULES if importable(name)]
    done = alone([name for name in wanted if paths[name].name == "__init__.py"])
    for name in wanted:
        if name not in done:
            parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
            by = [done[p] for p in parents if p in done and name in done[p].stdout.split()]
            if by:
                done[name] = by[0]
    return {**done, **alone([name for name in wanted if name not in done])}


@pytest.mark.parametrize("name", MODULES)
def test_every_module_imports_alone(name, imported_alone):
    """`import <module>` in a fresh interpreter (no other module of ours imported first).
    ``aluminum_py.torch`` is the PyTorch integration: it needs torch (the package does not)."""
    if not importable(name):
        pytest.skip(f"{name} needs {OPTIONAL[name]}")
    r = imported_alone[name]
    assert r.returncode == 0, f"import {name} failed:\n{r.stderr[-3000:]}"
