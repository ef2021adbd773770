"""Stop the progress engine at interpreter exit, before mpi4py finalizes MPI.

mpi4py finalizes MPI after Python's atexit handlers have run, so an atexit handler registered
here runs first: pending ops get AL_EXIT_GRACE seconds (default 2) to complete, then their MPI
requests are cancelled and freed, so an exiting program never hangs on them. Then the CUDA
devices' pinned-buffer pools are released (after a device synchronize; never earlier, never on
the engine's thread). The timeline (AL_TIMELINE) is completed after the engine stopped, so the
ops that completed or were cancelled in the grace period are in it.  In a child made by
os.fork() the handler does nothing: what it would stop and release belongs to the parent.
"""
import atexit

from . import _core, config, timeline


def _shutdown() -> None:
    if _core.forked():              # a child of os.fork(): the engine, MPI and the devices are
        return                      # the parent's (engine.pxi stops MPI_Finalize there too)
    with config.deferred():         # a bad AL_EXIT_GRACE: the default (reported at Communicator())
        grace = config.exit_grace()
    _core.shutdown_engine(grace)
    timeline.stop()
    from .gpu import release_pinned_pools
    release_pinned_pools()          # only now: no host-transfer op can still take a buffer


def install() -> None:
    # bad values: their defaults, and Communicator() raises the first on every rank
    with config.deferred():
        config.exit_grace()
        _core.set_idle_spin(config.engine_spin())
        _core.set_serial_bytes(config.engine_serial_bytes())
        _core.set_scratch_cache(config.scratch_cache())
        _core.set_wait_spin(config.wait_spin())
        _core.set_wait_nap(config.wait_nap())
        _core.set_shm_stream_bytes(config.shm_stream_bytes(), config.last_level_cache_bytes())
        _core.set_shm_slot_stores(config.shm_slot_stores())
        atexit.register(_shutdown)
        timeline.start_from_env()
