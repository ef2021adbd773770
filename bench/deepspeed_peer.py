"""DeepSpeed's CPU shared-memory allreduce as a benchmark peer: ``deepspeed.comm.inference_all_reduce``
with ``DS_ACCELERATOR=cpu``, which runs the JIT-built ``deepspeed_shm_comm`` op
(csrc/cpu/comm/shm_interface.cpp, shm.cpp) when every rank is on one node.

    peer, reason = shm_allreduce(world)   # after torch.distributed is initialised (gloo)
    call = peer(send)                     # in place on a float32 copy of `send`
    call(); result = call.result()
    peer.all_reduce(tensor)               # the op itself, in place on a float32 CPU tensor

DeepSpeed's op has two conditions that it does not check itself, so this module does:

* ``LOCAL_SIZE`` must equal the world size, or the op never maps its segments and the first call
  dereferences a null workspace; we set it (with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) from
  mpi4py's ``COMM_WORLD`` and skip the peer when the ranks span more than one node.
* ``inference_all_reduce`` silently falls back to ``torch.distributed.all_reduce`` (gloo) when the
  op did not build or the CPU lacks AVX2; the peer is skipped then instead of timing gloo twice.

The op names its POSIX shared-memory segments ``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_
<MASTER_PORT>_<rank>`` (2 x 1 MiB + 2 x 32 MiB each) and never unlinks them; once every rank has
mapped every segment we unlink our own, so nothing is left in /dev/shm however the run ends
(a warning is printed if the name is not found).
Its waits spin without a timeout: a rank that dies mid-call leaves the others spinning until
mpiexec kills them.
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np
from mpi4py import MPI

SEGMENT = "/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"


def _agree(world, reason: str | None) -> str | None:
    """The first rank's reason to skip, or None if no rank has one (every rank must skip)."""
    reasons = world.allgather(reason)
    return next((f"rank {r}: {why}" for r, why in enumerate(reasons) if why), None)


def _build_op():
    """The JIT-built shm module (rank 0 builds it first, the others load the cached .so)."""
    from deepspeed.accelerator import get_accelerator
    import deepspeed.ops
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        raise RuntimeError("DeepSpeed reports its ShareMemCommBuilder op incompatible here")
    return builder.load(verbose=False)


def shm_allreduce(world) -> tuple[Callable | None, str | None]:
    """(factory, None), or (None, why it is skipped). Collective over `world`: every rank gets the
    same answer.  torch.distributed must already be initialised with MASTER_ADDR / MASTER_PORT in
    the environment (peers.py's gloo peer does it)."""
    reason = None
    if os.environ.setdefault("DS_ACCELERATOR", "cpu") != "cpu":
        reason = f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']}, the SHM op is the cpu one's"
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = node.rank, node.size
    node.Free()
    if reason is None and local_size != world.size:
        reason = (f"the ranks span several nodes ({local_size} of {world.size} on this one); "
                  f"DeepSpeed's SHM allreduce needs them all on one")
    if reason is None:
        try:
            import torch
            import torch.distributed as dist
            if not dist.is_initialized():
                reason = "torch.distributed is not initialised"
        except ImportError as e:
            reason = f"torch: {e}"
    if reason is None:
        try:
            import deepspeed  # noqa: F401  (logs its accelerator choice)
        except Exception as e:  # ImportError, or anything its import-time probing raises
            reason = f"import deepspeed: {type(e).__name__}: {e}"
    # one JIT build: rank 0 compiles (a minute or two the first time), then the others load it
    for turn in (0, 1):
        if reason is None and (world.rank == 0) == (turn == 0):
            try:
                _build_op()
            except Exception as e:
                reason = f"building deepspeed_shm_comm: {type(e).__name__}: {str(e)[-300:]}"
        agreed = _agree(world, reason)
        if agreed:
            return None, agreed

    for key, value in (("RANK", world.rank), ("WORLD_SIZE", world.size),
                       ("LOCAL_RANK", local_rank), ("LOCAL_SIZE", local_size)):
        os.environ[key] = str(value)
    import deepspeed.comm as dscomm
    from deepspeed.comm import comm as dscomm_state
    try:                                # maps every rank's segment, spinning until they exist
        dscomm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    except Exception as e:              # the other ranks would spin forever: end the job
        print(f"# rank {world.rank}: deepspeed.comm.init_distributed: {type(e).__name__}: {e}",
              flush=True)
        world.Abort(1)
    backend = dscomm_state.cdb          # the backend object init_distributed just made
    if getattr(backend, "shm_comm_op", None) is None:
        reason = "DeepSpeed's backend has no shm op: inference_all_reduce would be gloo's"
    elif not hasattr(torch.ops.deepspeed, "inference_all_reduce_"):
        reason = "torch.ops.deepspeed.inference_all_reduce_ is not registered"
    elif getattr(backend, "shm_vector_kernel_level", 0) < 1:
        reason = "the CPU lacks AVX2: inference_all_reduce would fall back to gloo"
    world.Barrier()                     # every rank has mapped every rank's segment
    segment = SEGMENT.format(uid=os.getuid(), addr=os.environ["MASTER_ADDR"],
                             port=os.environ["MASTER_PORT"], rank=world.rank)
    try:
        os.unlink(segment)
    except FileNotFoundError:        # the op's naming changed: say so, the segments stay
        print(f"# rank {world.rank}: warning: {segment} not found; DeepSpeed's SHM segments "
              f"are left in /dev/shm", flush=True)
    agreed = _agree(world, reason)
    if agreed:
        return None, agreed

    def factory(send: np.ndarray):
        t = torch.from_numpy(send.copy())

        def call():
            dscomm.inference_all_reduce(t)
        call.result = t.numpy
        return call
    factory.all_reduce = dscomm.inference_all_reduce
    return factory, None
