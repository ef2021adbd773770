"""Gradient averaging without DDP (Horovod style, docs/torch.md): every ``param.grad`` becomes a
view of one gradient arena, post-accumulate-grad hooks report each gradient to a
:class:`~aluminum_py.overlap.GradientSynchronizer`, and :meth:`Synchronizer.wait` is called
before ``optimizer.step()``."""
import numpy as np
import torch

from .. import Communicator
from .hooks import default_communicator

__all__ = ["synchronize_gradients", "Synchronizer"]


HOOKS = ("auto", "post_accumulate", "tensor")


class Synchronizer:
    """What :func:`synchronize_gradients` returns: the gradient arena of a model's parameters,
    the hooks that report each gradient, and the :class:`~aluminum_py.overlap.GradientSynchronizer`
    that averages them (docs/torch.md).

    Attributes:
        params: the synchronised parameters (model order, each once).
        grads: per parameter, its numpy view of the arena (``param.grad`` shares its memory).
        arenas: dtype -> the flat numpy array holding every gradient of that dtype.
        synchronizer: the :class:`~aluminum_py.overlap.GradientSynchronizer`.
        hook: ``"post_accumulate"`` or ``"tensor"``, the kind of hook registered.
    """

    def __init__(self, params, comm, policy: str, hook: str, options: dict):
        from ..overlap import GradientSynchronizer
        if hook not in HOOKS:
            raise ValueError(f"hook: {hook!r} is not one of {', '.join(HOOKS)}")
        if hook == "auto":
            hook = ("post_accumulate"
                    if hasattr(torch.Tensor, "register_post_accumulate_grad_hook") else "tensor")
        self.hook = hook
        self.params = params
        if not params:
            raise ValueError("model: no parameter requires a gradient")
        dtypes = []
        for i, p in enumerate(params):
            if p.device.type != "cpu":
                raise ValueError(f"parameter {i} is on {p.device}: synchronize_gradients "
                                 f"takes CPU parameters (use DDP with allreduce_hook on GPUs)")
            try:
                dtypes.append(torch.empty(0, dtype=p.dtype).numpy().dtype)
            except TypeError as e:
                raise TypeError(f"parameter {i}: dtype {p.dtype} has no numpy equivalent") from e
        # one arena per dtype; within it, the parameters in model order, so consecutive
        # gradients (a bucket) are one memory range and are reduced in place
        self.arenas = {}
        offsets = []
        for p, dt in zip(params, dtypes):
            offsets.append(self.arenas.get(dt, 0))
            self.arenas[dt] = offsets[-1] + p.numel()
        self.arenas = {dt: np.zeros(n, dtype=dt) for dt, n in self.arenas.items()}
        self.grads = [self.arenas[dt][off:off + p.numel()].reshape(tuple(p.shape))
                      for p, dt, off in zip(params, dtypes, offsets)]
        self._tensors = [torch.from_numpy(g) for g in self.grads]
        with torch.no_grad():
            for p, t in zip(params, self._tensors):
                if p.grad is not None:
                    t.copy_(p.grad)
                p.grad = t
        self.synchronizer = GradientSynchronizer(default_communicator() if comm is None else comm,
                                                 self.grads, policy=policy, **options)
        register = (self._post_accumulate_hook if hook == "post_accumulate"
                    else self._tensor_hook)
        self._handles = [register(i, p) for i, p in enumerate(params)]

    def _post_accumulate_hook(self, i, p):
        t, sync, comm = self._tensors[i], self.synchronizer, self.synchronizer.comm

        def ready(param):
            g = param.grad
            if g is None or g.data_ptr() != t.data_ptr():
                # zero_grad(set_to_none=True) let autograd allocate a new .grad: bring it back
                # into the arena (one copy of this gradient)
                with torch.no_grad():
                    if g is None:
                        t.zero_()
                    else:
                        t.copy_(g)
                param.grad = t
            comm.bind_thread()              # autograd's thread starts the allreduce
            sync.grad_ready(i)
        return p.register_post_accumulate_grad_hook(ready)

    def _tensor_hook(self, i, p):
        t, sync, comm = self._tensors[i], self.synchronizer, self.synchronizer.comm

        def ready(grad):
            with torch.no_grad():
                t.copy_(grad)
            # autograd must not accumulate into the arena while its allreduce runs: it gets a
            # .grad of its own until wait() points .grad back at the arena
            p.grad = None
            comm.bind_thread()              # autograd's thread starts the allreduce
            sync.grad_ready(i)
        return p.register_hook(ready)

    def wait(self, timeout: float | None = None):
        """Wait for every gradient's allreduce; afterwards every ``param.grad`` is its arena view
        holding the average over ranks.  Call it after ``backward()``, before
        ``optimizer.step()``.  Returns the synchronizer's ``SyncInfo`` (under policy ``"deft"``,
        step only when ``info.update``).  Raises ``al.Error`` if some parameter's gradient was
        not produced this step (a parameter unused by the forward pass)."""
        self.synchronizer.comm.bind_thread()    # back to the caller's thread (it may start ops)
        info = self.synchronizer.wait(timeout)
        if self.hook == "tensor":
            for p, t in zip(self.params, self._tensors):
                p.grad = t
        return info

    def flush(self, timeout: float | None = None):
        """Policy ``"deft"``: apply what is still held, after the last step (see
        ``GradientSynchronizer.flush``)."""
        self.synchronizer.comm.bind_thread()
        info = self.synchronizer.flush(timeout)
        if self.hook == "tensor":
            for p, t in zip(self.params, self._tensors):
                p.grad = t
        return info

    def zero_grad(self) -> None:
        """Zero every gradient in place (the arena): the cheap way to start a step; same as
        ``optimizer.zero_grad(set_to_none=False)``."""
        for a in self.arenas.values():
            a.fill(0)

    @property
    def profile(self):
        """What the synchronizer measured of the backward pass (``GradientSynchronizer.profile``)."""
        return getattr(self.synchronizer, "profile", None)

    def remove(self) -> None:
        """Remove the hooks (the gradients stay in the arena)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def synchronize_gradients(model, comm: Communicator | None = None, policy: str = "auto", *,
                          hook: str = "auto", **options) -> Synchronizer:
    """Average a model's gradients over the ranks without DDP (Horovod style): overlapped with
    the backward pass, completed by ``wait()``.

    Every ``param.grad`` is pointed at its view of one gradient arena (per dtype), so autograd
    accumulates straight into it and buckets of consecutive gradients are reduced in place; a
    post-accumulate-grad hook per parameter (``register_post_accumulate_grad_hook``; a tensor
    hook on a torch without it, or with ``hook="tensor"``) reports the gradient ready, which
    starts its bucket's allreduce.

    Args:
        model: a ``torch.nn.Module``, or an iterable of parameters (model order); CPU tensors.
            Parameters that do not require a gradient are left out; shared ones count once.
        comm: an ``aluminum_py.Communicator``, or None for :func:`default_communicator`.
        policy: the :class:`~aluminum_py.overlap.GradientSynchronizer` policy (default
            ``"auto"``: measures candidate bucketings on the first steps, keeps the fastest).
        hook: ``"auto"``, ``"post_accumulate"`` or ``"tensor"``.
        options: the synchronizer's keyword arguments (``threshold=``, ``compute_times=``, ...).
    Returns:
        A :class:`Synchronizer`; call its ``wait()`` after ``backward()``, before
        ``optimizer.step()``.

    The zero-grad rule: zero the gradients in place, with ``sync.zero_grad()`` or
    ``optimizer.zero_grad(set_to_none=False)``.  ``optimizer.zero_grad()`` (``set_to_none=True``,
    torch's default) detaches ``.grad`` from the arena: autograd then allocates a new tensor,
    which the hook copies back into the arena (correct, but one extra copy per gradient per
    step).  Every synchronised parameter must get a gradient in every backward pass.

    Example (``mpiexec -n 2 python train.py``)::

        sync = aluminum_py.torch.synchronize_gradients(model)
        for x, y in batches:
            sync.zero_grad()
            loss_fn(model(x), y).backward()
            sync.wait()
            optimizer.step()
    """
    if isinstance(model, torch.nn.Module):
        candidates = model.parameters()
    else:
        candidates = model
    params, seen = [], set()
    for p in candidates:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return Synchronizer(params, comm, policy, hook, options)
