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


def at_page_offset(nbytes: int, offset: int, dtype="float32"):
    """An array of ``nbytes // itemsize`` elements of `dtype`, zeroed, that starts `offset`
    bytes into a 4 KiB page (0 <= offset < 4096)."""
    import numpy as np
    raw = np.zeros(nbytes + 8192, np.uint8)
    start = (-raw.ctypes.data) % 4096 + offset
    return raw[start:start + nbytes].view(dtype)


def nccl_launches():
    """Every NCCL launch the stand-in recorded in this process (see
    :func:`aluminum_py.testing.cuda_standin.nccl_launches`)."""
    from .cuda_standin import nccl_launches as launches
    return launches()


def reset_nccl_launches() -> None:
    from .cuda_standin import reset_nccl_launches as reset
    reset()
