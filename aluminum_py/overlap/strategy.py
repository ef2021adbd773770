"""The interface of a gradient synchronisation strategy: what
:class:`~aluminum_py.overlap.GradientSynchronizer` delegates every step to (one strategy per
synchronizer, chosen by its policy), and the options a strategy is built from."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence


@dataclass(frozen=True)
class SyncOptions:
    """The policy options of :class:`~aluminum_py.overlap.GradientSynchronizer` (its keyword
    arguments, documented there); each strategy reads the ones its policy uses."""

    threshold: int = 64 << 20
    cycle_time: float | None = None
    compute_times: Sequence[float] | None = None
    forward_times: Sequence[float] | None = None
    cost: Callable[[int], float] | None = None
    plan: Any = None
    groups: Sequence[tuple[int, int]] | None = None
    channel_aware: bool = False
    capacity_scale: float = 1.0
    candidates: Sequence[tuple[str, str, dict]] | None = None
    tune_steps: tuple[int, int] = (1, 5)


class StepResult(NamedTuple):
    """What a strategy's ``wait()`` reports about the step it completed."""

    update: bool                          # the gradients hold values to apply
    iterations: tuple[int, ...]           # the iterations whose gradients they hold
    buckets: list[list[int]]              # the buckets of the step (gradient indices)
    timings: list                         # per bucket (launched, started, completed), or []


class Strategy(ABC):
    """How one synchronizer reduces its gradients.  Every rank must make the same calls in the
    same order (they issue collectives).

    Attributes:
        buckets: per bucket (launch order), its gradient indices (model order).
        max_ctas: per bucket, the NCCL thread-block limit of its all-reduce, or None.
        op: the reduction op of the bucket all-reduces.
    """

    buckets: list[list[int]]
    max_ctas: list[int] | None = None
    op: Any = None

    @abstractmethod
    def grad_ready(self, i: int) -> None:
        """Gradient i (model order) is final for this step."""

    def begin_backward(self) -> None:
        """The backward pass starts now (a strategy that sends older gradients starts them)."""

    def start_at(self, iteration: int) -> None:
        """Called before the first step when that step is not iteration 0 (a strategy built
        after measuring): a strategy that reports iterations counts from `iteration`."""

    @abstractmethod
    def wait(self, iteration: int, timeout: float | None) -> StepResult:
        """Complete step ``iteration``: every transfer of the step is done and the gradients
        hold what the result says.  Raises if some gradient was never reported ready."""

    @abstractmethod
    def flush(self, timeout: float | None) -> tuple[int, ...]:
        """Between steps: synchronise and write into the gradients everything still held;
        returns the iterations written (``()``: nothing was held)."""

    @property
    def held_iterations(self) -> tuple[int, ...]:
        """Iterations whose gradients are held, not applied yet."""
        return ()

    @property
    def chosen_label(self) -> str | None:
        """The label of the candidate a tuning strategy kept (None while tuning, or when the
        strategy does not tune)."""
        return None

    @property
    def tuning_report(self) -> dict | None:
        """A tuning strategy's measurements once it has chosen: label -> median step seconds."""
        return None


class Delegating(Strategy):
    """A strategy that hands each step to another one, :attr:`active` (the candidate under
    tuning, the measuring or the planned strategy); subclasses define ``active`` and
    ``wait``."""

    @property
    @abstractmethod
    def active(self) -> Strategy:
        """The strategy that runs the current step."""

    @property
    def buckets(self):
        return self.active.buckets

    @property
    def max_ctas(self):
        return self.active.max_ctas

    @property
    def op(self):
        return self.active.op

    @property
    def views(self):
        return self.active.views

    @property
    def buffers(self):
        return self.active.buffers

    @property
    def held_iterations(self) -> tuple[int, ...]:
        return self.active.held_iterations

    def grad_ready(self, i: int) -> None:
        self.active.grad_ready(i)

    def begin_backward(self) -> None:
        self.active.begin_backward()

    def flush(self, timeout) -> tuple[int, ...]:
        return self.active.flush(timeout)
