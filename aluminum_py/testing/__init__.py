"""Test doubles of aluminum_py's environment.

* :mod:`aluminum_py.testing.cuda_standin`: a CUDA driver stand-in and an NCCL stand-in (one
  small C library, built on first use) that the library loads instead of libcuda.so.1 and
  libnccl.so.2 when ``AL_CUDA_LIBRARY`` and ``AL_NCCL_LIBRARY`` name it, so that the CUDA and
  NCCL code paths run, with their semantics, on machines without a GPU; NCCL's collectives
  run over MPI.
* :func:`at_page_offset`: an array placed at a chosen offset into a page (the placements of
  sendbuf against recvbuf that change the speed of a copy: tests and bench/recvbuf_offsets.py).
* :func:`nccl_launches`: the NCCL launches the stand-in recorded (collective, count, dtype, op,
  the communicator's minCTAs/maxCTAs, ...).

Importing this package builds nothing.
"""
import mmap


def at_page_offset(nbytes: int, offset: int, dtype="float32", page: int = 4096):
    """An array of ``nbytes // itemsize`` elements of `dtype`, zeroed, that starts `offset`
    bytes into a page of `page` bytes (0 <= offset < page; 4 KiB, or 2 MiB: a huge page).
    With 2 MiB pages the array has a fresh private mapping of its own (on Linux), on
    transparent huge pages where a fresh numpy array at its address would lie on them: the 2
    MiB pages wholly inside it (numpy asks for them from 4 MiB).  (numpy's own allocations of
    a few MiB may reuse memory of the process's heap, already on small or huge pages.)"""
    import numpy as np
    if page > 4096 and hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap.mmap, "madvise"):
        m = mmap.mmap(-1, nbytes + 2 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = np.frombuffer(m, np.uint8)
        start = (-raw.ctypes.data) % page + offset
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            m.madvise(mmap.MADV_NOHUGEPAGE)
            inside = -(-(raw.ctypes.data + start) // page) * page - raw.ctypes.data
            end = (raw.ctypes.data + start + nbytes) // page * page - raw.ctypes.data
            if end > inside:
                m.madvise(mmap.MADV_HUGEPAGE, inside, end - inside)
        return raw[start:start + nbytes].view(dtype)
    raw = np.zeros(nbytes + 2 * page, np.uint8)
    start = (-raw.ctypes.data) % page + offset
    return raw[start:start + nbytes].view(dtype)


def nccl_launches():
    """Every NCCL launch the stand-in recorded in this process (see
    :func:`aluminum_py.testing.cuda_standin.nccl_launches`)."""
    from .cuda_standin import nccl_launches as launches
    return launches()


def reset_nccl_launches() -> None:
    from .cuda_standin import reset_nccl_launches as reset
    reset()
