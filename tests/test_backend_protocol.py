"""Every backend takes the arguments of backends/base.py's Backend protocol, by the same names in
the same order (the Communicator calls them positionally): the host backend's calls are the
native entries of ``_core.HostCollectives`` (collectives.pxi), bound by name (NATIVE_CALLS), and
HostBackend methods for the rest (v-collectives, scans); the GPU backend's are Python methods. Single-process: signatures only."""
import inspect

import pytest

from aluminum_py import _core
from aluminum_py.backends.base import Backend
from aluminum_py.backends.gpu_backend import GpuBackend
from aluminum_py.backends.host import NATIVE_CALLS, HostBackend

PROTOCOL = [n for n, f in vars(Backend).items()
            if inspect.isfunction(f) and not n.startswith("_") and n not in ("choose", "close")]


def params(f) -> list:
    return [(p.name, p.default) for p in inspect.signature(f).parameters.values()]


def host_call(name):
    """The host backend's `name`: a native entry bound by name, else a HostBackend method (the
    v-collectives, scans: Python checks, then one native op)."""
    return getattr(_core.HostCollectives if name in NATIVE_CALLS else HostBackend, name)


def extends(got: list, want: list) -> bool:
    """`got` takes `want`'s parameters first, in order, and only optional ones after them (a
    host receive's recvtag / sendtag)."""
    return got[:len(want)] == want and all(d is not inspect.Parameter.empty
                                           for _, d in got[len(want):])


def test_the_host_backend_has_every_call_of_the_protocol():
    assert set(NATIVE_CALLS) <= set(PROTOCOL)
    assert all(callable(getattr(HostBackend, n, None)) for n in PROTOCOL if n not in NATIVE_CALLS)


@pytest.mark.parametrize("name", PROTOCOL)
def test_host_calls_take_the_protocol_arguments(name):
    assert extends(params(host_call(name)), params(getattr(Backend, name)))


@pytest.mark.parametrize("name", [n for n in PROTOCOL if n != "barrier"])
def test_gpu_methods_take_the_protocol_arguments(name):
    """(A barrier has no buffer: the Communicator always calls the host backend's.)"""
    assert extends(params(getattr(GpuBackend, name)), params(getattr(Backend, name)))
