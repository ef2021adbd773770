"""Fixtures shared by the stand-in tests: a communicator bound to a stand-in stream
(`bound`), the driver-lock rule around every test (no device call holds the GIL while another
thread waits in the driver: cuda_standin.driver_lock, on in tests/test_mpi_suite.py's runs), and
the NCCL stand-in for test_nccl_path.py, test_nccl_api.py."""
import os

import pytest

import aluminum_py as al
from aluminum_py import nccl
from aluminum_py.testing import cuda_standin as cs


@pytest.fixture(scope="module")
def standins():
    """The stand-in CuPy module, when AL_NCCL_LIBRARY names the NCCL stand-in (the pytest plugin
    aluminum_py.testing.pytest_standins is loaded); the module is skipped otherwise."""
    if os.environ.get("AL_NCCL_LIBRARY") != cs.path():
        pytest.skip("needs the NCCL stand-in (-p aluminum_py.testing.pytest_standins)")
    import cupy
    assert cupy.__name__ == "aluminum_py.testing.cupy_standin"
    assert nccl.library_path() == cs.path()
    return cupy


@pytest.fixture(autouse=True)
def driver_lock_rule():
    with cs.no_driver_lock_violations():
        yield


@pytest.fixture
def bound():
    """A communicator bound to a fresh non-blocking stand-in stream (the CUDA stand-in loaded:
    AL_CUDA_LIBRARY names it)."""
    assert os.environ.get("AL_CUDA_LIBRARY") == cs.path()
    cs.make_current(0)
    stream = cs.stream_create(1)
    comm = al.Communicator(stream=stream)
    yield comm, stream
    comm.Free()
    cs.stream_synchronize(stream)
    cs.stream_destroy(stream)
