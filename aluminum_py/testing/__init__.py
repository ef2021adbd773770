"""Test doubles of aluminum_py's environment.

* :mod:`aluminum_py.testing.cuda_standin`: a CUDA driver stand-in and an NCCL stand-in (one
  small C library, built on first use) that the library loads instead of libcuda.so.1 and
  libnccl.so.2 when ``AL_CUDA_LIBRARY`` and ``AL_NCCL_LIBRARY`` name it, so that the CUDA and
  NCCL code paths run, with their semantics, on machines without a GPU; NCCL's collectives
  run over MPI.
* :func:`at_page_offset`: an array placed at a chosen offset into a page (the placements of
  sendbuf against recvbuf that change the speed of a copy: tests),
  or into a 2 MiB huge page; :func:`huge_share`: how much of an array lies on huge pages.
* :func:`nccl_launches`: the NCCL launches the stand-in recorded (collective, count, dtype, op,
  the communicator's minCTAs/maxCTAs, ...).

Importing this package builds nothing.
"""
from __future__ import annotations

import mmap


def at_page_offset(nbytes: int, offset: int, dtype="float32", page: int = 4096,
                   huge: bool | None = None):
    """An array of ``nbytes // itemsize`` elements of `dtype`, zeroed, that starts `offset`
    bytes into a page of `page` bytes (0 <= offset < page; 4 KiB, or 2 MiB: a huge page).
    With 2 MiB pages the array has a fresh private mapping of its own (on Linux), on
    transparent huge pages where a fresh numpy array at its address would lie on them: the 2
    MiB pages wholly inside it (numpy asks for them from 4 MiB).  (numpy's own allocations of
    a few MiB may reuse memory of the process's heap, already on small or huge pages.)
    `huge` True or False instead: the whole mapping on huge pages, or on none
   ."""
    import numpy as np
    if page > 4096 and hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap.mmap, "madvise"):
        m = mmap.mmap(-1, nbytes + 2 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = np.frombuffer(m, np.uint8)
        start = (-raw.ctypes.data) % page + offset
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
            inside = -(-(raw.ctypes.data + start) // page) * page - raw.ctypes.data
            end = (raw.ctypes.data + start + nbytes) // page * page - raw.ctypes.data
            if huge is None and end > inside:
                m.madvise(mmap.MADV_HUGEPAGE, inside, end - inside)
        return raw[start:start + nbytes].view(dtype)
    raw = np.zeros(nbytes + 2 * page, np.uint8)
    start = (-raw.ctypes.data) % page + offset
    return raw[start:start + nbytes].view(dtype)


def huge_share(a) -> float:
    """The share of the array `a`'s 4 KiB pages that are part of a transparent huge page (from
    /proc/self/pagemap and /proc/kpageflags: needs root; nan without)."""
    import numpy as np
    lo, hi = a.ctypes.data // 4096, (a.ctypes.data + a.nbytes - 1) // 4096 + 1
    try:
        with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
            pm.seek(lo * 8)
            entries = np.frombuffer(pm.read(8 * (hi - lo)), np.uint64)
            huge = 0
            for e in entries.tolist():
                pfn = e & ((1 << 55) - 1)
                if e >> 63 and pfn:
                    kf.seek(pfn * 8)
                    huge += int.from_bytes(kf.read(8), "little") >> 22 & 1   # KPF_THP
            return huge / (hi - lo)
    except OSError:
        return float("nan")


def nccl_launches():
    """Every NCCL launch the stand-in recorded in this process (see
    :func:`aluminum_py.testing.cuda_standin.nccl_launches`)."""
    from .cuda_standin import nccl_launches as launches
    return launches()


def reset_nccl_launches() -> None:
    from .cuda_standin import reset_nccl_launches as reset
    reset()
