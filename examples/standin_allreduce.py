"""A GPU-buffer allreduce on the CUDA driver stand-in, on a machine without a GPU.

    export AL_CUDA_LIBRARY=$(python -m aluminum_py.testing.cuda_standin)   # builds it, prints its path
    mpiexec -n 2 python examples/standin_allreduce.py [ALGORITHM]        # auto, nccl, ht_ring, ...

With ``AL_CUDA_LIBRARY`` naming the stand-in (and ``AL_NCCL_LIBRARY`` unset), NCCL is the NCCL
stand-in built into the same library, so every GPU algorithm runs here. The buffer is a
:class:`~aluminum_py.testing.cuda_standin.HostBackedArray`: host memory that carries
``__cuda_array_interface__``, which the library takes for device memory. As on a GPU, the
operation is enqueued on the communicator's stream (here CUDA's legacy default stream) and the
program synchronizes that stream before it reads the result. Exits 1 on a wrong result.
"""
import sys

import numpy as np

import aluminum_py as al
from aluminum_py.testing import cuda_standin as cs


def main(argv) -> int:
    cs.make_current(0)                 # device 0's context current, as CuPy or torch make it
    comm = al.Communicator()
    x = cs.HostBackedArray(np.full(1000, comm.rank + 1.0, np.float32))     # a "device" buffer
    comm.Allreduce(x, algorithm=argv[0] if argv else "auto")
    cs.stream_synchronize(0)           # the legacy default stream: the allreduce is done
    want = np.full(1000, comm.size * (comm.size + 1) / 2, np.float32)
    ok = np.array_equal(x.get(), want)
    print(f"rank {comm.rank}: {'OK' if ok else 'WRONG'}: x[:4] = {x.get()[:4]} "
          f"(NCCL: {al.nccl.library_path()})", flush=True)
    comm.Free()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
