"""The documentation's code blocks as tests (Sybil): every ```python, ```bash and ```console
block of README.md and docs/*.md runs, unless an HTML comment right before it says why not:

    <!-- skip: next "excerpt: the complete program is examples/mlp_numpy.py" -->

Python blocks run in a pytest session launched under ``mpiexec -n 2`` with AL_DOCS_MPI=1, one
namespace per page, its blocks in page order (so a page's later blocks see the names of the
earlier ones). Shell blocks (which must exit 0) and console transcripts (whose `$ ` commands
must print what is shown under them; a line ``...`` stands for any lines) run in a
single-process session, in a temporary directory with links to the repository's examples/,
bench/, tests/ and docs/. tests/test_docs.py launches both sessions;
``python -m pytest README.md docs`` runs the second alone. The other fences of the docs name a
language that is only shown (``text``, ``json``): tests/test_docs.py checks that none is left
unnamed.
"""
import atexit
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from unittest import SkipTest

import pytest

try:
    from sybil import Sybil
    from sybil.parsers.markdown import (ClearNamespaceParser, CodeBlockParser,
                                        PythonCodeBlockParser, SkipParser)
except ImportError:          # sybil comes with the test extra; without it the docs are not collected
    Sybil = None

ROOT = Path(__file__).resolve().parent


def source_tree_is_built() -> bool:
    """Whether the source tree's aluminum_py holds its compiled core (``setup.py build_ext
    --inplace``, or an editable install): then the tests import it from there."""
    return any((ROOT / "aluminum_py" / f"_core{suffix}").exists() for suffix in EXTENSION_SUFFIXES)


if not source_tree_is_built():
    # The tests are of an installed aluminum_py (``pip install '.[test]'``), and the source tree's
    # package, without its compiled core, must not shadow it: not in this process (``python -m
    # pytest`` puts the working directory first on sys.path, pytest this file's directory), and
    # not in the processes the tests start (``python -c`` and ``python -m`` put their working
    # directory first), which is why the run moves out of the source tree.
    sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]
    if Path.cwd().resolve() == ROOT:
        away = tempfile.mkdtemp(prefix="al-tests-")
        atexit.register(shutil.rmtree, away, ignore_errors=True)
        os.chdir(away)
    if importlib.util.find_spec("aluminum_py") is None:
        raise pytest.UsageError(
            f"aluminum_py is neither built in {ROOT} (python setup.py build_ext --inplace, or "
            "pip install -e .) nor installed (pip install .)")
UNDER_MPI = bool(os.environ.get("AL_DOCS_MPI"))
SHELL_TIMEOUT = 240          # seconds one shell block may take
LINKED = ("examples", "bench", "tests", "docs")


def bash(script: str):
    """Run `script` as a user would paste it (`python` and `mpiexec` are this venv's): its exit
    status and what it printed (stdout and stderr), or a message if it timed out."""
    with tempfile.TemporaryDirectory(prefix="al-docs-") as tmp:
        for name in LINKED:
            os.symlink(ROOT / name, Path(tmp) / name)
        bindir = os.path.dirname(sys.executable)
        env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""),
                   AL_TUNING_FILE=os.path.join(tmp, "tuning.json"), PYTHONUNBUFFERED="1")
        env.pop("AL_DOCS_MPI", None)
        try:
            proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=tmp, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=SHELL_TIMEOUT)
        except subprocess.TimeoutExpired as e:
            return None, f"timed out after {SHELL_TIMEOUT} s:\n{e.output or ''}"
        return proc.returncode, proc.stdout


def run_shell(example):
    """A ```bash block: it must exit 0."""
    rc, out = bash(example.parsed)
    if rc != 0:
        return f"shell block exited {rc}:\n{out[-6000:]}"
    return None


def transcript(text: str):
    """A ```console block as (command, output lines) pairs: a command starts at `$ ` and goes on
    over the next lines until bash reads it as complete (a quoted string over several lines)."""
    lines, items, i = text.splitlines(), [], 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            raise ValueError(f"a transcript's commands start with '$ ', got {lines[i]!r}")
        cmd, i = lines[i][2:], i + 1
        while i < len(lines) and subprocess.run(["bash", "-n", "-c", cmd],
                                                capture_output=True).returncode != 0:
            cmd, i = cmd + "\n" + lines[i], i + 1
        out = []
        while i < len(lines) and not lines[i].startswith("$ "):
            out.append(lines[i].rstrip())
            i += 1
        items.append((cmd, out))
    return items


def matches(expected, actual) -> bool:
    """Line by line, trailing blanks ignored; an expected line `...` stands for any lines."""
    if not expected:
        return not actual
    if expected[0].strip() == "...":
        return any(matches(expected[1:], actual[k:]) for k in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and matches(expected[1:], actual[1:])


def run_console(example):
    """A ```console block: its commands run in order in one shell, and each prints what is shown
    under it."""
    items = transcript(example.parsed)
    mark = "@@ al-docs: next command @@"
    rc, out = bash("\n".join(f"{cmd}\necho '{mark}'" for cmd, _ in items))
    if rc != 0:
        return f"transcript exited {rc}:\n{out[-6000:]}"
    outputs = out.split(mark + "\n")
    for (cmd, expected), got in zip(items, outputs):
        actual = [line.rstrip() for line in got.splitlines()]
        if not matches(expected, actual):
            return ("$ " + cmd + "\nprinted:\n" + "\n".join(actual) + "\nthe page shows:\n"
                    + "\n".join(expected))
    return None


def skipped(reason):
    def evaluate(example):
        raise SkipTest(reason)
    return evaluate


def only(parser, run: bool, reason: str):
    """`parser`'s examples, evaluated only in the session that runs them (`run`)."""
    def parse(document):
        for region in parser(document):
            if not run:
                region.evaluator = skipped(reason)
            yield region
    return parse


def is_doc(path: Path) -> bool:
    """README.md and docs/*.md, and nothing else under the repository."""
    try:
        rel = path.resolve().relative_to(ROOT)
    except ValueError:
        return False
    return rel.as_posix() == "README.md" or (rel.parent.as_posix() == "docs" and rel.suffix == ".md")


if Sybil is not None:
    class Docs(Sybil):
        def should_parse(self, path: Path) -> bool:
            return is_doc(path)

    pytest_collect_file = Docs(
        parsers=[
            only(PythonCodeBlockParser(), UNDER_MPI,
                 "Python blocks run under mpiexec -n 2 (tests/test_docs.py)"),
            only(CodeBlockParser("bash", run_shell), not UNDER_MPI,
                 "shell blocks run in the single-process session"),
            only(CodeBlockParser("console", run_console), not UNDER_MPI,
                 "transcripts run in the single-process session"),
            SkipParser(),
            ClearNamespaceParser(),
        ],
        path=".",
    ).pytest()
