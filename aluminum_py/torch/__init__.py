"""PyTorch integration (docs/torch.md).

* The torch.distributed backend ``"aluminum"`` (:mod:`.backend`) and the ``mpi://`` rendezvous
  (:mod:`.rendezvous`), registered by ``import aluminum_py.torch``::

      torch.distributed.init_process_group("aluminum", init_method="mpi://")   # under mpiexec

  or :func:`init_process_group`.  DDP, FSDP2, DTensor, the functional collectives and every
  ``torch.distributed`` call then run on the library's algorithms; :func:`all_reduce` is
  ``dist.all_reduce`` without torch's dispatch (tensor-parallel inference).
* DDP communication hooks for a gloo or NCCL process group (:mod:`.hooks`):
  :func:`allreduce_hook`, :func:`fp16_compress_hook`, :func:`bf16_compress_hook`.
* :func:`synchronize_gradients`: gradient averaging without DDP (:mod:`.synchronizer`).

torch is imported by this subpackage only: ``import aluminum_py`` works without it.
"""
from . import backend, hooks, rendezvous
from .backend import NAME, ProcessGroupAluminum, Work, all_reduce, init_process_group
from .hooks import (allreduce_hook, bf16_compress_hook, default_communicator,
                    fp16_compress_hook)
from .synchronizer import Synchronizer, synchronize_gradients

__all__ = ["init_process_group", "all_reduce", "ProcessGroupAluminum", "Work", "NAME",
           "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "default_communicator",
           "synchronize_gradients", "Synchronizer", "register"]

_waiter, as_buffer = hooks._waiter, hooks.as_buffer


def register() -> None:
    """Register the backend ``"aluminum"`` and the ``mpi://`` rendezvous with torch.distributed
    (done by ``import aluminum_py.torch``; also the ``torch.distributed.backends`` entry point)."""
    backend.register()
    rendezvous.register()


register()
