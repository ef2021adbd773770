"""The documentation's code blocks (README.md, docs/*.md) run as written, through Sybil and the
repository's conftest.py: the Python blocks in one pytest session under ``mpiexec -n 2`` (every
page's blocks in order, one namespace per page), the shell blocks in a single-process session.
A block that must not run says why in a ``<!-- skip: next "..." -->`` comment right before it."""
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_mpi_suite import launcher

pytest.importorskip("sybil", reason="the test extra installs sybil, which runs the docs' blocks")
from sybil import Document  # noqa: E402
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "docs"]
# the languages a fence may name: python, bash and console (a transcript) run; text and json are shown
LANGUAGES = {"python", "bash", "console", "text", "json"}
PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE"]


def docs_session(cwd, paths, mpi: bool, timeout: int):
    """One pytest session over `paths` (in `cwd`): the Python blocks under mpiexec -n 2 (mpi),
    else the shell blocks."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("AL_DOCS_MPI", None)
    cmd = [sys.executable, *PYTEST, "--timeout=300", *paths]
    if mpi:
        env["AL_DOCS_MPI"] = "1"
        cmd = [*launcher(), "-n", "2", sys.executable, *PYTEST, "--with-mpi", "-x",
               "--timeout=120", "--timeout-method=thread", *paths]
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return proc.returncode, proc.stdout


def test_python_blocks_under_mpiexec():
    rc, out = docs_session(ROOT, DOCS, mpi=True, timeout=600)
    print(out[-20000:])
    assert rc == 0 and " passed" in out and " failed" not in out, out[-8000:]


def test_shell_blocks():
    rc, out = docs_session(ROOT, DOCS, mpi=False, timeout=900)
    print(out[-20000:])
    assert rc == 0 and " passed" in out and " failed" not in out, out[-8000:]


def fences(path: Path):
    """(line, info string) of every fenced block of a Markdown file, as Sybil lexes them."""
    doc = Document(path.read_text(encoding="utf-8"), str(path))
    lexer = RawFencedCodeBlockLexer(info_pattern=re.compile(r"(?P<info>[^\n]*)\n", re.MULTILINE))
    for region in lexer(doc):
        yield doc.text.count("\n", 0, region.start) + 1, region.lexemes["info"].strip()


def test_every_fence_names_a_language_that_is_run_or_shown():
    """An unnamed fence (or ```py, or ```python with more words) would hide code from the runs
    above: each names exactly one of LANGUAGES. python, bash and console run (or are skipped
    with a reason); text and json are output."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = [f"{p.relative_to(ROOT)}:{line}: {info or '(no language)'}"
           for p in pages for line, info in fences(p) if info not in LANGUAGES]
    assert sum(1 for p in pages for _ in fences(p)) > 100
    assert not bad, "fences must name one of " + ", ".join(sorted(LANGUAGES)) + ":\n" + "\n".join(bad)


NEW_PAGE = textwrap.dedent('''\
    # A new page

    ```python
    import aluminum_py as al
    comm = al.Communicator()
    ```

    <!-- skip: next "an excerpt: the whole program is elsewhere" -->
    ```python
    undefined_name.Allreduce(x)
    ```

    ```python
    comm.Allreduce(x)        # x was never defined: this block fails
    ```

    ```bash
    python -c "import aluminum_py"
    ```

    <!-- skip: next "a synopsis" -->
    ```bash
    python -m aluminum_py bench crossover [options]
    ```

    ```bash
    python -m aluminum_py no-such-command
    ```

    ```console
    $ python -c "
    print('one'); print('two')
    print('three')"
    one
    ...
    three
    ```

    ```console
    $ python -c "print(6 * 7)"
    24
    ```
    ''')


@pytest.mark.parametrize("mpi", [True, False], ids=["python", "shell"])
def test_an_unmarked_block_that_does_not_run_fails(tmp_path, mpi):
    """A page added with blocks that fail and are not marked: the run fails on those blocks
    alone (a Python block using an undefined name, a shell command that exits 1, a transcript
    whose output differs); the marked ones are skipped, the good ones pass. The repository's
    conftest.py, on a copy of the layout."""
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "new.md").write_text(NEW_PAGE)
    rc, out = docs_session(tmp_path, ["docs"], mpi=mpi, timeout=300)
    lines = NEW_PAGE.splitlines()
    failing = ["comm.Allreduce(x)"] if mpi else ["no-such-command", "print(6 * 7)"]
    fences = [next(i for i, text in enumerate(lines) if f in text) for f in failing]  # 1-based: the fence
    assert rc == 1, out
    for line in fences:
        assert f"docs/new.md::line:{line},column:1" in out, out
    assert f"{len(fences)} failed" in out and " skipped" in out, out
    if not mpi:
        assert "printed:\n42\nthe page shows:\n24" in out, out
