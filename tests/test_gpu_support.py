"""GPU support that can be checked without a GPU: buffer parsing, stream handles, CTA mapping,
and the clear errors when no CUDA device is available."""
import numpy as np
import pytest

import aluminum_py as al
from aluminum_py import gpu
from aluminum_py.backends import gpu_backend


class FakeCudaArray:
    """Looks like a CuPy array to __cuda_array_interface__ readers."""

    def __init__(self, shape, typestr="<f4", ptr=0x7000_0000, readonly=False, strides=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (ptr, readonly), "strides": strides, "version": 3}


def test_parse_cuda_array_interface():
    a = gpu.as_gpu_array(FakeCudaArray((4, 5)), "sendbuf")
    assert a.ptr == 0x7000_0000 and a.count == 20 and a.dtype == np.float32 and a.nbytes == 80
    with pytest.raises(ValueError, match="recvbuf is read-only"):
        gpu.as_gpu_array(FakeCudaArray((3,), readonly=True), "recvbuf", writable=True)
    with pytest.raises(ValueError, match="sendbuf is not C-contiguous"):
        gpu.as_gpu_array(FakeCudaArray((4, 5), strides=(4, 16)), "sendbuf")
    with pytest.raises(TypeError, match="sendbuf: dtype"):
        gpu.as_gpu_array(FakeCudaArray((3,), typestr="|b1"), "sendbuf")
    with pytest.raises(TypeError, match="not a GPU buffer"):
        gpu.as_gpu_array(np.ones(3), "sendbuf")


def test_stream_handles_and_ctas():
    class CupyLike:
        ptr = 1234

    class TorchLike:
        cuda_stream = 99

    assert gpu.stream_handle(None) == 0 and gpu.stream_handle(7) == 7
    assert gpu.stream_handle(CupyLike()) == 1234 and gpu.stream_handle(TorchLike()) == 99
    with pytest.raises(TypeError, match="stream"):
        gpu.stream_handle("s")
    assert gpu.threads_to_ctas(2048, 512) == 4 and gpu.threads_to_ctas(100, 512) == 1
    assert gpu.threads_to_ctas(1025, 512) == 3


@pytest.mark.skipif(gpu.cuda_device_count() > 0, reason="a CUDA device is present")
def test_no_cuda_device_errors():
    with pytest.raises(al.UnavailableError, match="no CUDA device is available"):
        al.Communicator(stream=0)
    with pytest.raises(al.UnavailableError, match="no CUDA driver|no CUDA device"):
        al._core.CudaDevice(0, al.config.cuda_driver())
    comm = al.Communicator()
    with pytest.raises(al.UnavailableError, match="^sendbuf is a GPU buffer: no CUDA device"):
        comm.Allreduce(FakeCudaArray((4,)))
    with pytest.raises(al.UnavailableError, match="^buf is a GPU buffer: no CUDA device"):
        comm.Ibcast(FakeCudaArray((4,)))
    with pytest.raises(al.UnavailableError, match="^algorithm.*no CUDA device"):
        comm.Allreduce(np.ones(4, np.float32), algorithm="nccl")
    with pytest.raises(ValueError, match="max_ctas"):
        comm.Allreduce(np.ones(4, np.float32), max_ctas=2)
    x = np.ones(4)
    comm.Allreduce(x)                    # the communicator still works
    assert np.all(x == 1)
    comm.Free()


def test_nccl_point_to_point_argument_rules():
    from mpi4py import MPI
    from aluminum_py.backends.nccl_rules import check_p2p_args as _nccl_p2p_args
    _nccl_p2p_args(0, 1, MPI.ANY_SOURCE)
    with pytest.raises(ValueError, match="^tag"):
        _nccl_p2p_args(3, 1, MPI.ANY_SOURCE)
    with pytest.raises(al.UnavailableError, match="^source: .* cannot receive from ANY_SOURCE"):
        _nccl_p2p_args(0, MPI.ANY_SOURCE, MPI.ANY_SOURCE)
    _nccl_p2p_args(MPI.ANY_TAG, 1, MPI.ANY_SOURCE, MPI.ANY_TAG)    # a receive: every tag matches
    with pytest.raises(ValueError, match="^tag"):
        _nccl_p2p_args(MPI.ANY_TAG, 1, MPI.ANY_SOURCE)                 # a send has no ANY_TAG


