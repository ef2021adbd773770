"""GPU suite: `mpiexec -n 2 python -m pytest -m gpu --with-mpi tests/gpu` on a machine with one
GPU per rank and CuPy installed. Every test skips cleanly without a CUDA device."""
import pytest

from aluminum_py.gpu import cuda_device_count


def pytest_collection_modifyitems(config, items):
    if cuda_device_count() > 0:
        return
    skip = pytest.mark.skip(reason="no CUDA device is available")
    for item in items:
        item.add_marker(skip)
