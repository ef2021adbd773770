"""The NCCL binding on a machine without a GPU, with the real nvidia-nccl-cu12 wheel."""
import os
import subprocess
import sys
from importlib import metadata

import pytest

import aluminum_py as al
from aluminum_py import nccl

pytest.importorskip("nvidia.nccl", reason="nvidia-nccl-cu12 is not installed")


def has_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def test_library_found_in_the_wheel():
    assert nccl.available()
    assert nccl.library_path().endswith(os.path.join("nccl", "lib", "libnccl.so.2"))


def test_version_matches_the_wheel():
    wheel = tuple(int(x) for x in metadata.version("nvidia-nccl-cu12").split(".")[:3])
    assert nccl.get_version() == wheel


def test_unique_id():
    a, b = nccl.get_unique_id(), nccl.get_unique_id()
    assert isinstance(a, bytes) and len(a) == 128 and a != b


@pytest.mark.skipif(has_gpu(), reason="a GPU is present")
@pytest.mark.parametrize("config", [{}, {"max_ctas": 2}, {"min_ctas": 1, "max_ctas": 4, "blocking": False}])
def test_comm_init_without_gpu_raises_nccl_error_with_cuda_text(config):
    with pytest.raises(al.NcclError) as info:
        nccl.NcclComm(1, nccl.get_unique_id(), 0, **config)
    assert info.value.code == nccl.UNHANDLED_CUDA_ERROR
    msg = str(info.value)
    assert "ncclCommInitRankConfig" in msg and "unhandled cuda error" in msg
    assert "Cuda failure" in msg or "CUDA" in msg          # NCCL's last-error text
    assert isinstance(info.value, al.Error)


def test_null_communicator_maps_to_invalid_argument():
    null = nccl.NcclComm._from_handle(0)
    null._allow_null = True
    calls = [lambda: null.allreduce(0, 0, 4, "float32", "sum", 0),
             lambda: null.broadcast(0, 0, 4, "float32", 0, 0),
             lambda: null.reduce(0, 0, 4, "float32", "max", 0, 0),
             lambda: null.allgather(0, 0, 4, "int32", 0),
             lambda: null.reduce_scatter(0, 0, 4, "float64", "sum", 0),
             lambda: null.send(0, 4, "uint8", 1, 0),
             lambda: null.recv(0, 4, "uint8", 1, 0)]
    for call in calls:
        with pytest.raises(al.NcclError) as info:
            call()
        assert info.value.code == nccl.INVALID_ARGUMENT
        assert "invalid argument" in str(info.value)


def test_destroyed_communicator_and_bad_arguments():
    c = nccl.NcclComm._from_handle(0)
    with pytest.raises(al.NcclError, match="destroyed"):
        c.allreduce(0, 0, 1, "float32", "sum", 0)
    c.destroy()     # idempotent on a destroyed communicator
    uid = nccl.get_unique_id()
    with pytest.raises(ValueError, match="rank"):
        nccl.NcclComm(2, uid, 2)
    with pytest.raises(ValueError, match="unique_id"):
        nccl.NcclComm(1, uid[:10], 0)
    with pytest.raises(TypeError, match="unique_id"):
        nccl.NcclComm(1, "x" * 128, 0)
    with pytest.raises(ValueError, match="max_ctas"):
        nccl.NcclComm(1, uid, 0, min_ctas=8, max_ctas=2)
    with pytest.raises(ValueError, match="max_ctas"):
        nccl.NcclComm(1, uid, 0, max_ctas=0)
    null = nccl.NcclComm._from_handle(0)
    null._allow_null = True
    with pytest.raises(TypeError, match="dtype"):
        null.allreduce(0, 0, 1, "complex64", "sum", 0)
    with pytest.raises(TypeError, match="op"):
        null.allreduce(0, 0, 1, "float32", "band", 0)


def test_empty_group():
    with nccl.group():
        pass


def test_error_is_picklable():
    import pickle
    e = pickle.loads(pickle.dumps(al.NcclError("x failed", 4)))
    assert e.code == 4 and str(e) == "x failed"


@pytest.mark.parametrize("value", ["/nonexistent/libnccl.so.2", "/etc/hostname"])
def test_unavailable_library_is_reported(value):
    code = ("import aluminum_py as al; from aluminum_py import nccl\n"
            "assert not nccl.available()\n"
            "try:\n    nccl.get_version()\nexcept al.UnavailableError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, AL_NCCL_LIBRARY=value))
    assert proc.returncode == 0, proc.stderr
    assert value in proc.stdout and "NCCL is not available" in proc.stdout
