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
    """The library's own probe (the CUDA driver's device count): needs no CuPy."""
    from aluminum_py.gpu import cuda_device_count
    return cuda_device_count() > 0


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


def test_groups_nest_and_always_end(monkeypatch):
    """The real ncclGroupStart/End on an empty group (NCCL accepts it without a GPU), then the
    bookkeeping: nested groups make nested calls, and an exception inside still ends the group
    (an unbalanced ncclGroupStart would swallow every later NCCL call into a group)."""
    from aluminum_py import _nccl
    with nccl.group():
        pass
    assert nccl._group.depth == 0
    calls = []
    monkeypatch.setattr(_nccl, "group_start", lambda: calls.append("start") or nccl.SUCCESS)
    monkeypatch.setattr(_nccl, "group_end", lambda: calls.append("end") or nccl.SUCCESS)
    with nccl.group():
        with nccl.group():
            assert nccl._group.depth == 2
    assert calls == ["start", "start", "end", "end"] and nccl._group.depth == 0
    calls.clear()
    with pytest.raises(KeyError):
        with nccl.group():
            raise KeyError("inside")
    assert calls == ["start", "end"] and nccl._group.depth == 0


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


# -- nonblocking communicators: ncclInProgress is settled by polling ncclCommGetAsyncError

def test_blocking_false_reaches_the_config():
    from aluminum_py import _nccl
    assert _nccl.config_fields(blocking=False)["blocking"] == 0
    assert _nccl.config_fields(blocking=True)["blocking"] == 1
    assert _nccl.config_fields()["blocking"] == _nccl.UNDEF_INT       # NCCL's default
    assert _nccl.config_fields(max_ctas=3)["maxCTAs"] == 3


def test_poll_loop_stops_when_no_longer_in_progress():
    from aluminum_py import _nccl
    assert _nccl.poll_scripted(0, nccl.SUCCESS, 5.0) == (nccl.SUCCESS, nccl.SUCCESS, 1)
    assert _nccl.poll_scripted(25, nccl.SUCCESS, 5.0) == (nccl.SUCCESS, nccl.SUCCESS, 26)
    # an error state ends the wait too, and is returned as the state (not as the call's result)
    assert _nccl.poll_scripted(3, nccl.UNHANDLED_CUDA_ERROR, 5.0) == (0, 1, 4)
    # the query itself failing ends it at once
    assert _nccl.poll_scripted(10, 0, 5.0, query_error=nccl.INVALID_ARGUMENT)[0] == 4


def test_poll_loop_times_out_without_spinning():
    import time
    from aluminum_py import _nccl
    t0 = time.monotonic()
    rc, state, polls = _nccl.poll_scripted(10**12, 0, 0.3)
    elapsed = time.monotonic() - t0
    assert (rc, state) == (nccl.SUCCESS, nccl.IN_PROGRESS)
    assert elapsed >= 0.3                     # never gives up before its timeout
    assert polls < 2000                       # it sleeps between polls (up to 1 ms)


