# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Native core of aluminum_py: op state machines and the progress engine.

Everything below the Python-visible classes runs without the GIL:

* ``al_op`` is the state of one operation.  ``op_start`` and ``op_step`` are
  non-blocking; the same two functions drive an op to completion in the
  caller (blocking calls, GIL released) and in the progress engine thread
  (nonblocking calls).  One explicit ``phase`` field, no boolean soup.
* Our own allreduce algorithms run as a *schedule* (``al_step`` array built in
  Python by ``aluminum_py.schedules``): per step an optional local copy, an
  optional receive (plain, or followed by a reduction) and an optional send.
* MPI pass-through ops (the MPI library's own collectives and point-to-point)
  start with the ``MPI_I*`` call and are polled with ``MPI_Testall``.
* The engine thread is a pthread whose loop is pure ``nogil`` Cython calling
  the MPI C API through ``mpi4py.libmpi``.  Completion is an atomic flag
  (release store, acquire load); waiters sleep on a condition variable.
"""

from libc.stdlib cimport malloc, free, calloc
from libc.string cimport memcpy, memset, strncpy
from libc.stdint cimport int64_t, intptr_t, uint32_t, uint64_t, uintptr_t
from posix.time cimport timespec, clock_gettime, nanosleep, CLOCK_REALTIME
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE, PyBUF_C_CONTIGUOUS
from cpython.pyport cimport PY_SSIZE_T_MAX
cimport mpi4py.libmpi as mpi
cimport numpy as cnp
from mpi4py.libmpi cimport MPI_Comm, MPI_Request, MPI_Datatype, MPI_Op
from libal cimport *

# One concept per file (ext/core/); the order matters only for module-level statements.
include "core/types.pxi"            # enums, the per-kind property table, al_step, al_comm, al_op
include "core/constants.pxi"        # Python names of the C constants
include "core/scratch.pxi"          # the scratch buffer pool
include "core/op.pxi"               # the op state machine: op_start, op_step, op_finish, op_cancel
include "core/schedule.pxi"         # the schedule interpreter (our allreduce algorithms)
include "core/passthrough.pxi"      # MPI pass-through ops (the MPI library's own calls)
include "core/ht_op.pxi"            # the host-transfer state machine
include "core/engine.pxi"           # the progress engine thread, submission, waiting
include "core/mpitypes.pxi"         # MPI datatypes and ops for our dtype and op codes
include "core/helpers.pxi"          # addr, thread level, reduce_into
include "core/hooks.pxi"            # _hooks: error messages written once, in Python
include "core/commstate.pxi"        # class CommState
include "core/shm.pxi"              # the shared-memory transport: shm op, its gate, the segment
include "core/native_schedule.pxi"  # class Schedule
include "core/device.pxi"           # classes Device, CpuDevice, CudaDevice, CpuStream
include "core/nativeop.pxi"         # class NativeOp
include "core/p2p.pxi"              # probe, wait_any (Probe, Waitany & co)
include "core/msgbuffer.pxi"        # a call's buffers as one message (one parser per shape)
include "core/launcher.pxi"         # class Launcher: how an op runs and is chosen
include "core/collectives.pxi"      # class HostCollectives: one entry per host call
include "core/vcollectives.pxi"     # the v-collectives: one MPI pass-through op each
include "core/shm_vcollectives.pxi" # Allgatherv, Alltoall(v) over the segment: their entries
include "core/hier_shm.pxi"         # hierarchical over the nodes' segments: one op, phases in turn
