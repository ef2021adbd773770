"""The CUDA driver stand-in (aluminum_py.testing.cuda_standin) against CUDA's documented
semantics, through ctypes, in one process (plus a few subprocesses for what must happen before
cuInit, other device counts, and a real deadlock).

Streams are "gated" with cuStreamWaitValue32_v2 on a host word so that work is provably queued
and not yet run; everything that could hang runs on a helper thread joined with a timeout, and
the module-wide pytest-timeout (thread method) fails a run that hangs anyway."""
import ctypes
import os
import queue
import subprocess
import sys
import threading
import time
from ctypes import byref, c_char_p, c_int, c_uint64, c_void_p

import numpy as np
import pytest

from aluminum_py.testing import cuda_standin as cs

pytestmark = pytest.mark.timeout(300, method="thread")   # hang guards, as every limit here

SUCCESS, INVALID_VALUE, NOT_INITIALIZED, NO_DEVICE = 0, 1, 3, 100
INVALID_DEVICE, INVALID_CONTEXT, INVALID_HANDLE, NOT_READY, NOT_SUPPORTED = 101, 201, 400, 600, 801
NON_BLOCKING, BLOCKING = 1, 0
LEGACY = 1                       # CU_STREAM_LEGACY; handle 0 is the legacy stream too
GEQ, EQ, AND, NOR = 0, 1, 2, 3
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# where a `python -c`/`-m` child starts: the directory holding the aluminum_py this process
# imported (the source tree, or site-packages for an installed package), so it imports the same
HOME = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(cs.__file__))))


# ------------------------------------------------------------------ helpers
def ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def eventually(pred, timeout=120.0) -> bool:
    """Whether `pred` comes to hold; the timeout only guards against a hang."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.002)
    return bool(pred())


def stays(pred, duration=0.3) -> bool:
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        if not pred():
            return False
        time.sleep(0.005)
    return bool(pred())


class Call(threading.Thread):
    """fn(*args) on a new thread (with `ctx` current there, if given); .finished(t) joins."""

    def __init__(self, fn, *args, ctx=None):
        super().__init__(daemon=True)
        self.fn, self.args, self.ctx, self.result = fn, args, ctx, None
        self.start()

    def run(self):
        if self.ctx is not None:
            assert cs.load().cuCtxSetCurrent(self.ctx) == SUCCESS
        self.result = self.fn(*self.args)

    def finished(self, timeout=120.0) -> bool:
        self.join(timeout)
        return not self.is_alive()


class Device:
    """Streams, gates and buffers of one test, all released at teardown (gates opened first,
    so no stream is left blocked and no buffer is freed under a stream)."""

    def __init__(self, lib, ctx):
        self.L, self.ctx = lib, ctx
        self.streams, self.openers, self.kept = [], [], []

    def stream(self, flags=NON_BLOCKING) -> int:
        h = cs.stream_create(flags)
        self.streams.append(h)
        return h

    def array(self, a) -> np.ndarray:
        a = np.ascontiguousarray(a)
        self.kept.append(a)
        return a

    def gate(self, stream) -> "Gate":
        g = Gate(self.L, stream)
        self.openers.append(g.open)
        return g

    def word(self, value=0, opener=None) -> np.ndarray:
        """A uint32 word; opener(word) is applied at teardown to release waits on it."""
        w = self.array(np.array([value], np.uint32))
        if opener:
            self.openers.append(lambda: opener(w))
        return w

    def copy(self, dst, src, stream) -> None:
        assert self.L.cuMemcpyAsync(ptr(dst), ptr(src), src.nbytes, stream) == SUCCESS

    def sync(self, stream, timeout=120.0) -> None:
        c = Call(self.L.cuStreamSynchronize, stream, ctx=self.ctx)
        assert c.finished(timeout), f"stream {stream:#x} did not finish"
        assert c.result == SUCCESS

    def close(self):
        for open_ in self.openers:
            open_()
        for h in self.streams + [0]:
            Call(self.L.cuStreamSynchronize, h, ctx=self.ctx).finished(120)
        for h in self.streams:
            self.L.cuStreamDestroy_v2(h)


class Gate:
    """The stream stops here (wait until word >= 1) until open()."""

    def __init__(self, lib, stream):
        self.word = np.zeros(1, np.uint32)
        assert lib.cuStreamWaitValue32_v2(stream, ptr(self.word), 1, GEQ) == SUCCESS

    def open(self):
        self.word[0] = 1


@pytest.fixture(scope="module")
def L():
    lib = cs.load()
    cs.make_current(0)               # the module's own reference to the primary context
    return lib


@pytest.fixture
def ctx(L):
    """The primary context of device 0, current on the test's (main) thread."""
    c = c_void_p()
    assert L.cuDevicePrimaryCtxRetain(byref(c), 0) == SUCCESS
    assert L.cuDevicePrimaryCtxRelease_v2(0) == SUCCESS
    assert L.cuCtxSetCurrent(c) == SUCCESS
    return c.value


@pytest.fixture
def dev(L, ctx):
    d = Device(L, ctx)
    yield d
    d.close()


def run_python(code: str, env: dict | None = None, timeout=300) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, "-c", code], env=full, cwd=HOME, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)


PRELUDE = """
import ctypes
from ctypes import byref, c_int, c_void_p
import numpy as np
from aluminum_py.testing import cuda_standin as cs
L = cs.load()
"""


# ------------------------------------------------------------------ building and packaging
def test_path_is_stable_keyed_by_the_source_and_is_what_load_opened(L):
    import hashlib
    p = cs.path()
    assert p == cs.path() and os.path.isabs(p) and os.path.isfile(p)
    name = os.path.basename(p)
    assert name.startswith("libcuda_standin-") and name.endswith(".so")
    source = b""
    for src in cs._SOURCES:                  # the CUDA and the NCCL stand-in: one library
        with open(src, "rb") as f:
            source += f.read()
    key = hashlib.sha256(source + " ".join(cs._CFLAGS).encode()).hexdigest()[:16]
    assert key in name
    assert L._name == p and cs.load() is L


