"""What a receive or a probe found: :class:`Status`, and MPI's wildcards and "no index" value.

``ANY_SOURCE``, ``ANY_TAG`` and ``UNDEFINED`` are the MPI library's own values (mpi4py's
``MPI.ANY_SOURCE`` ... are the same numbers), so either spelling works everywhere.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

ANY_SOURCE: int = MPI.ANY_SOURCE
ANY_TAG: int = MPI.ANY_TAG
UNDEFINED: int = MPI.UNDEFINED      # Waitany / Testany: no active request in the list


class Status:
    """The envelope of a received (or probed) message, as mpi4py's ``MPI.Status``.

    Attributes:
        source: the rank that sent it (what ``ANY_SOURCE`` matched).
        tag: its tag (what ``ANY_TAG`` matched).
        count: its length in elements of the receiving buffer's dtype (``Recv``, ``Irecv``,
            ``Sendrecv``); in bytes for ``Probe`` / ``Iprobe`` (no buffer yet: use
            ``Get_count(dtype)``). ``UNDEFINED`` if not a whole number of elements.
        nbytes: its length in bytes.
        error: 0 (MPI_SUCCESS), or the MPI error code of a failed receive.

    A fresh Status (and the status of an op that receives nothing, e.g. ``Isend``'s) is MPI's
    empty status: source ``ANY_SOURCE``, tag ``ANY_TAG``, count 0.
    """

    __slots__ = ("source", "tag", "nbytes", "itemsize", "error")

    def __init__(self) -> None:
        self._set(ANY_SOURCE, ANY_TAG, 0, 1, 0)

    def _set(self, source: int, tag: int, nbytes: int, itemsize: int, error: int) -> "Status":
        self.source, self.tag, self.nbytes, self.itemsize, self.error = (
            int(source), int(tag), int(nbytes), int(itemsize), int(error))
        return self

    @property
    def count(self) -> int:
        return self.Get_count()

    def Get_source(self) -> int:
        return self.source

    def Get_tag(self) -> int:
        return self.tag

    def Get_error(self) -> int:
        return self.error

    def Get_count(self, datatype=None) -> int:
        """The message's length in elements: of the receiving buffer's dtype (None; bytes
        for a probe), or of `datatype` (a numpy dtype or type, or an mpi4py datatype).
        UNDEFINED if the length is not a whole number of them."""
        size = self.itemsize if datatype is None else _itemsize(datatype)
        if size == 0:
            return 0 if self.nbytes == 0 else UNDEFINED
        return self.nbytes // size if self.nbytes % size == 0 else UNDEFINED

    def Get_elements(self, datatype) -> int:
        """Get_count of `datatype` (for the basic datatypes here, elements and count agree)."""
        return self.Get_count(datatype)

    def Is_cancelled(self) -> bool:
        return False

    def __eq__(self, other) -> bool:
        if not isinstance(other, Status):
            return NotImplemented
        return all(getattr(self, a) == getattr(other, a) for a in self.__slots__)

    def __repr__(self) -> str:
        return (f"<aluminum_py.Status source={self.source} tag={self.tag} "
                f"count={self.count} error={self.error}>")


def envelope(source: int, tag: int, nbytes: int, itemsize: int, error: int) -> Status:
    """A Status of these fields (ints already): the receive path's, without __init__'s calls
    (every blocking Recv makes one)."""
    st = _new(Status)
    st.source, st.tag, st.nbytes, st.itemsize, st.error = source, tag, nbytes, itemsize, error
    return st


_new = object.__new__


def _itemsize(datatype) -> int:
    if isinstance(datatype, MPI.Datatype):
        return datatype.Get_size()
    try:
        return np.dtype(datatype).itemsize
    except TypeError:
        raise TypeError(f"datatype: expected a numpy dtype or an mpi4py datatype, got "
                        f"{type(datatype).__name__}") from None


def status_arg(status, name: str = "status") -> None:
    """Raise unless `status` is None or a :class:`Status` (before any communication)."""
    if status is not None and not isinstance(status, Status):
        raise TypeError(f"{name}: expected an aluminum_py.Status or None, got "
                        f"{type(status).__name__}")


def fill(status: Status | None, found: Status) -> Status:
    """Copy `found` into the caller's `status` (if given); returns the one to hand back."""
    if status is None:
        return found
    return status._set(found.source, found.tag, found.nbytes, found.itemsize, found.error)
