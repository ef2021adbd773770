"""The private hooks of the compiled core that tests reach for, in one place: tests import them
from here, never from ``aluminum_py._core`` directly, so that what the package exposes to
tests alone is listed once.  None of them is public API.

The shared-memory transport (ext/core/shm.pxi):

* :func:`shm_info`: a communicator's segment as this rank sees it (its length, slot, rounds,
  who broke it, the sizes from which it streams).
* :func:`set_shm_slot_stores`, :func:`set_shm_stream_bytes`: this process's slot and recvbuf
  stores (what AL_SHM_SLOT_STORES and AL_SHM_STREAM_BYTES set at import).
* :func:`shm_attach`, :func:`shm_detach`, :func:`shm_bytes`, :func:`shm_header_check`: the
  segment's setup and its header check, driven directly.
* :class:`CommState`: the native state that :func:`shm_attach` sets up.
"""
from __future__ import annotations

from .._core import (CommState, set_shm_slot_stores, set_shm_stream_bytes, shm_attach,
                     shm_bytes, shm_detach, shm_header_check, shm_info)

__all__ = ["CommState", "set_shm_slot_stores", "set_shm_stream_bytes", "shm_attach",
           "shm_bytes", "shm_detach", "shm_header_check", "shm_info"]

# the slot stores' modes (set_shm_slot_stores; config.SHM_SLOT_STORES's indices)
STORES_BY_SIZE, STORES_CACHED, STORES_STREAMED = 0, 1, 2