def test_device_count_is_probed_once():
    n = gpu.cuda_device_count()
    assert gpu._device_count == n and gpu.cuda_device_count() == n


# -- the native DLPack reader (aluminum_py._dlpack), on CPU producers


def _torch():
    return pytest.importorskip("torch")


def test_dlpack_reads_numpy_arrays_and_releases_them_once():
    import sys
    from aluminum_py import _dlpack
    a = np.arange(24, dtype=np.int64).reshape(4, 6)
    refs = sys.getrefcount(a)
    t = _dlpack.read(a)
    assert (t.device_type, t.device_id) == (_dlpack.CPU, 0)
    assert t.ptr == a.ctypes.data and t.shape == (4, 6)
    assert t.strides in (None, (6, 1)) and t.dtype_name == "int64" and t.lanes == 1
    assert t.readonly is False and t.version[0] == 1          # numpy 2 answers max_version
    assert sys.getrefcount(a) == refs + 1                      # the producer's reference
    del t                                                      # -> the deleter, exactly once
    assert sys.getrefcount(a) == refs
    ro = np.ones(3, np.float32)
    ro.flags.writeable = False
    assert _dlpack.read(ro).readonly                            # the versioned read-only flag
    s = _dlpack.read(a[:, 1::2])
    assert s.strides == (6, 2) and s.ptr == a.ctypes.data + 8 and s.shape == (4, 3)


def test_dlpack_capsule_protocol():
    from aluminum_py import _dlpack
    a = np.arange(5.0)
    cap = a.__dlpack__()                                       # unversioned "dltensor"
    t = _dlpack.from_capsule(cap)
    assert t.version is None and t.ptr == a.ctypes.data
    with pytest.raises(BufferError, match="already been consumed"):
        _dlpack.from_capsule(cap)                              # renamed "used_dltensor"
    vcap = a.__dlpack__(max_version=(1, 0))
    assert _dlpack.from_capsule(vcap).version[0] == 1
    with pytest.raises(BufferError, match="already been consumed"):
        _dlpack.from_capsule(vcap)                             # "used_dltensor_versioned"
    with pytest.raises(TypeError, match="expected a DLPack capsule"):
        _dlpack.from_capsule(object())

    class OldProducer:                                         # no max_version keyword
        def __init__(self):
            self.calls = []

        def __dlpack__(self, stream=None):
            self.calls.append(stream)
            return a.__dlpack__()

    p = OldProducer()
    assert _dlpack.read(p).version is None and p.calls == [None]


def test_dlpack_torch_tensors_bfloat16_and_strides():
    torch = _torch()
    from aluminum_py import _dlpack
    base = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    for t, strides in ((base, (6, 1)), (base.t(), (1, 6)), (base[1:, ::2], (6, 2))):
        uses = t._use_count()
        d = _dlpack.read(t)
        assert d.dtype_name == "bfloat16" and (d.code, d.bits, d.lanes) == (_dlpack.BFLOAT, 16, 1)
        assert d.ptr == t.data_ptr() and d.shape == tuple(t.shape)
        assert d.strides in ((strides, None) if t.is_contiguous() else (strides,))
        assert d.device_type == _dlpack.CPU
        assert t._use_count() == uses + 1
        del d
        assert t._use_count() == uses                          # deleter called
    h = _dlpack.read(torch.zeros(3, dtype=torch.float16))
    assert h.dtype_name == "float16"
    assert _dlpack.read(torch.zeros(2, dtype=torch.bool)).dtype_name == "bool8"


