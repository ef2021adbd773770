"""The private hooks of the compiled core that tests reach for, in one place: tests import them
from here, never from ``aluminum_py._core`` directly, so that what the package exposes to
tests alone is listed once.  None of them is public API.

The shared-memory transport (ext/core/shm.pxi, shm_vcollectives.pxi):

* :func:`shm_info`: a communicator's segment as this rank sees it (its length, slot, rounds,
  who broke it, the sizes from which it streams).
* :func:`set_shm_slot_stores`, :func:`set_shm_stream_bytes`: this process's slot and recvbuf
  stores (what AL_SHM_SLOT_STORES and AL_SHM_STREAM_BYTES set at import).
* :func:`shm_attach`, :func:`shm_detach`, :func:`shm_bytes`, :func:`shm_header_check`: the
  segment's setup and its header check, driven directly.
* :class:`CommState`: the native state that :func:`shm_attach` sets up.
* :func:`shm_allgatherv`, :func:`shm_alltoall`, :func:`shm_alltoallv`: the v-collectives'
  entries, called without the communicator's argument checks.
* :func:`_waits_anew`: whether a running op's next poll counts as a new wait (wait_poll).

The waits and the progress engine (ext/core/engine.pxi):

* :func:`set_wait_spin`, :func:`set_wait_nap`, :func:`poll_yield`, :func:`set_poll_yield`:
  how a blocking call's wait polls (what AL_WAIT_SPIN, AL_WAIT_NAP and AL_ENGINE_YIELD set).

Host-transfer ops and their scratch (ext/core/ht_op.pxi, scratch.pxi):

* :func:`host_transfer_allreduce`: a host-transfer allreduce started directly on a device.
* :func:`set_scratch_cache`, :func:`scratch_stats`: the scratch pool's size and its counts.
* :func:`addr`: the address of a numpy array's data.
"""
from __future__ import annotations

from .._core import (CommState, _waits_anew, addr, host_transfer_allreduce, poll_yield,
                     scratch_stats, set_poll_yield, set_scratch_cache, set_shm_slot_stores,
                     set_shm_stream_bytes, set_wait_nap, set_wait_spin, shm_allgatherv,
                     shm_alltoall, shm_alltoallv, shm_attach, shm_bytes, shm_detach,
                     shm_header_check, shm_info)

__all__ = ["CommState", "_waits_anew", "addr", "host_transfer_allreduce", "poll_yield",
           "scratch_stats", "set_poll_yield", "set_scratch_cache", "set_shm_slot_stores",
           "set_shm_stream_bytes", "set_wait_nap", "set_wait_spin", "shm_allgatherv",
           "shm_alltoall", "shm_alltoallv", "shm_attach", "shm_bytes", "shm_detach",
           "shm_header_check", "shm_info"]

# the slot stores' modes (set_shm_slot_stores; config.SHM_SLOT_STORES's indices)
STORES_BY_SIZE, STORES_CACHED, STORES_STREAMED = 0, 1, 2