def test_poll_loop_lets_a_signal_through():
    """The wait on a nonblocking communicator (creation, split, ncclGroupEnd: comm_wait) runs
    the signal handlers every ~50 ms, as the library's other waits do: a Ctrl-C (here SIGALRM
    raising KeyboardInterrupt) ends a wait with a 60 s limit at once, not after it."""
    import signal
    import time
    from aluminum_py import _nccl

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    t0 = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            _nccl.poll_scripted(10**12, 0, 60.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - t0 < 30


def test_settle_maps_states_to_errors(monkeypatch):
    from aluminum_py import _nccl
    with pytest.raises(al.NcclError) as info:           # the real query on a NULL comm
        nccl.settle(0, "ncclAllReduce")
    assert info.value.code == nccl.INVALID_ARGUMENT and "ncclCommGetAsyncError" in str(info.value)
    monkeypatch.setattr(_nccl, "comm_wait", lambda h, t: nccl.IN_PROGRESS)
    with pytest.raises(al.TimeoutError, match=r"^ncclGroupEnd: .*still in progress after 0.5 s"):
        nccl.settle(0, "ncclGroupEnd", timeout=0.5)
    monkeypatch.setattr(_nccl, "comm_wait", lambda h, t: nccl.INVALID_USAGE)
    with pytest.raises(al.NcclError, match="^ncclCommSplit failed: ncclInvalidUsage") as info:
        nccl.settle(0, "ncclCommSplit")
    assert info.value.code == nccl.INVALID_USAGE
    seen = []
    monkeypatch.setattr(_nccl, "comm_wait", lambda h, t: seen.append(t) or nccl.SUCCESS)
    monkeypatch.setattr(al.config, "_hang_timeout", 7.0)
    nccl.settle(0, "x")
    monkeypatch.setattr(al.config, "_hang_timeout", None)
    nccl.settle(0, "x")
    assert seen == [7.0, -1.0]                           # AL_HANG_TIMEOUT, else no limit


def test_in_progress_answers_are_settled_and_groups_settle_at_the_end(monkeypatch):
    """The binding returns ncclInProgress instead of raising; outside a group the call is
    settled at once, inside one every communicator used is settled after ncclGroupEnd."""
    from aluminum_py import _nccl
    settled = []
    monkeypatch.setattr(nccl, "settle", lambda h, what, timeout=None: settled.append((h, what)))
    monkeypatch.setattr(_nccl, "allreduce", lambda *a: nccl.IN_PROGRESS)
    monkeypatch.setattr(_nccl, "send", lambda *a: nccl.SUCCESS)
    monkeypatch.setattr(_nccl, "group_start", lambda: nccl.SUCCESS)   # NCCL's own group
    monkeypatch.setattr(_nccl, "group_end", lambda: nccl.IN_PROGRESS)    # state stays clean
    a, b = nccl.NcclComm._from_handle(11), nccl.NcclComm._from_handle(22)
    a.allreduce(0, 0, 4, "float32", "sum", 0)
    assert settled == [(11, "ncclAllReduce")]
    settled.clear()
    with nccl.group():
        a.send(0, 4, "float32", 1, 0)
        b.send(0, 4, "float32", 1, 0)
        a.send(0, 4, "float32", 1, 0)
        assert settled == []
    assert settled == [(11, "ncclGroupEnd"), (22, "ncclGroupEnd")]
    settled.clear()
    monkeypatch.setattr(_nccl, "comm_init_rank", lambda *a, **k: (33, nccl.IN_PROGRESS))
    assert nccl.NcclComm(2, bytes(128), 0, blocking=False).handle == 33
    assert settled == [(33, "ncclCommInitRankConfig")]


def test_failed_nonblocking_creation_aborts_the_communicator(monkeypatch):
    from aluminum_py import _nccl
    aborted = []
    monkeypatch.setattr(_nccl, "comm_init_rank", lambda *a, **k: (44, nccl.IN_PROGRESS))
    monkeypatch.setattr(_nccl, "comm_wait", lambda h, t: nccl.UNHANDLED_CUDA_ERROR)
    monkeypatch.setattr(_nccl, "comm_abort", aborted.append)
    with pytest.raises(al.NcclError, match="^ncclCommInitRankConfig failed"):
        nccl.NcclComm(2, bytes(128), 0, blocking=False)
    assert aborted == [44]


# -- ncclConfig_t as NCCL 2.18+ checks it

def test_min_ctas_alone_sets_max_ctas():
    """NCCL rejects minCTAs > maxCTAs and an unset maxCTAs (INT_MIN) counts as smaller than
    any minCTAs: min_ctas alone must also set maxCTAs, or ncclCommInitRankConfig and
    ncclCommSplit fail with ncclInvalidArgument."""
    from aluminum_py import _nccl
    cfg = nccl._config(4, None, None, None)
    assert cfg["min_ctas"] == 4 and cfg["max_ctas"] == nccl.MAX_CHANNELS
    assert nccl._config(100, None, None, None)["max_ctas"] == 100
    fields = _nccl.config_fields(**{k: v for k, v in cfg.items() if k != "cga_cluster_size"})
    assert fields["minCTAs"] == 4 and fields["maxCTAs"] == nccl.MAX_CHANNELS
    assert fields["minCTAs"] <= fields["maxCTAs"]          # what NCCL's config check requires
    assert _nccl.config_fields(min_ctas=4)["maxCTAs"] == _nccl.UNDEF_INT   # the raw binding
    assert nccl._config(None, 8, None, None)["min_ctas"] is None


@pytest.mark.parametrize("kwargs, match", [({"min_ctas": 0}, "min_ctas"),
                                           ({"max_ctas": -1}, "max_ctas"),
                                           ({"min_ctas": 2.5}, "min_ctas"),
                                           ({"max_ctas": True}, "max_ctas"),
                                           ({"min_ctas": 9, "max_ctas": 8}, "larger"),
                                           ({"cga_cluster_size": -1}, "cga_cluster_size")])
def test_config_is_validated_with_a_clear_error(kwargs, match):
    args = {"min_ctas": None, "max_ctas": None, "cga_cluster_size": None, "blocking": None}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        nccl._config(**args)


# -- building against the real nccl.h with the CUDA header stubs

@pytest.mark.parametrize("lang", ["c", "c++"])
def test_wheel_header_compiles_with_the_cuda_stubs(tmp_path, lang):
    """ext/cuda_stubs stands in for the CUDA headers nccl.h includes: cuda_runtime.h,
    cuda_fp16.h, cuda_bf16.h and cuda_fp8.h (NCCL 2.24-2.27 include it from C whenever
    CUDART_VERSION >= 11080, 2.28+ from C++). Compiles the installed wheel's nccl.h both ways."""
    import shutil
    import nvidia.nccl
    compiler = shutil.which("g++" if lang == "c++" else "gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no compiler")
    inc = [os.path.join(p, "include") for p in nvidia.nccl.__path__
           if os.path.exists(os.path.join(p, "include", "nccl.h"))]
    if not inc:
        pytest.skip("the wheel has no nccl.h")
    stubs = os.path.join(os.path.dirname(__file__), "..", "ext", "cuda_stubs")
    src = tmp_path / ("t.cpp" if lang == "c++" else "t.c")
    src.write_text("#include <nccl.h>\nint main(void) { ncclConfig_t c = NCCL_CONFIG_INITIALIZER;"
                   " return c.maxCTAs == 0; }\n")
    proc = subprocess.run([compiler, "-fsyntax-only", "-I", stubs, "-I", inc[0], str(src)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_fp8_stub_satisfies_the_2_24_header_form(tmp_path):
    """NCCL 2.24-2.27's form, `#if CUDART_VERSION >= 11080 / #include <cuda_fp8.h>` from C,
    with the stubs' CUDART_VERSION: the stub must exist and be includable."""
    import shutil
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no compiler")
    stubs = os.path.join(os.path.dirname(__file__), "..", "ext", "cuda_stubs")
    src = tmp_path / "t.c"
    src.write_text("#include <cuda_runtime.h>\n#include <cuda_fp16.h>\n#if CUDART_VERSION >= 11000\n"
                   "#include <cuda_bf16.h>\n#endif\n#if CUDART_VERSION >= 11080\n"
                   "#include <cuda_fp8.h>\n#endif\nint main(void) { return 0; }\n")
    proc = subprocess.run([compiler, "-fsyntax-only", "-I", stubs, str(src)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