def test_dlpack_array_checks():
    torch = _torch()
    from aluminum_py import _dlpack
    t = torch.arange(12, dtype=torch.bfloat16)
    g = gpu.dlpack_array(_dlpack.read(t), "sendbuf")
    assert str(g.dtype) == "bfloat16" and g.count == 12 and g.ptr == t.data_ptr() and g.nbytes == 24
    assert isinstance(g.obj, _dlpack.DLPackBuffer)             # kept alive with the op
    with pytest.raises(ValueError, match="sendbuf is not C-contiguous"):
        gpu.dlpack_array(_dlpack.read(t.reshape(3, 4).t()), "sendbuf")
    with pytest.raises(TypeError, match="recvbuf: DLPack dtype bool8 is not supported"):
        gpu.dlpack_array(_dlpack.read(torch.zeros(2, dtype=torch.bool)), "recvbuf")
    ro = np.ones(3, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="recvbuf is read-only"):
        gpu.dlpack_array(_dlpack.read(ro), "recvbuf", writable=True)


class CudaClaim:
    """A producer that reports a CUDA device but exports a CPU tensor, recording the stream it
    is asked for (checks as_gpu_array's protocol handling without a GPU)."""

    def __init__(self, arr, device=2):
        self.arr, self.device, self.streams = arr, device, []

    def __dlpack_device__(self):
        return (self.device, 0)

    def __dlpack__(self, stream=None, max_version=None):
        self.streams.append(stream)
        return self.arr.__dlpack__(max_version=max_version)


def test_as_gpu_array_dlpack_protocol():
    from aluminum_py.buffers import is_gpu_buffer
    cpu = CudaClaim(np.ones(4), device=1)               # a DLPack producer on the CPU (kDLCPU)
    assert not is_gpu_buffer(cpu) and not is_gpu_buffer(np.ones(2))   # CPU DLPack: host buffers
    with pytest.raises(TypeError, match="sendbuf: not a GPU buffer"):
        gpu.as_gpu_array(cpu, "sendbuf")
    p = CudaClaim(np.ones(4, np.float32))
    assert is_gpu_buffer(p)
    for stream in (None, 0, 7):
        with pytest.raises(TypeError, match="sendbuf: __dlpack_device__ says CUDA but the "
                                            "DLPack tensor is on device type 1"):
            gpu.as_gpu_array(p, "sendbuf", stream=stream)
    assert p.streams == [-1, 1, 7]          # no sync; legacy default stream is 1; the handle
    host = CudaClaim(np.ones(4, np.float32), device=3)            # kDLCUDAHost: no stream
    with pytest.raises(TypeError):
        gpu.as_gpu_array(host, "buf", stream=5)
    assert host.streams == [None]


# -- which device the host-transfer device uses

def test_current_device_fallbacks(monkeypatch):
    import sys
    import types
    if gpu.cuda_device_count() == 0:
        with pytest.raises(al.UnavailableError, match="no CUDA driver|no CUDA device"):
            al._core.cuda_current_device(al.config.cuda_driver())
    monkeypatch.setattr(al._core, "cuda_current_device", lambda library: None)  # no current context
    monkeypatch.setitem(sys.modules, "cupy", None)                       # no CuPy
    assert gpu.current_device() == 0
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda: types.SimpleNamespace(id=3)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert gpu.current_device() == 3                                     # CuPy's current device
    monkeypatch.setattr(al._core, "cuda_current_device", lambda library: 1)
    assert gpu.current_device() == 1                                     # the driver's answer wins

    def broken(library):
        raise al.Error("cuCtxGetDevice failed (CUresult 201)")
    monkeypatch.setattr(al._core, "cuda_current_device", broken)
    assert gpu.current_device() == 3


# -- the CPU device interface: streams, cross-stream waits, destruction

