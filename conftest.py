"""The documentation's code blocks as tests (Sybil): every ```python and ```bash block of
README.md and docs/*.md runs, unless an HTML comment right before it says why not:

    <!-- skip: next "excerpt: the complete program is examples/mlp_numpy.py" -->

Python blocks run in a pytest session launched under ``mpiexec -n 2`` with AL_DOCS_MPI=1, one
namespace per page, its blocks in page order (so a page's later blocks see the names of the
earlier ones); shell blocks run in a single-process session, each in a fresh ``bash -e``, in a
temporary directory with links to the repository's examples/, bench/, tests/ and docs/.
tests/test_docs.py launches both; ``python -m pytest README.md docs`` runs the shell blocks
alone. The other fences of the docs must name a language that is not run (``console``,
``text``, ``json``): tests/test_docs.py checks that none is left unnamed.
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import SkipTest

try:
    from sybil import Sybil
    from sybil.parsers.markdown import (ClearNamespaceParser, CodeBlockParser,
                                        PythonCodeBlockParser, SkipParser)
except ImportError:          # sybil comes with the test extra; without it the docs are not collected
    Sybil = None

ROOT = Path(__file__).resolve().parent
UNDER_MPI = bool(os.environ.get("AL_DOCS_MPI"))
SHELL_TIMEOUT = 240          # seconds one shell block may take
LINKED = ("examples", "bench", "tests", "docs")


def run_shell(example):
    """One shell block, as a user would paste it: `python` and `mpiexec` are this venv's."""
    with tempfile.TemporaryDirectory(prefix="al-docs-") as tmp:
        for name in LINKED:
            os.symlink(ROOT / name, Path(tmp) / name)
        bindir = os.path.dirname(sys.executable)
        env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""),
                   AL_TUNING_FILE=os.path.join(tmp, "tuning.json"), PYTHONUNBUFFERED="1")
        env.pop("AL_DOCS_MPI", None)
        try:
            proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", example.parsed], cwd=tmp,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=SHELL_TIMEOUT)
        except subprocess.TimeoutExpired as e:
            return f"shell block timed out after {SHELL_TIMEOUT} s:\n{e.output or ''}"
        if proc.returncode != 0:
            return f"shell block exited {proc.returncode}:\n{proc.stdout[-6000:]}"
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
            SkipParser(),
            ClearNamespaceParser(),
        ],
        path=".",
    ).pytest()
