"""The exception hierarchy: every library error derives from :class:`Error`.

Bad arguments raise the built-in ``ValueError`` / ``TypeError`` (with a message naming the
argument) before any communication takes place.
"""
from __future__ import annotations

import builtins


class Error(Exception):
    """Base class of aluminum_py's errors."""


class MPIError(Error):
    """An MPI call failed; ``code`` is the MPI error code (or -1 for a library-side failure)."""

    def __init__(self, message: str, code: int = -1):
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        return (type(self), (self.args[0], self.code))


class TimeoutError(Error, builtins.TimeoutError):
    """An operation did not complete within the timeout (``Wait(timeout=)`` or AL_HANG_TIMEOUT).

    The operation stays pending: its buffers are kept alive and it may still complete.
    """


class UnavailableError(Error):
    """A backend or device needed for the call is not available (e.g. no CUDA device)."""


class NcclError(Error):
    """An NCCL call failed. ``code`` is the ncclResult_t; the message carries NCCL's error
    string and, where NCCL has one, its last-error text (e.g. the CUDA error behind it)."""

    def __init__(self, message: str, code: int = -1):
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        return (type(self), (self.args[0], self.code))


class ThreadLevelWarning(RuntimeWarning):
    """Issued by ``Communicator()`` when MPI provides less than MPI_THREAD_MULTIPLE: nonblocking
    operations will raise :class:`Error`, and threads must not call the library concurrently."""