def test_cpu_device_streams_events_and_destroy():
    import os
    dev = al._core.CpuDevice()

    def threads():
        return len(os.listdir("/proc/self/task"))

    n0 = threads()
    a, b = dev.stream(), dev.stream()
    assert threads() == n0 + 2
    src, mid, dst = np.arange(1000.0), np.zeros(1000), np.zeros(1000)
    gate = np.zeros(1, dtype=np.uint32)
    a.wait_value32(gate.ctypes.data, 1)         # a stops here until the test opens the gate
    a.memcpy(mid.ctypes.data, src.ctypes.data, src.nbytes)
    ev = dev.event_create()
    dev.event_record(ev, a.handle)
    assert not dev.event_query(ev)
    dev.stream_wait_event(b.handle, ev)         # b waits for a's copy...
    dev.event_destroy(ev)                       # ...even with the event destroyed (as CUDA)
    dev.memcpy(dst.ctypes.data, mid.ctypes.data, mid.nbytes, b.handle)
    assert not b.synchronize(timeout=0.05) and not dst.any()     # b is held behind a
    gate[0] = 1
    assert b.synchronize(timeout=300) and np.array_equal(dst, src)
    late = np.zeros(4)
    a.delay(0.2)                                # a long kernel still running at destroy
    a.memcpy(late.ctypes.data, src.ctypes.data, late.nbytes)
    a.destroy()                                 # runs what is queued, joins the worker
    assert np.array_equal(late, src[:4])
    assert threads() == n0 + 1
    a.destroy()                                 # idempotent
    with pytest.raises(ValueError, match="destroyed"):
        a.memcpy(0, 0, 0)
    h = dev.stream_create()                     # the interface's own create/destroy
    assert threads() == n0 + 2
    dev.stream_destroy(h)
    b.destroy()
    assert threads() == n0
    never = dev.event_create()
    assert dev.event_query(never)               # never recorded: complete, as in CUDA
    dev.event_destroy(never)


def test_cpu_device_stream_ordered_memory_is_freed_behind_the_work_queued_before():
    """alloc_async's memory (the in-place Reduce_scatter's scratch) is usable by work queued on
    the stream after it, and free_async queues the release behind that work: on the strict
    device, with the stream held at a gate, both copies through the scratch run before the
    release, and the data arrives."""
    dev = al._core.CpuDevice(strict=True)
    s = dev.stream()
    gate = np.zeros(1, dtype=np.uint32)
    src, dst = np.arange(512, dtype=np.int64), np.zeros(512, dtype=np.int64)
    s.wait_value32(gate.ctypes.data, 1)
    scratch = dev.alloc_async(src.nbytes, s.handle)
    assert scratch
    dev.memcpy(scratch, src.ctypes.data, src.nbytes, s.handle)
    dev.memcpy(dst.ctypes.data, scratch, src.nbytes, s.handle)
    dev.free_async(scratch, s.handle)           # returns at once: the stream is held
    assert not dst.any()
    gate[0] = 1
    assert s.synchronize(timeout=300)           # a hang guard: the stream runs at once
    assert np.array_equal(dst, src)
    ran = [(kind, p) for kind, _, p in dev.trace() if kind in ("copy", "hostfn")]
    assert ran == [("copy", scratch), ("copy", dst.ctypes.data), ("hostfn", scratch)], ran
    s.destroy()


# -- buffers stay referenced until their op has completed on the device

class _Buffer:
    """Stands in for an array whose only reference, once the call returned, is the library's."""


def _track_behind_a_gate():
    """A CPU-device stream stopped at a gate the test opens (a wait on a host flag, as a
    kernel that has not finished), an InFlight tracking a buffer enqueued behind it, the
    caller's reference dropped: (stream, inflight, weakref to the buffer, open_gate)."""
    import weakref
    dev = al._core.CpuDevice()
    s = dev.stream()
    inflight = gpu.InFlight(dev)
    gate = np.zeros(1, dtype=np.uint32)
    s.wait_value32(gate.ctypes.data, 1)
    buf = _Buffer()
    ref = weakref.ref(buf)
    inflight.track(s.handle, (buf,))

    def open_gate():
        gate[0] = 1
        assert s.synchronize(timeout=300)       # a hang guard: the stream runs at once
    return s, inflight, ref, open_gate


def test_inflight_keeps_buffers_until_the_completion_event():
    """An op's buffers stay referenced until the event recorded after the op has fired,
    although the caller dropped them at once; completed entries are dropped in stream order
    and their events reused."""
    import gc
    s, inflight, ref, open_gate = _track_behind_a_gate()
    gc.collect()
    inflight.retire()
    assert ref() is not None and inflight.pending == 1      # the stream has not run the op
    open_gate()
    inflight.retire()
    gc.collect()
    assert ref() is None and inflight.pending == 0
    assert len(inflight.free_events) == 1
    inflight.track(s.handle, ())                 # the event is reused
    assert len(inflight.free_events) == 0
    assert s.synchronize(timeout=300)
    inflight.retire()
    inflight.destroy_events()
    s.destroy()


