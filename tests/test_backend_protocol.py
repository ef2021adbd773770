"""Every backend takes the arguments of backends/base.py's Backend protocol, by the same names in
the same order (the Communicator calls them positionally): the host backend's calls are the
native entries of ``_core.HostCollectives`` (collectives.pxi), bound by name (NATIVE_CALLS); the
GPU backend's are Python methods. Single-process: signatures only."""
import inspect

import pytest

from aluminum_py import _core
from aluminum_py.backends.base import Backend
from aluminum_py.backends.gpu import GpuBackend
from aluminum_py.backends.host import NATIVE_CALLS

PROTOCOL = [n for n, f in vars(Backend).items()
            if inspect.isfunction(f) and not n.startswith("_") and n not in ("choose", "close")]


def params(f) -> list:
    return [(p.name, p.default) for p in inspect.signature(f).parameters.values()]


def test_the_host_backend_binds_every_call_of_the_protocol():
    assert sorted(NATIVE_CALLS) == sorted(PROTOCOL)


@pytest.mark.parametrize("name", PROTOCOL)
def test_host_entries_take_the_protocol_arguments(name):
    assert params(getattr(_core.HostCollectives, name)) == params(getattr(Backend, name))


@pytest.mark.parametrize("name", [n for n in PROTOCOL if n != "barrier"])
def test_gpu_methods_take_the_protocol_arguments(name):
    """(A barrier has no buffer: the Communicator always calls the host backend's.)"""
    assert params(getattr(GpuBackend, name)) == params(getattr(Backend, name))
