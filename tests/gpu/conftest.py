"""GPU suite: `mpiexec -n 2 python -m pytest tests/gpu --with-mpi` on a machine with a CUDA
device (one per rank, or ranks sharing one GPU with their own NCCL_HOSTID: run_one_gpu.sh).
Every test skips cleanly without a CUDA device; the CuPy tests skip without CuPy and the PyTorch
tests without a CUDA-enabled PyTorch. Collection needs neither CuPy nor ml_dtypes, so the
parametrization (and the test count) is the same everywhere.

AL_TUNING_FILE is pointed at a missing file for the session, so that "auto" does not depend on
the tuning tables of the machine.

Fixtures:

* ``gpu_index`` (session): the device this rank uses, its local rank (MPI_COMM_TYPE_SHARED
  split of COMM_WORLD, computed once) modulo the device count.
* ``_use_gpu`` (autouse, every test): makes that device current (CuPy, and PyTorch once it has
  been imported) before the test runs, so that any ``-k`` selection runs on the right device on
  a node with several GPUs, whatever test ran first.
"""
import os
import sys
import tempfile

import pytest

from aluminum_py.gpu import cuda_device_count


def pytest_configure(config):
    """No tuning table: "auto" for GPU buffers then has one documented answer (NCCL when it
    loads, else host transfer) whatever tables this machine holds."""
    os.environ["AL_TUNING_FILE"] = os.path.join(tempfile.mkdtemp(prefix="al-gpu-suite-"),
                                                "no-tuning-table.json")


def pytest_collection_modifyitems(config, items):
    if cuda_device_count() > 0:
        return
    skip = pytest.mark.skip(reason="no CUDA device is available")
    for item in items:
        item.add_marker(skip)


_local_rank = None


def local_rank() -> int:
    """This rank's index on its node (collective over COMM_WORLD on the first call only)."""
    global _local_rank
    if _local_rank is None:
        from mpi4py import MPI
        world = MPI.COMM_WORLD
        node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
        _local_rank = node.Get_rank()
        node.Free()
    return _local_rank


def _cupy():
    try:
        import cupy
    except Exception:       # not installed, or a CuPy that cannot load its CUDA libraries
        return None
    return cupy


@pytest.fixture(scope="session")
def gpu_index() -> int:
    """The CUDA device of this rank: local rank modulo the number of visible devices."""
    count = cuda_device_count()
    if count == 0:
        pytest.skip("no CUDA device is available")
    index = local_rank() % count
    cupy = _cupy()
    if cupy is not None:
        cupy.cuda.Device(index).use()
    return index


@pytest.fixture(autouse=True)
def _use_gpu(request):
    """Make this rank's device current before every test (tests skipped at collection do not
    get here, so no rank runs the collective of local_rank() alone)."""
    if cuda_device_count() == 0:
        yield
        return
    index = request.getfixturevalue("gpu_index")
    cupy = _cupy()
    if cupy is not None:
        cupy.cuda.Device(index).use()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.set_device(index)
    yield