def test_freed_communicator_keeps_buffers_of_running_ops(monkeypatch):
    """Free with ops still running on the device: their buffers move to a list that later GPU
    ops prune once the ops have completed."""
    s, f, ref, open_gate = _track_behind_a_gate()
    monkeypatch.setattr(gpu, "_RETIRING", [f])
    gpu._retire_freed()
    assert ref() is not None and gpu._RETIRING == [f]
    open_gate()
    gpu._retire_freed()
    assert ref() is None and gpu._RETIRING == []
    s.destroy()


# -- the buffer's device must be the communicator's

def test_dlpack_device_id_is_recorded_and_checked(monkeypatch):
    import types
    from aluminum_py import _dlpack
    fake = types.SimpleNamespace(dtype_name="float32", ptr=0x1000, shape=(8,), strides=None,
                                 readonly=False, device_type=_dlpack.CUDA, device_id=1)
    assert gpu.dlpack_array(fake, "sendbuf").device == 1
    host = types.SimpleNamespace(**{**vars(fake), "device_type": _dlpack.CUDA_HOST})
    assert gpu.dlpack_array(host, "sendbuf").device is None        # pinned host memory: any
    backend = gpu_backend.GpuBackend.__new__(gpu_backend.GpuBackend)
    backend.stream = 0
    backend.device = types.SimpleNamespace(ordinal=0)
    monkeypatch.setattr(gpu_backend, "as_gpu_array", lambda obj, name, writable, stream:
                        gpu.dlpack_array(fake, name, writable))
    with pytest.raises(ValueError, match="sendbuf is on CUDA device 1 but the communicator uses "
                                         "CUDA device 0"):
        backend._arr(object(), "sendbuf")
    backend.device = types.SimpleNamespace(ordinal=1)
    assert backend._arr(object(), "sendbuf").device == 1


# -- the CUDA implementation against the driver stand-in (tests/standin runs it under mpiexec)

def _standin_run(code: str):
    import os
    import subprocess
    import sys
    from aluminum_py.testing import cuda_standin
    env = dict(os.environ, AL_CUDA_LIBRARY=cuda_standin.path())
    for k in [k for k in env if k.startswith(("PMI_", "HYDRA_", "MPI_LOCALRANKID"))]:
        del env[k]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_counting_devices_retains_no_context():
    """gpu.cuda_device_count() uses cuInit + cuDeviceGetCount only: it must not retain GPU 0's
    primary context (hundreds of MiB per rank on a real GPU); a device interface retains the
    context of its own device, once per process."""
    out = _standin_run(
        "from aluminum_py import gpu\n"
        "from aluminum_py.testing import cuda_standin as cs\n"
        "L = cs.load()\n"
        "n = gpu.cuda_device_count()\n"
        "print(n, L.standin_primary_ctx_refcount(0), L.standin_current_ctx() or 0)\n"
        "d = gpu.cuda_device(0)\n"
        "assert gpu.cuda_device(0) is d\n"
        "print(L.standin_primary_ctx_refcount(0), L.standin_current_ctx() or 0)\n")
    first, second = out.split("\n")[:2]
    assert first == "1 0 0"            # one device, no context retained, none current
    assert second == "1 0"             # the device's context retained once, still none current


def test_cuda_device_loads_the_library_in_al_cuda_library():
    out = _standin_run(
        "import aluminum_py as al\n"
        "from aluminum_py import gpu\n"
        "d = gpu.cuda_device(0)\n"
        "s = d.stream_create(); e = d.event_create(); d.event_record(e, s)\n"
        "d.synchronize(); print(d.event_query(e), d.kind, d.ordinal)\n"
        "d.stream_destroy(s)\n"
        "try:\n    d.stream_destroy(s)\nexcept al.Error as err:\n    print(err)\n")
    lines = out.strip().split("\n")
    assert lines[0] == "True cuda 0"
    assert lines[1].startswith("cuStreamDestroy failed: CUDA_ERROR_INVALID_HANDLE (CUresult 400)")
