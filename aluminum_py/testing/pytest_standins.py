"""pytest plugin: run GPU tests written for CuPy on the CUDA and NCCL stand-ins.

    mpiexec -n 2 python -m pytest -p aluminum_py.testing.pytest_standins tests/gpu --with-mpi

Points ``AL_CUDA_LIBRARY`` and ``AL_NCCL_LIBRARY`` at the stand-in library (built if needed)
unless they are set, before aluminum_py loads a driver, and makes ``import cupy`` give
:mod:`aluminum_py.testing.cupy_standin`. Only for test processes: it replaces CuPy.
The stand-in models CUDA's driver lock (``AL_STANDIN_DRIVER_LOCK=1`` unless set), and a test
during which a device call held the GIL while another thread waited in the driver fails."""
import os

import pytest

from . import cuda_standin, cupy_standin

_path = cuda_standin.path()
os.environ.setdefault("AL_CUDA_LIBRARY", _path)
os.environ.setdefault("AL_NCCL_LIBRARY", _path)
os.environ.setdefault("AL_STANDIN_DRIVER_LOCK", "1")
cupy_standin.install()


@pytest.fixture(autouse=True)
def _standin_driver_lock():
    with cuda_standin.no_driver_lock_violations():
        yield
