"""DeFT: knapsack communication scheduling with delayed updates (Meng & Sun, "DeFT: Mitigating
Data Dependencies for Flexible Communication Scheduling in Distributed Training",
``shared/papers/deft-communication-scheduling.txt``, sections III-V, Algorithms 1-2).

One module per concept:

* :mod:`.model` -- gradient buckets and their times (:class:`Bucket`), the tensor partition of
  section III-D (:func:`partition`), the link speed ratio :data:`MU_GLOO`.
* :mod:`.knapsacks` -- Problem 1's exact 0/1 knapsack, Algorithm 1 (:func:`recursive_knapsack`)
  and Problem 2's multi-link greedy.
* :mod:`.scheduler` -- the four-case delayed-update state machine (section III-B, Fig. 4):
  :class:`DelayedUpdateScheduler` and its per-iteration :class:`IterationPlan`.
* :mod:`.preserver` -- the Preserver's convergence check and capacity feedback (section IV-C).
* :mod:`.simulator` -- the discrete-event simulator (WFBP, priority scheduling, DeFT).
* :mod:`.tables` -- the paper's Table II and the simulated iteration times on it.

Where the paper disagrees with itself, the module concerned says what it follows: Algorithm 2
versus the text (:mod:`.scheduler`), Algorithm 1 as printed and Problem 2's slow-link capacity
(:mod:`.knapsacks`), eq. 1's mean (:mod:`.preserver`), Table II's total (:mod:`.tables`).
Usage: docs/overlap.md.
"""
from .knapsacks import (MultiSelection, Selection, knapsack, multi_link_greedy,
                        recursive_knapsack, windows_from_compute)
from .model import MU_GLOO, Bucket, partition
from .preserver import expected_next_loss, preserver_ok, preserver_ratio, tune_capacity
from .scheduler import DelayedUpdateScheduler, IterationPlan, Transfer
from .simulator import SimResult, Span, _auto_piece, simulate  # _auto_piece: tests use it
from .tables import TABLE_II, TABLE_II_PRINTED_TOTAL, table_ii_report

__all__ = [
    "Bucket", "TABLE_II", "TABLE_II_PRINTED_TOTAL", "partition", "MU_GLOO",
    "Selection", "MultiSelection", "knapsack", "recursive_knapsack", "multi_link_greedy",
    "windows_from_compute",
    "Transfer", "IterationPlan", "DelayedUpdateScheduler",
    "expected_next_loss", "preserver_ratio", "preserver_ok", "tune_capacity",
    "Span", "SimResult", "simulate", "table_ii_report",
]
