"""aluminum_py/_core.pyi against the compiled aluminum_py._core, both ways: every public name of
_core is in the stub and every name of the stub is in _core; per class, its public members
(methods, properties, attributes; a stub base's count for its subclasses, as at run time); per
function and method whose signature the compiled module reports, the parameter names in order and
which of them have defaults.  A name added to ext/ without its stub line (or a stub line left
behind) fails here, naming it."""
import ast
import inspect
import types
from pathlib import Path

import pytest

import aluminum_py
from aluminum_py import _core

STUB = Path(aluminum_py.__file__).with_name("_core.pyi")


def _stub_names(body) -> dict:
    """Name -> ast node of a module's or class's body (functions, classes, annotated or plain
    assignments)."""
    out = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node
    return out


STUB_NAMES = _stub_names(ast.parse(STUB.read_text(), str(STUB)).body)
STUB_CLASSES = {n: node for n, node in STUB_NAMES.items() if isinstance(node, ast.ClassDef)}


def _public(names) -> set:
    return {n for n in names if not n.startswith("_")}


def core_names() -> set:
    """The public names of _core (modules it imported are not its API)."""
    return {n for n in _public(dir(_core)) if not isinstance(getattr(_core, n), types.ModuleType)}


def stub_members(name: str) -> dict:
    """The public members the stub gives class `name`, with those of its stub bases."""
    node = STUB_CLASSES[name]
    members = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in STUB_CLASSES:
            members.update(stub_members(base.id))
    members.update({n: m for n, m in _stub_names(node.body).items() if not n.startswith("_")})
    return members


def core_classes() -> list[str]:
    return sorted(n for n in core_names() if isinstance(getattr(_core, n), type))


def test_every_public_name_of_core_is_in_the_stub():
    missing = sorted(core_names() - set(STUB_NAMES))
    assert not missing, f"in aluminum_py._core but not in _core.pyi: {missing}"


def test_every_name_of_the_stub_is_in_core():
    extra = sorted(n for n in STUB_NAMES if not hasattr(_core, n))
    assert not extra, f"in _core.pyi but not in aluminum_py._core: {extra}"


@pytest.mark.parametrize("name", sorted(set(core_classes()) | set(STUB_CLASSES)))
def test_class_members_both_ways(name):
    if name not in STUB_CLASSES or not hasattr(_core, name):
        pytest.skip("the class itself is missing on one side (the tests above name it)")
    runtime = _public(dir(getattr(_core, name)))
    stub = set(stub_members(name))
    assert not runtime - stub, f"_core.{name} members not in _core.pyi: {sorted(runtime - stub)}"
    assert not stub - runtime, f"_core.pyi's {name} members not in _core: {sorted(stub - runtime)}"


def _stub_params(fn: ast.FunctionDef) -> list[tuple[str, bool]]:
    """(name, has a default) of every parameter, in order (positional then keyword-only)."""
    a = fn.args
    positional = a.posonlyargs + a.args
    with_default = len(positional) - len(a.defaults)
    out = [(p.arg, i >= with_default) for i, p in enumerate(positional)]
    if a.vararg:
        out.append(("*" + a.vararg.arg, False))
    out += [(p.arg, d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append(("**" + a.kwarg.arg, False))
    return out


def _runtime_params(obj) -> list[tuple[str, bool]] | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None                     # a builtin without a signature: nothing to compare
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [(prefix.get(p.kind, "") + p.name, p.default is not p.empty)
            for p in sig.parameters.values()]


def _signatures():
    """(qualified name, stub node, runtime object) of every stub function and method present in
    _core (properties and __init__ excluded: the compiled classes report no signature)."""
    for name, node in STUB_NAMES.items():
        if isinstance(node, ast.FunctionDef) and hasattr(_core, name):
            yield name, node, getattr(_core, name)
    for cname, cnode in STUB_CLASSES.items():
        cls = getattr(_core, cname, None)
        for name, node in _stub_names(cnode.body).items():
            if (isinstance(node, ast.FunctionDef) and not name.startswith("__")
                    and not any(isinstance(d, ast.Name) and d.id == "property"
                                for d in node.decorator_list)
                    and cls is not None and hasattr(cls, name)):
                yield f"{cname}.{name}", node, getattr(cls, name)


def test_parameters_match():
    wrong = []
    for name, node, obj in _signatures():
        runtime = _runtime_params(obj)
        if runtime is not None and runtime != _stub_params(node):
            wrong.append(f"{name}: _core.pyi {_stub_params(node)}, _core {runtime}")
    assert not wrong, "parameters differ:\n" + "\n".join(wrong)
