"""Fixtures shared by the stand-in tests: the driver-lock rule around every test (no device call
holds the GIL while another thread waits in the driver: cuda_standin.driver_lock, on in
tests/test_mpi_suite.py's runs), and the NCCL stand-in for test_nccl_path.py, test_nccl_api.py."""
import os

import pytest

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