def test_module_main_prints_the_path_and_nothing_else():
    proc = subprocess.run([sys.executable, "-m", "aluminum_py.testing.cuda_standin"], cwd=HOME,
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == cs.path() + "\n"


def test_an_edited_source_is_rebuilt_and_a_failed_build_says_why(tmp_path, monkeypatch):
    cuda_src, nccl_src = cs._SOURCES
    with open(cuda_src) as f:
        source = f.read()
    src = tmp_path / "cuda_standin.c"
    src.write_text(source)
    monkeypatch.setenv("AL_CUDA_STANDIN_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cs, "_SOURCES", [str(src), nccl_src])
    first = cs.path()
    src.write_text(source + "\n/* edited */\n")
    second = cs.path()
    assert first != second and os.path.isfile(first) and os.path.isfile(second)
    assert ctypes.CDLL(second).cuDriverGetVersion(byref(c_int())) == SUCCESS
    src.write_text(source + "\nint this_is_not_c = ;\n")
    with pytest.raises(RuntimeError, match=r"(?s)building the CUDA stand-in failed.*this_is_not_c"):
        cs.path()
    monkeypatch.setenv("MPICC", str(tmp_path / "no-such-compiler"))
    src.write_text(source + "\n/* edited again */\n")
    with pytest.raises(RuntimeError, match="no-such-compiler"):
        cs.path()
    assert not [f for f in os.listdir(tmp_path / "cache") if f.endswith(".tmp")]


@pytest.mark.timeout(600, method="thread")
def test_ranks_building_at_once_get_one_complete_library(tmp_path):
    env = dict(os.environ, AL_CUDA_STANDIN_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-m", "aluminum_py.testing.cuda_standin"],
                              cwd=HOME, env=env, text=True, stdout=subprocess.PIPE)
             for _ in range(4)]
    outs = [p.communicate(timeout=500)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1 and outs[0].startswith(str(tmp_path))
    assert os.listdir(tmp_path) == [os.path.basename(outs[0].strip())]       # no temp left over
    assert ctypes.CDLL(outs[0].strip()).cuDriverGetVersion(byref(c_int())) == SUCCESS


def test_the_package_imports_without_building_and_ships_the_source(tmp_path):
    proc = run_python("import aluminum_py.testing, aluminum_py.testing.cuda_standin",
                      env={"AL_CUDA_STANDIN_DIR": str(tmp_path / "never")})
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "never").exists()
    with open(os.path.join(REPO, "setup.cfg")) as f:
        line = next(ln for ln in f if ln.startswith("aluminum_py ="))
    assert "testing/*.c" in line and "py.typed" in line and "*.pyi" in line


# ------------------------------------------------------------------ initialization, devices
def test_every_call_but_init_version_and_error_text_needs_cuInit():
    proc = run_python(PRELUDE + """
n, p, name = c_int(), c_void_p(), ctypes.c_char_p()
assert L.cuDeviceGetCount(byref(n)) == 3
assert L.cuDeviceGet(byref(n), 0) == 3
assert L.cuDevicePrimaryCtxRetain(byref(p), 0) == 3
assert L.cuCtxGetCurrent(byref(p)) == 3
assert L.cuStreamCreate(byref(p), 1) == 3
assert L.cuEventCreate(byref(p), 0) == 3
assert L.cuMemHostAlloc(byref(p), 64, 0) == 3
assert L.cuStreamQuery(0) == 3
assert L.cuCtxSynchronize() == 3
assert L.cuDriverGetVersion(byref(n)) == 0 and n.value >= 12000
assert L.cuGetErrorName(3, byref(name)) == 0 and name.value == b"CUDA_ERROR_NOT_INITIALIZED"
assert L.cuInit(1) == 1          # flags must be 0
assert L.cuInit(0) == 0 and L.cuInit(0) == 0
assert L.cuDeviceGetCount(byref(n)) == 0 and n.value == 1
print("ok")
""", env={"AL_STANDIN_DEVICES": ""})
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr


def test_device_count_comes_from_the_environment_and_sync_is_per_device():
    proc = run_python(PRELUDE + """
import threading, time
n, d = c_int(), c_int()
assert L.cuInit(0) == 0 and L.cuDeviceGetCount(byref(n)) == 0 and n.value == 3
assert L.cuDeviceGet(byref(d), 2) == 0 and d.value == 2
assert L.cuDeviceGet(byref(d), 3) == 101 and L.cuDeviceGet(byref(d), -1) == 101
ctxs = [cs.make_current(i) for i in range(3)]
assert len(set(ctxs)) == 3 and cs.current_ctx() == ctxs[2]
assert L.cuCtxGetDevice(byref(d)) == 0 and d.value == 2
assert L.cuCtxGetDevice_v2(byref(d), ctxs[1]) == 0 and d.value == 1
# a stream of device 1 blocked: device 0's pinned alloc does not wait, device 1's sync does
L.cuCtxSetCurrent(ctxs[1]); s = cs.stream_create(1)
flag = np.zeros(1, np.uint32)
assert L.cuStreamWaitValue32_v2(s, flag.ctypes.data, 1, 0) == 0
L.cuCtxSetCurrent(ctxs[0]); p = c_void_p()
assert L.cuMemHostAlloc(byref(p), 64, 0) == 0 and cs.sync_waits() == 0
done = []
def sync1():
    L.cuCtxSetCurrent(ctxs[1]); done.append(L.cuCtxSynchronize())
t = threading.Thread(target=sync1); t.start()
deadline = time.monotonic() + 300          # a hang guard: the thread reaches the wait at once
while cs.sync_waits() == 0 and time.monotonic() < deadline:
    time.sleep(0.002)
assert not done and cs.sync_waits() == 1
flag[0] = 1; t.join(300)
assert done == [0]
print("ok")
""", env={"AL_STANDIN_DEVICES": "3"})
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr
    proc = run_python(PRELUDE + """
n = c_int()
assert L.cuInit(0) == 100                       # CUDA_ERROR_NO_DEVICE
assert L.cuDeviceGetCount(byref(n)) == 3        # still not initialized
print("ok")
""", env={"AL_STANDIN_DEVICES": "0"})
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr


def test_a_fully_released_primary_context_is_inactive_until_retained_again():
    proc = run_python(PRELUDE + """
d, h = c_int(), c_void_p()
ctx = cs.make_current(0)
assert cs.primary_ctx_refcount(0) == 1
assert L.cuDevicePrimaryCtxRelease_v2(0) == 0 and cs.primary_ctx_refcount(0) == 0
assert cs.current_ctx() == ctx                   # release never pops
assert L.cuDevicePrimaryCtxRelease_v2(0) == 201  # not retained
assert L.cuDevicePrimaryCtxRelease(0) == 201
assert L.cuStreamCreate(byref(h), 1) == 201 and L.cuCtxGetDevice(byref(d)) == 201
assert L.cuDevicePrimaryCtxRetain(byref(h), 0) == 0 and h.value == ctx
assert L.cuStreamCreate(byref(h), 1) == 0 and L.cuCtxGetDevice(byref(d)) == 0
assert cs.primary_ctx_refcount(0) == 1 and cs.primary_ctx_refcount(1) == -1
print("ok")
""", env={"AL_STANDIN_DEVICES": "1"})
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr


# ------------------------------------------------------------------ error codes
def test_error_names_and_strings(L):
    expected = {0: ("CUDA_SUCCESS", "no error"), 1: ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
                3: ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
                101: ("CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"),
                201: ("CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
                400: ("CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"),
                600: ("CUDA_ERROR_NOT_READY", "device not ready"),
                801: ("CUDA_ERROR_NOT_SUPPORTED", "operation not supported")}
    for code, (name, text) in expected.items():
        n, t = c_char_p(), c_char_p()
        assert L.cuGetErrorName(code, byref(n)) == SUCCESS and n.value.decode() == name
        assert L.cuGetErrorString(code, byref(t)) == SUCCESS and t.value.decode() == text
    n = c_char_p(b"untouched")
    assert L.cuGetErrorName(12345, byref(n)) == INVALID_VALUE and n.value is None
    assert L.cuGetErrorString(12345, byref(n)) == INVALID_VALUE
    assert L.cuGetErrorName(0, None) == INVALID_VALUE
    assert cs.error_name(400) == "CUDA_ERROR_INVALID_HANDLE"


def test_null_out_pointers_are_invalid_value(L, ctx):
    assert L.cuDriverGetVersion(None) == INVALID_VALUE
    assert L.cuDeviceGetCount(None) == INVALID_VALUE
    assert L.cuDeviceGet(None, 0) == INVALID_VALUE
    assert L.cuDevicePrimaryCtxRetain(None, 0) == INVALID_VALUE
    assert L.cuCtxGetCurrent(None) == INVALID_VALUE
    assert L.cuCtxGetDevice(None) == INVALID_VALUE
    assert L.cuCtxGetDevice_v2(None, ctx) == INVALID_VALUE
    assert L.cuStreamCreate(None, NON_BLOCKING) == INVALID_VALUE
    assert L.cuEventCreate(None, 0) == INVALID_VALUE
    assert L.cuMemHostAlloc(None, 64, 0) == INVALID_VALUE
    assert L.cuMemAllocHost_v2(None, 64) == INVALID_VALUE


def test_bad_device_ordinals_are_invalid_device(L, ctx):
    n, d, h = c_int(), c_int(), c_void_p()
    assert L.cuDeviceGetCount(byref(n)) == SUCCESS and n.value >= 1
    for bad in (n.value, -1, 1000):
        assert L.cuDeviceGet(byref(d), bad) == INVALID_DEVICE
        assert L.cuDevicePrimaryCtxRetain(byref(h), bad) == INVALID_DEVICE
        assert L.cuDevicePrimaryCtxRelease_v2(bad) == INVALID_DEVICE
    assert cs.primary_ctx_refcount(n.value) == -1


def test_bad_flags_sizes_and_addresses_are_invalid_value(L, dev):
    s, h, p = dev.stream(), c_void_p(), c_void_p()
    w = dev.word()
    assert L.cuStreamCreate(byref(h), 2) == INVALID_VALUE
    assert L.cuEventCreate(byref(h), 0x100) == INVALID_VALUE
    assert L.cuMemHostAlloc(byref(p), 64, 0x100) == INVALID_VALUE
    assert L.cuMemHostAlloc(byref(p), 0, 0) == INVALID_VALUE
    assert L.cuStreamWaitValue32_v2(s, ptr(w), 1, 4) == INVALID_VALUE
    assert L.cuStreamWaitValue32_v2(s, ptr(w) + 1, 1, GEQ) == INVALID_VALUE
    assert L.cuStreamWaitValue32_v2(s, 0, 1, GEQ) == INVALID_VALUE
    assert L.cuStreamWriteValue32_v2(s, ptr(w), 1, 2) == INVALID_VALUE
    assert L.cuStreamWriteValue32_v2(s, ptr(w) + 2, 1, 0) == INVALID_VALUE
    assert L.cuMemcpyAsync(0, ptr(w), 4, s) == INVALID_VALUE
    assert L.cuEventCreate(byref(h), 2) == SUCCESS
    assert L.cuStreamWaitEvent(s, h, 1) == INVALID_VALUE
    assert L.cuEventDestroy_v2(h) == SUCCESS
    assert L.cuStreamQuery(s) == SUCCESS          # nothing was enqueued by the failed calls


def test_destroyed_and_made_up_streams_are_invalid_handle(L, dev):
    w, ev = dev.word(), c_void_p()
    assert L.cuEventCreate(byref(ev), 0) == SUCCESS
    live = cs.live_streams()
    dead = cs.stream_create(NON_BLOCKING)
    assert cs.live_streams() == live + 1
    assert L.cuStreamDestroy_v2(dead) == SUCCESS and cs.live_streams() == live
    for h in (dead, 0xDEAD0, ev.value):
        assert L.cuStreamQuery(h) == INVALID_HANDLE
        assert L.cuStreamSynchronize(h) == INVALID_HANDLE
        assert L.cuStreamDestroy_v2(h) == INVALID_HANDLE
        assert L.cuStreamDestroy(h) == INVALID_HANDLE
        assert L.cuMemcpyAsync(ptr(w), ptr(w), 4, h) == INVALID_HANDLE
        assert L.cuStreamWaitValue32_v2(h, ptr(w), 0, GEQ) == INVALID_HANDLE
        assert L.cuStreamWriteValue32_v2(h, ptr(w), 5, 0) == INVALID_HANDLE
        assert L.cuEventRecord(ev, h) == INVALID_HANDLE
        assert L.cuStreamWaitEvent(h, ev, 0) == INVALID_HANDLE
    assert L.cuStreamDestroy_v2(0) == INVALID_HANDLE and L.cuStreamDestroy_v2(LEGACY) == INVALID_HANDLE
    assert w[0] == 0
    assert L.cuEventDestroy_v2(ev) == SUCCESS


def test_destroyed_and_made_up_events_are_invalid_handle(L, dev):
    s, ev = dev.stream(), c_void_p()
    assert L.cuEventCreate(byref(ev), 0) == SUCCESS
    assert L.cuEventDestroy_v2(ev) == SUCCESS
    for h in (ev.value, 0xBAD0, s):
        assert L.cuEventQuery(h) == INVALID_HANDLE
        assert L.cuEventSynchronize(h) == INVALID_HANDLE
        assert L.cuEventRecord(h, s) == INVALID_HANDLE
        assert L.cuEventDestroy_v2(h) == INVALID_HANDLE
        assert L.cuEventDestroy(h) == INVALID_HANDLE
        assert L.cuStreamWaitEvent(s, h, 0) == INVALID_HANDLE
    assert L.cuStreamQuery(s) == SUCCESS and L.cuStreamDestroy_v2(s) == SUCCESS   # still usable


def test_v1_memops_and_event_record_v2_are_not_supported(L, dev):
    s, w, ev = dev.stream(), dev.word(), c_void_p()
    g = dev.gate(s)
    assert L.cuStreamWaitValue32(s, ptr(w), 1, GEQ) == NOT_SUPPORTED
    assert L.cuStreamWriteValue32(s, ptr(w), 7, 0) == NOT_SUPPORTED
    assert L.cuEventCreate(byref(ev), 0) == SUCCESS
    assert L.cuEventRecord_v2(ev, s) == NOT_SUPPORTED
    assert L.cuEventQuery(ev) == SUCCESS              # nothing was recorded
    g.open()
    dev.sync(s)
    assert w[0] == 0
    assert L.cuEventDestroy(ev) == SUCCESS


def test_cuMemFreeHost_takes_only_what_cuMemHostAlloc_returned(L, ctx):
    p, q = c_void_p(), c_void_p()
    live = cs.pinned_live()
    assert L.cuMemHostAlloc(byref(p), 100, 3) == SUCCESS and p.value % 4096 == 0
    assert L.cuMemAllocHost_v2(byref(q), 50) == SUCCESS
    assert cs.pinned_live() == live + 2
    ctypes.memset(p.value, 0xAB, 100)                  # usable host memory
    assert ctypes.string_at(p.value + 99, 1) == b"\xab"
    foreign = np.zeros(16, np.uint8)
    assert L.cuMemFreeHost(ptr(foreign)) == INVALID_VALUE
    assert L.cuMemFreeHost(p.value + 8) == INVALID_VALUE
    assert L.cuMemFreeHost(None) == SUCCESS
    assert L.cuMemFreeHost(p) == SUCCESS and L.cuMemFreeHost(q) == SUCCESS
    assert cs.pinned_live() == live
    assert L.cuMemFreeHost(p) == INVALID_VALUE         # double free


def test_stream_ordered_memory_is_released_after_the_work_queued_before(L, dev):
    """cuMemAllocAsync's block is usable by work queued on the stream after the call and
    cuMemFreeAsync returns at once, the release queued behind that work (here a gated stream's
    copies into and out of the block still run); it takes only a live block of
    cuMemAllocAsync's, once."""
    s = dev.stream()
    g = dev.gate(s)
    p = c_uint64()
    live = cs.device_live()
    assert L.cuMemAllocAsync(byref(p), 4096, s) == SUCCESS and p.value % 256 == 0
    assert cs.device_live() == live + 1
    src, dst = dev.array(np.arange(512, dtype=np.int64)), dev.array(np.zeros(512, np.int64))
    assert L.cuMemcpyAsync(p.value, ptr(src), 4096, s) == SUCCESS
    assert L.cuMemcpyAsync(ptr(dst), p.value, 4096, s) == SUCCESS
    assert L.cuMemFreeAsync(p.value, s) == SUCCESS
    assert cs.device_live() == live
    assert L.cuMemFreeAsync(p.value, s) == INVALID_VALUE          # double free
    assert L.cuMemFreeAsync(ptr(src), s) == INVALID_VALUE         # not cuMemAllocAsync's
    assert L.cuMemAllocAsync(byref(p), 0, s) == INVALID_VALUE
    assert L.cuMemAllocAsync(byref(p), 64, 0xdead) == INVALID_HANDLE
    assert not dst.any()
    g.open()
    dev.sync(s)
    assert np.array_equal(dst, np.arange(512))


# ------------------------------------------------------------------ contexts
def test_contexts_are_per_thread_and_calls_needing_one_fail_without(L, dev):
    s, src = dev.stream(), dev.array(np.arange(8, dtype=np.float64))
    dst = dev.array(np.zeros(8))
    out = {}

    def without_context():
        h, p, d = c_void_p(12345), c_void_p(), c_int()
        out["current"] = (L.cuCtxGetCurrent(byref(h)), h.value, cs.current_ctx())
        out["codes"] = [
            L.cuStreamCreate(byref(p), NON_BLOCKING), L.cuEventCreate(byref(p), 0),
            L.cuMemHostAlloc(byref(p), 64, 0), L.cuMemAllocHost_v2(byref(p), 64),
            L.cuCtxSynchronize(), L.cuCtxGetDevice(byref(d)), L.cuCtxGetDevice_v2(byref(d), None),
            L.cuMemcpyAsync(ptr(dst), ptr(src), src.nbytes, s),
            L.cuMemcpy(ptr(dst), ptr(src), src.nbytes), L.cuStreamQuery(0),
            L.cuStreamQuery(LEGACY), L.cuCtxPopCurrent_v2(byref(p))]
        out["explicit stream"] = L.cuStreamQuery(s)        # a stream names its context
        assert L.cuCtxSetCurrent(dev.ctx) == SUCCESS
        out["with"] = (cs.current_ctx(), L.cuCtxGetDevice(byref(d)), d.value)
        assert L.cuCtxSetCurrent(None) == SUCCESS

    t = threading.Thread(target=without_context)
    t.start()
    t.join(10)
    assert out["current"] == (SUCCESS, None, 0)
    assert out["codes"] == [INVALID_CONTEXT] * 12
    assert out["explicit stream"] == SUCCESS
    assert out["with"] == (dev.ctx, SUCCESS, 0)
    assert cs.current_ctx() == dev.ctx                    # the other thread's pop is its own
    assert np.all(dst == 0)


def test_the_context_stack_push_pop_and_set(L, ctx):
    out = []

    def body():
        p = c_void_p()
        out.append(L.cuCtxPushCurrent_v2(ctx) == SUCCESS and cs.current_ctx() == ctx)
        out.append(L.cuCtxPushCurrent(ctx) == SUCCESS)
        out.append(L.cuCtxPopCurrent_v2(byref(p)) == SUCCESS and p.value == ctx)
        out.append(L.cuCtxPopCurrent(None) == SUCCESS and cs.current_ctx() == 0)
        out.append(L.cuCtxPopCurrent_v2(byref(p)) == INVALID_CONTEXT)            # empty
        out.append(L.cuCtxSetCurrent(None) == SUCCESS and cs.current_ctx() == 0)  # no-op
        out.append(L.cuCtxSetCurrent(ctx) == SUCCESS and cs.current_ctx() == ctx) # pushes
        out.append(L.cuCtxSetCurrent(None) == SUCCESS and cs.current_ctx() == 0)  # pops
        out.append(L.cuCtxPushCurrent_v2(ctx) == SUCCESS and L.cuCtxSetCurrent(ctx) == SUCCESS
                   and L.cuCtxPopCurrent_v2(byref(p)) == SUCCESS and cs.current_ctx() == 0)
        out.append(L.cuCtxPushCurrent_v2(0x1234) == INVALID_CONTEXT)
        out.append(L.cuCtxPushCurrent_v2(None) == INVALID_CONTEXT)
        out.append(L.cuCtxSetCurrent(0x1234) == INVALID_CONTEXT and cs.current_ctx() == 0)
        for _ in range(64):
            L.cuCtxPushCurrent_v2(ctx)
        out.append(L.cuCtxPushCurrent_v2(ctx) != SUCCESS)                         # bounded
        for _ in range(64):
            L.cuCtxPopCurrent_v2(None)
        out.append(cs.current_ctx() == 0)

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    assert out == [True] * 14
    assert cs.current_ctx() == ctx


def test_primary_context_retain_count_and_cuCtxGetDevice_v2(L, ctx):
    base = cs.primary_ctx_refcount(0)
    assert base >= 1
    h, d = c_void_p(), c_int(-1)
    assert L.cuDevicePrimaryCtxRetain(byref(h), 0) == SUCCESS and h.value == ctx
    assert L.cuDevicePrimaryCtxRetain(byref(h), 0) == SUCCESS
    assert cs.primary_ctx_refcount(0) == base + 2
    assert L.cuDevicePrimaryCtxRelease_v2(0) == SUCCESS
    assert L.cuDevicePrimaryCtxRelease(0) == SUCCESS
    assert cs.primary_ctx_refcount(0) == base
    assert cs.make_current(0) == ctx and cs.primary_ctx_refcount(0) == base + 1
    assert L.cuDevicePrimaryCtxRelease_v2(0) == SUCCESS
    assert L.cuCtxGetDevice_v2(byref(d), ctx) == SUCCESS and d.value == 0
    d.value = -1
    assert L.cuCtxGetDevice_v2(byref(d), None) == SUCCESS and d.value == 0
    assert L.cuCtxGetDevice_v2(byref(d), 0x1234) == INVALID_CONTEXT


# ------------------------------------------------------------------ streams
def test_a_stream_runs_its_commands_in_fifo_order_after_returning_at_once(L, dev):
    s = dev.stream()
    g = dev.gate(s)
    bufs = [dev.array(np.zeros(1000, np.int64)) for _ in range(40)]
    bufs[0][:] = np.arange(1000)
    counter = dev.word()

    def chain():                             # each copy reads what the previous wrote
        return [(L.cuMemcpyAsync(ptr(bufs[i + 1]), ptr(bufs[i]), bufs[i].nbytes, s),
                 L.cuStreamWriteValue32_v2(s, ptr(counter), i + 1, 0)) for i in range(39)]
    c = Call(chain, ctx=dev.ctx)             # the stream is gated: a call that waited for it
    assert c.finished(30), "an enqueue waited for the stream"      # would never return
    assert c.result == [(SUCCESS, SUCCESS)] * 39
    assert stays(lambda: L.cuStreamQuery(s) == NOT_READY and counter[0] == 0 and not bufs[39].any())
    g.open()
    dev.sync(s)
    assert L.cuStreamQuery(s) == SUCCESS
    assert counter[0] == 39 and np.array_equal(bufs[39], np.arange(1000))


@pytest.mark.parametrize("gated, copier", [("blocking", 0), ("blocking", "legacy"),
                                           (0, "blocking")])
def test_the_legacy_stream_and_blocking_streams_wait_for_each_others_earlier_work(L, dev, gated,
                                                                                   copier):
    """Work on the legacy stream (handle 0 or CU_STREAM_LEGACY) waits for earlier work of every
    blocking stream, and work on a blocking stream for earlier legacy work."""
    b = dev.stream(BLOCKING)
    pick = {"blocking": b, "legacy": LEGACY, 0: 0}
    src, dst = dev.array(np.arange(16.0)), dev.array(np.zeros(16))
    g = dev.gate(pick[gated])
    dev.copy(dst, src, pick[copier])
    assert stays(lambda: L.cuStreamQuery(pick[copier]) == NOT_READY and not dst.any())
    g.open()
    dev.sync(pick[copier])
    assert np.array_equal(dst, src)


def test_non_blocking_streams_do_not_order_with_the_legacy_stream(L, dev):
    n = dev.stream(NON_BLOCKING)
    src, d1, d2 = dev.array(np.arange(16.0)), dev.array(np.zeros(16)), dev.array(np.zeros(16))
    g = dev.gate(n)
    dev.copy(d1, src, 0)                       # the legacy stream does not wait for n
    dev.sync(0)
    assert np.array_equal(d1, src)
    g.open()
    dev.sync(n)
    g2 = dev.gate(0)
    dev.copy(d2, src, n)                       # n does not wait for the legacy stream
    dev.sync(n, timeout=120)
    assert np.array_equal(d2, src)
    g2.open()


def test_legacy_ordering_covers_only_work_enqueued_before(L, dev):
    b = dev.stream(BLOCKING)
    src, d1, d2 = dev.array(np.arange(16.0)), dev.array(np.zeros(16)), dev.array(np.zeros(16))
    dev.copy(d1, src, 0)                       # legacy work first, then b blocks
    g = dev.gate(b)
    dev.sync(0)
    assert np.array_equal(d1, src)
    g.open()
    dev.sync(b)
    dev.copy(d2, src, b)                       # b's work first, then the legacy stream blocks
    g2 = dev.gate(0)
    dev.sync(b, timeout=120)
    assert np.array_equal(d2, src)
    g2.open()


def test_cuMemcpy_is_synchronous_and_ordered_after_blocking_streams(L, dev):
    b, n = dev.stream(BLOCKING), dev.stream(NON_BLOCKING)
    src, dst = dev.array(np.arange(32, dtype=np.int32)), dev.array(np.zeros(32, np.int32))
    gn = dev.gate(n)                           # a blocked non-blocking stream does not matter
    assert L.cuMemcpy(ptr(dst), ptr(src), src.nbytes) == SUCCESS
    assert np.array_equal(dst, src)
    dst[:] = 0
    g = dev.gate(b)
    c = Call(L.cuMemcpy, ptr(dst), ptr(src), src.nbytes, ctx=dev.ctx)
    assert not c.finished(0.3) and not dst.any()
    g.open()
    assert c.finished() and c.result == SUCCESS and np.array_equal(dst, src)
    gn.open()


def test_stream_destroy_returns_at_once_and_queued_work_still_runs(L, dev):
    s = cs.stream_create(NON_BLOCKING)
    src, dst = dev.array(np.arange(64.0)), dev.array(np.zeros(64))
    ev = c_void_p()
    assert L.cuEventCreate(byref(ev), 0) == SUCCESS
    g = dev.gate(s)
    dev.copy(dst, src, s)
    assert L.cuEventRecord(ev, s) == SUCCESS
    live = cs.live_streams()
    c = Call(L.cuStreamDestroy_v2, s)
    assert c.finished(120) and c.result == SUCCESS
    assert cs.live_streams() == live - 1 and L.cuStreamQuery(s) == INVALID_HANDLE
    assert stays(lambda: L.cuEventQuery(ev) == NOT_READY and not dst.any())
    g.open()
    assert eventually(lambda: L.cuEventQuery(ev) == SUCCESS)
    assert np.array_equal(dst, src)
    assert L.cuEventDestroy_v2(ev) == SUCCESS


# ------------------------------------------------------------------ value waits and writes
@pytest.mark.parametrize("cond,initial,value,still_blocked,satisfying", [
    (GEQ, 0, 5, 4, 5),
    (GEQ, 0xFFFFFFF0, 5, 0xFFFFFFFF, 7),       # cyclic: 0xFFFFFFF0 is "before" 5
    (EQ, 4, 5, 6, 5),
    (AND, 0b0100, 0b0011, 0b1000, 0b0010),
    (NOR, 0xFFFFFFFF, 0x0000000F, 0xFFFFFFF0, 0x0000001F),
])
def test_value_wait_blocks_its_stream_until_the_condition_holds(
        L, dev, cond, initial, value, still_blocked, satisfying):
    s = dev.stream()
    w = dev.word(initial, opener=lambda w: w.__setitem__(0, satisfying))
    after = dev.word()
    blocked = cs.blocked_streams()
    assert L.cuStreamWaitValue32_v2(s, ptr(w), value, cond) == SUCCESS
    assert L.cuStreamWriteValue32_v2(s, ptr(after), 1, 0) == SUCCESS
    assert eventually(lambda: cs.blocked_streams() == blocked + 1)
    w[0] = still_blocked
    assert stays(lambda: after[0] == 0 and L.cuStreamQuery(s) == NOT_READY)
    w[0] = satisfying
    dev.sync(s)
    assert after[0] == 1 and cs.blocked_streams() == blocked


@pytest.mark.parametrize("cond,initial,value", [
    (GEQ, 0x10, 0xFFFFFFF0),                   # cyclic: 0x10 is "after" 0xFFFFFFF0
    (GEQ, 7, 7), (EQ, 9, 9), (AND, 0b0110, 0b0011), (NOR, 0, 0xF)])
def test_a_value_wait_whose_condition_holds_does_not_block(L, dev, cond, initial, value):
    s, w, after = dev.stream(), dev.word(initial), dev.word()
    assert L.cuStreamWaitValue32_v2(s, ptr(w), value, cond | (1 << 30)) == SUCCESS   # | FLUSH
    assert L.cuStreamWriteValue32_v2(s, ptr(after), 1, 0) == SUCCESS
    dev.sync(s, timeout=120)
    assert after[0] == 1


def test_streams_hand_off_through_flags(L, dev):
    """The library's pattern: a stream copies then writes a flag; another waits for the flag,
    then copies the data on; the host waits on a final flag."""
    a, b = dev.stream(), dev.stream()
    x = dev.array(np.arange(4096, dtype=np.float32))
    y, z = dev.array(np.zeros(4096, np.float32)), dev.array(np.zeros(4096, np.float32))
    f1, f2 = dev.word(), dev.word()
    g = dev.gate(a)
    assert L.cuStreamWaitValue32_v2(b, ptr(f1), 1, GEQ) == SUCCESS
    dev.copy(z, y, b)
    assert L.cuStreamWriteValue32_v2(b, ptr(f2), 1, 0) == SUCCESS
    dev.copy(y, x, a)
    assert L.cuStreamWriteValue32_v2(a, ptr(f1), 1, 0) == SUCCESS
    assert stays(lambda: f1[0] == 0 and f2[0] == 0 and not y.any())
    g.open()
    assert eventually(lambda: f2[0] == 1)
    assert np.array_equal(z, x)


# ------------------------------------------------------------------ events
def test_an_event_never_recorded_is_complete(L, ctx):
    ev = c_void_p()
    assert L.cuEventCreate(byref(ev), 2) == SUCCESS
    assert L.cuEventQuery(ev) == SUCCESS and L.cuEventSynchronize(ev) == SUCCESS
    assert L.cuEventDestroy_v2(ev) == SUCCESS


def test_an_event_tracks_its_latest_record(L, dev):
    s1, s2 = dev.stream(), dev.stream()
    ev = c_void_p()
    assert L.cuEventCreate(byref(ev), 0) == SUCCESS
    g = dev.gate(s1)
    assert L.cuEventRecord(ev, s1) == SUCCESS
    assert stays(lambda: L.cuEventQuery(ev) == NOT_READY)
    assert L.cuEventRecord(ev, s2) == SUCCESS           # re-recorded on an idle stream
    assert eventually(lambda: L.cuEventQuery(ev) == SUCCESS)
    assert L.cuEventRecord(ev, s1) == SUCCESS
    assert L.cuEventQuery(ev) == NOT_READY
    c = Call(L.cuEventSynchronize, ev)
    assert not c.finished(0.3)
    g.open()
    assert c.finished() and c.result == SUCCESS and L.cuEventQuery(ev) == SUCCESS
    assert L.cuEventDestroy_v2(ev) == SUCCESS


def test_an_event_recorded_on_the_legacy_stream_covers_blocking_streams(L, dev):
    b = dev.stream(BLOCKING)
    ev = c_void_p()
    assert L.cuEventCreate(byref(ev), 0) == SUCCESS
    g = dev.gate(b)
    assert L.cuEventRecord(ev, 0) == SUCCESS
    assert stays(lambda: L.cuEventQuery(ev) == NOT_READY)
    g.open()
    assert eventually(lambda: L.cuEventQuery(ev) == SUCCESS)
    assert L.cuEventDestroy_v2(ev) == SUCCESS


def test_stream_wait_event_waits_for_the_record_as_of_the_call(L, dev):
    s1, s2, s3 = dev.stream(), dev.stream(), dev.stream()
    src, dst = dev.array(np.arange(8.0)), dev.array(np.zeros(8))
    ev = c_void_p()
    assert L.cuEventCreate(byref(ev), 0) == SUCCESS
    g = dev.gate(s1)
    assert L.cuEventRecord(ev, s1) == SUCCESS
    assert L.cuStreamWaitEvent(s2, ev, 0) == SUCCESS
    dev.copy(dst, src, s2)
    assert L.cuEventRecord(ev, s3) == SUCCESS           # a later record does not matter
    assert L.cuEventDestroy_v2(ev) == SUCCESS           # nor does destroying the event
    assert stays(lambda: L.cuStreamQuery(s2) == NOT_READY and not dst.any())
    g.open()
    dev.sync(s2)
    assert np.array_equal(dst, src)


def test_waiting_on_a_never_recorded_event_does_not_block(L, dev):
    s = dev.stream()
    src, dst = dev.array(np.arange(8.0)), dev.array(np.zeros(8))
    ev = c_void_p()
    assert L.cuEventCreate(byref(ev), 0) == SUCCESS
    assert L.cuStreamWaitEvent(s, ev, 0) == SUCCESS
    dev.copy(dst, src, s)
    dev.sync(s, timeout=120)
    assert np.array_equal(dst, src)
    assert L.cuEventDestroy(ev) == SUCCESS


# ------------------------------------------------------------------ implicit synchronization
def _alloc(L, flags=0):
    p = c_void_p()
    assert L.cuMemHostAlloc(byref(p), 256, flags) == SUCCESS
    return p.value


@pytest.mark.parametrize("kind", ["non-blocking", "blocking", "legacy"])
@pytest.mark.parametrize("op", ["cuMemHostAlloc", "cuMemAllocHost_v2", "cuMemFreeHost",
                                "cuCtxSynchronize"])
def test_pinned_alloc_free_and_ctx_sync_wait_for_every_stream(L, dev, op, kind):
    s = {"non-blocking": lambda: dev.stream(NON_BLOCKING), "blocking": lambda: dev.stream(BLOCKING),
         "legacy": lambda: 0}[kind]()
    victim = _alloc(L)
    out = c_void_p()
    calls = {"cuMemHostAlloc": lambda: L.cuMemHostAlloc(byref(out), 64, 1),
             "cuMemAllocHost_v2": lambda: L.cuMemAllocHost_v2(byref(out), 64),
             "cuMemFreeHost": lambda: L.cuMemFreeHost(victim),
             "cuCtxSynchronize": lambda: L.cuCtxSynchronize()}
    g = dev.gate(s)
    waits = cs.sync_waits()
    c = Call(calls[op], ctx=dev.ctx)
    assert not c.finished(0.3)
    assert cs.sync_waits() == waits + 1
    g.open()
    assert c.finished() and c.result == SUCCESS
    if op != "cuMemFreeHost":
        assert L.cuMemFreeHost(victim) == SUCCESS
    if out.value:
        assert L.cuMemFreeHost(out) == SUCCESS


def test_an_idle_device_does_not_make_pinned_calls_wait(L, dev):
    s = dev.stream()
    dev.sync(s)
    waits, live = cs.sync_waits(), cs.pinned_live()
    p = _alloc(L)
    assert cs.pinned_live() == live + 1
    assert L.cuMemFreeHost(p) == SUCCESS and L.cuCtxSynchronize() == SUCCESS
    assert cs.sync_waits() == waits and cs.pinned_live() == live


def test_implicit_sync_waits_only_for_work_enqueued_before_it(L, dev):
    """The alloc returns once g1 has passed, while g2 (enqueued after the alloc began) still
    holds the stream. The stream's worker counts itself blocked only when it reaches g2, which
    it does after the step that released the alloc: on a loaded machine the alloc can return
    first, so the blocked count is awaited, not sampled."""
    s = dev.stream()
    g1 = dev.gate(s)
    out = c_void_p()
    c = Call(L.cuMemHostAlloc, byref(out), 64, 0, ctx=dev.ctx)
    assert not c.finished(0.2)
    g2 = dev.gate(s)                                    # enqueued after the alloc began
    g1.open()
    assert c.finished() and c.result == SUCCESS
    assert L.cuStreamQuery(s) == NOT_READY
    assert eventually(lambda: cs.blocked_streams() >= 1)
    assert L.cuStreamQuery(s) == NOT_READY
    g2.open()
    assert L.cuMemFreeHost(out) == SUCCESS


def test_a_long_implicit_sync_reports_the_blocked_stream_once_and_keeps_waiting(
        L, dev, monkeypatch, capfd):
    monkeypatch.setenv("AL_STANDIN_SYNC_WARN", "0.2")
    s = dev.stream()
    p = _alloc(L)
    g = dev.gate(s)
    c = Call(L.cuMemFreeHost, p, ctx=dev.ctx)
    assert not c.finished(0.8)
    g.open()
    assert c.finished() and c.result == SUCCESS
    err = capfd.readouterr().err
    assert err.count("cuda stand-in: cuMemFreeHost has waited") == 1, err
    assert f"stream {s:#x} is blocked in cuStreamWaitValue32" in err
    assert "a deadlock if the flag's writer is this thread" in err


@pytest.mark.timeout(300, method="thread")
def test_freeing_pinned_memory_on_the_flag_writers_thread_deadlocks():
    """The bug the stand-in exists to catch: cuMemFreeHost on the thread that would next write
    the flag another stream is waiting for never returns (as on a GPU); the stand-in says so on
    stderr and keeps waiting."""
    code = PRELUDE + """
import sys
cs.make_current(0)
s = cs.stream_create(1)
p = c_void_p()
assert L.cuMemHostAlloc(byref(p), 4096, 0) == 0
flag = np.zeros(1, np.uint32)
assert L.cuStreamWaitValue32_v2(s, flag.ctypes.data, 1, 0) == 0
print(f"freeing {s:#x}", flush=True)
L.cuMemFreeHost(p)             # waits for s, which waits for the store below: never returns
flag[0] = 1
print("freed", flush=True)
"""
    env = dict(os.environ, AL_STANDIN_SYNC_WARN="0.3", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=HOME, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: queue.Queue = queue.Queue()
    for stream in (proc.stdout, proc.stderr):
        threading.Thread(target=lambda f=stream: [lines.put(ln) for ln in f], daemon=True).start()
    try:
        seen = []
        deadline = time.monotonic() + 240                # a hang guard
        while (not any("cuda stand-in:" in ln or ln.startswith("freed") for ln in seen)
               and proc.poll() is None and time.monotonic() < deadline):
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        handle = next((ln.split()[1] for ln in seen if ln.startswith("freeing")), None)
        warning = next((ln for ln in seen if "cuda stand-in:" in ln), "")
        assert handle and "cuMemFreeHost has waited" in warning, seen
        assert f"stream {handle} is blocked in cuStreamWaitValue32" in warning
        time.sleep(1.0)
        assert proc.poll() is None                       # still waiting: never aborts
        while not lines.empty():
            seen.append(lines.get())
        assert not any(ln.startswith("freed") for ln in seen)
    finally:
        proc.kill()
        proc.wait(10)


# ------------------------------------------------------------------ threads, counters
def test_many_threads_at_once(L, dev):
    """Copies, events, syncs, pinned alloc/free and context push/pop from 8 threads at once."""
    n_threads, rounds = 8, 40
    results = {}

    def worker(k):
        try:
            assert L.cuCtxSetCurrent(dev.ctx) == SUCCESS
            s = cs.stream_create(NON_BLOCKING if k % 2 else BLOCKING)
            a = np.full(2048, float(k))
            b, c = np.zeros(2048), np.zeros(2048)
            ev = c_void_p()
            for i in range(rounds):
                a[0] = i
                assert L.cuMemcpyAsync(ptr(b), ptr(a), a.nbytes, s) == SUCCESS
                assert L.cuMemcpyAsync(ptr(c), ptr(b), b.nbytes, s) == SUCCESS
                assert L.cuEventCreate(byref(ev), 2) == SUCCESS
                assert L.cuEventRecord(ev, s) == SUCCESS
                assert L.cuEventSynchronize(ev) == SUCCESS and L.cuEventQuery(ev) == SUCCESS
                assert L.cuEventDestroy_v2(ev) == SUCCESS
                assert c[0] == i and c[-1] == k
                if i % 10 == 0:
                    p = _alloc(L)
                    assert L.cuMemFreeHost(p) == SUCCESS
                if i % 7 == 0:
                    assert L.cuCtxPushCurrent_v2(dev.ctx) == SUCCESS
                    assert L.cuMemcpy(ptr(c), ptr(a), a.nbytes) == SUCCESS
                    assert L.cuCtxPopCurrent_v2(None) == SUCCESS
            cs.stream_synchronize(s)
            cs.stream_destroy(s)
            results[k] = "ok"
        except BaseException as e:  # reported below
            results[k] = repr(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(25)
    assert results == {k: "ok" for k in range(n_threads)}


def test_call_counters_and_reset(L, dev):
    s = dev.stream()
    cs.reset_counters()
    assert cs.calls("cuStreamQuery") == 0 and cs.sync_waits() == 0
    for _ in range(3):
        L.cuStreamQuery(s)
    L.cuStreamDestroy(0xDEAD0)
    L.cuStreamDestroy_v2(0xDEAD0)
    L.cuStreamDestroy_v2(0xDEAD0)
    assert cs.calls("cuStreamQuery") == 3
    assert cs.calls("cuStreamDestroy") == 1 and cs.calls("cuStreamDestroy_v2") == 2
    assert L.standin_calls(b"cuStreamWaitValue32") == 0
    assert cs.calls("cuNoSuchFunction") == -1
    g = dev.gate(s)
    c = Call(L.cuCtxSynchronize, ctx=dev.ctx)
    assert not c.finished(0.2)
    g.open()
    assert c.finished() and cs.sync_waits() == 1 and cs.calls("cuCtxSynchronize") == 1
    cs.reset_counters()
    assert cs.calls("cuStreamQuery") == 0 and cs.sync_waits() == 0


# ------------------------------------------------------------------ the Python helpers
def test_host_backed_array(L, dev):
    x = cs.HostBackedArray(np.arange(12, dtype=np.float32).reshape(3, 4))
    cai = x.__cuda_array_interface__
    assert cai["version"] == 3 and cai["shape"] == (3, 4) and cai["typestr"] == "<f4"
    assert cai["strides"] is None and cai["stream"] is None
    assert cai["data"][1] is False and cai["data"][0] == x.ptr
    y = cs.HostBackedArray(np.zeros((3, 4), np.float32))     # no other reference: kept alive
    s = dev.stream()
    assert L.cuMemcpyAsync(y.__cuda_array_interface__["data"][0], cai["data"][0], 48, s) == SUCCESS
    cs.stream_synchronize(s)
    got = y.get()
    assert np.array_equal(got, np.arange(12, dtype=np.float32).reshape(3, 4))
    got[:] = -1                                                # a copy
    assert np.array_equal(y.get(), x.get())
    with pytest.raises(ValueError):
        cs.HostBackedArray(np.zeros((4, 4))[:, 1])


def test_python_helpers_raise_with_the_curesult(L, ctx):
    with pytest.raises(cs.CudaStandinError, match=r"CUDA_ERROR_INVALID_HANDLE \(CUresult 400\)"):
        cs.stream_synchronize(0xDEAD0)
    with pytest.raises(cs.CudaStandinError, match="CUDA_ERROR_INVALID_VALUE"):
        cs.stream_create(8)
    n = c_int()
    assert L.cuDeviceGetCount(byref(n)) == SUCCESS
    with pytest.raises(cs.CudaStandinError, match="CUDA_ERROR_INVALID_DEVICE"):
        cs.make_current(n.value)


def test_driver_lock_mode_reports_a_call_made_with_the_gil_held(L, dev):
    """With the driver lock on (cs.driver_lock), a thread inside cuCtxSynchronize holds it while
    the device is busy; other calls wait for it. A call that waits while its thread holds the
    GIL (ctypes.PyDLL keeps it) is reported once, with the calls named; one without it (ctypes'
    CDLL releases the GIL) waits unreported. Off, nothing waits.  The device is busy until
    both calls have met the lock (cs.stream_hold), or, with the lock off, until the test opens
    a gate: never for a time."""
    s, other = dev.stream(), dev.stream()
    held_gil = ctypes.PyDLL(cs.path()).cuStreamQuery      # the same library, GIL kept
    held_gil.restype, held_gil.argtypes = c_int, [c_void_p]
    was = L.standin_driver_lock_mode()
    cs.driver_lock(True)
    try:
        cs.reset_counters()
        before = cs.driver_lock_violations()[0]
        cs.stream_hold(s, 2)                                # busy until two calls met the lock
        sync = Call(L.cuCtxSynchronize, ctx=dev.ctx)
        assert eventually(cs.driver_lock_held)
        free = Call(L.cuStreamQuery, other, ctx=dev.ctx)  # waits for the lock, GIL released
        assert eventually(lambda: cs.driver_lock_waits() == 1)
        assert held_gil(other) == SUCCESS                   # waited for the lock, GIL held
        assert sync.finished() and sync.result == SUCCESS
        assert free.finished() and free.result == SUCCESS
        count, message = cs.driver_lock_violations()
        assert count == before + 1 and cs.driver_lock_waits() == 2
        assert message.startswith("cuStreamQuery called while its thread holds the GIL and "
                                  "another thread waits in the driver (cuCtxSynchronize)")
        cs.driver_lock(False)
        g = dev.gate(s)                                     # busy until opened
        sync = Call(L.cuCtxSynchronize, ctx=dev.ctx)
        assert not cs.driver_lock_held() and held_gil(other) == SUCCESS
        g.open()
        assert sync.finished() and cs.driver_lock_violations()[0] == before + 1
        assert cs.driver_lock_waits() == 2
    finally:
        cs.driver_lock(bool(was))


def test_nccl_is_the_standin_when_cuda_is(monkeypatch):
    """With AL_CUDA_LIBRARY naming the CUDA stand-in and AL_NCCL_LIBRARY unset, the NCCL
    stand-in in the same library is NCCL's only candidate (a real NCCL cannot run on the
    stand-in's devices); AL_NCCL_LIBRARY still wins, and another CUDA library changes nothing."""
    from aluminum_py import _core, nccl
    monkeypatch.delenv("AL_NCCL_LIBRARY", raising=False)
    monkeypatch.delenv("AL_CUDA_LIBRARY", raising=False)
    usual = nccl.candidates()
    assert cs.path() not in usual
    monkeypatch.setenv("AL_CUDA_LIBRARY", cs.path())
    assert nccl.candidates() == [cs.path()]
    assert nccl.cuda_standin_nccl() == cs.path()
    monkeypatch.setenv("AL_NCCL_LIBRARY", "/nowhere/libnccl.so.2")
    assert nccl.candidates() == ["/nowhere/libnccl.so.2"] + usual
    monkeypatch.delenv("AL_NCCL_LIBRARY")
    monkeypatch.setenv("AL_CUDA_LIBRARY", _core.__file__)     # a library, not the stand-in
    assert nccl.candidates() == usual and nccl.cuda_standin_nccl() is None
