"""One timing mechanism for every benchmark: interleaved contenders in a random order per
iteration, barrier before each call, samples are the max over ranks of one call."""
from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np


def parse_bytes(text: str) -> int:
    """'4', '64KiB', '16MiB', '1G' -> bytes."""
    t = str(text).strip().lower()
    for suf, mul in (("kib", 1 << 10), ("mib", 1 << 20), ("gib", 1 << 30), ("kb", 1 << 10),
                     ("mb", 1 << 20), ("gb", 1 << 30), ("k", 1 << 10), ("m", 1 << 20),
                     ("g", 1 << 30), ("b", 1)):
        if t.endswith(suf):
            return int(float(t[: -len(suf)]) * mul)
    return int(t)


def human(n: int) -> str:
    for unit, mul in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mul and n % mul == 0:
            return f"{n // mul} {unit}"
    return f"{n} B"


HUGE_PAGE = 2 << 20     # x86-64's transparent huge page
HUGE_FROM = 4 << 20     # numpy's allocations from this size ask for them (madvise)


def recvbuf_like(send: np.ndarray) -> np.ndarray:
    """A recvbuf for `send` (same shape and dtype, zeroed) that starts at the sendbuf's offset
    into its page, as two fresh large numpy arrays do.  Contenders timed side by side each get
    one: numpy's consecutive smaller arrays start 16, 32, 48 ... bytes after the previous one's
    page offset, and MPICH's single copy into a recvbuf 1-63 bytes after the sendbuf's offset
    costs the MPI-based algorithms up to 1.2x even with the placed scratch (docs/performance.md,
    "A recvbuf just ahead of the sendbuf"): each recvbuf allocated in turn gave the first
    contenders that placement and not the others (``auto`` 1.10-1.16x its own algorithm
    at 32 MiB in five runs of five; recursive doubling, Rabenseifner and ring at 1-16 MiB).
    From HUGE_FROM bytes (where numpy asks the kernel for transparent huge pages) the recvbuf
    starts at the sendbuf's offset into a 2 MiB huge page, so every contender's recvbuf lies on
    huge pages alike: a fresh 4 MiB array lies half or wholly on them by the luck of its
    address, and MPICH's single copy into a recvbuf wholly on them took 0.77-0.86x the time
    (shm 0.94-1.04x; docs/performance.md, "Huge pages and MPICH's single copy")."""
    from ..testing import at_page_offset
    page = HUGE_PAGE if send.nbytes >= HUGE_FROM else 4096
    recv = at_page_offset(send.nbytes, send.ctypes.data % page, send.dtype, page=page)
    return recv.reshape(send.shape)


def size_sweep(lo: int, hi: int, itemsize: int, odd: bool = False) -> list[int]:
    """Powers of two from lo to hi bytes (multiples of itemsize); with odd, also 3 * 2^k
    sizes in between (sizes that do not split evenly over ranks)."""
    sizes = set()
    n = max(itemsize, 1 << max(0, (max(lo, 1) - 1).bit_length()))
    while n <= hi:
        sizes.add(n)
        if odd and n * 3 // 2 <= hi and n * 3 // 2 >= lo:
            sizes.add((n * 3 // 2) // itemsize * itemsize or itemsize)
        n *= 2
    return sorted(s for s in sizes if s >= max(lo, itemsize))


def iterations(world, contenders: dict[str, Callable[[], object]], budget: float,
               lo: int = 5, hi: int = 1000, rounds: int = 3) -> int:
    """Warm every contender up and pick an iteration count that fits `budget` seconds
    (identical on all ranks: from the max over ranks).  Where one round of the contenders
    takes under a tenth of the budget, `rounds` rounds are timed and each contender counts its
    median: one slow first call (DeepSpeed's op took 40 ms once where it takes 5 ms, at 4
    ranks on 2 cores) had cut a 2 s budget to 50 iterations of 20 us calls, whose medians were
    then 1.1-1.3x apart for one algorithm under two names)."""
    def one_round():
        t = []
        for f in contenders.values():
            world.Barrier()
            t0 = time.perf_counter()
            f()
            t.append(time.perf_counter() - t0)
        return t
    times = [one_round()]
    if world.allreduce(sum(times[0]), op=_max()) < budget / 10:
        times += [one_round() for _ in range(rounds - 1)]
    t = world.allreduce(float(np.sum(np.median(times, axis=0))), op=_max())
    return int(min(hi, max(lo, budget / max(t, 1e-9))))


def _max():
    from mpi4py import MPI
    return MPI.MAX


def interleaved_orders(k: int, iters: int, salt: int | tuple = 0) -> list[list[int]]:
    """Per iteration, the order of `k` contenders: a permutation seeded by `salt` (an int or a
    tuple of ints) and the iteration (the same on every rank), as plain ints, all drawn before
    any call is timed (see :func:`time_interleaved`)."""
    head = list(salt) if isinstance(salt, tuple) else [salt]
    return [np.random.default_rng(head + [it]).permutation(k).tolist() for it in range(iters)]


def time_interleaved(world, contenders: dict[str, Callable[[], object]], iters: int,
                     salt: int = 0, after_call: Callable[[int, int], None] | None = None,
                     run: int = 1) -> dict[str, np.ndarray]:
    """Per contender, `iters` samples (seconds) of the max over ranks of one call. Every
    iteration runs the contenders in a fresh random order (seeded by `salt` and the iteration,
    so the same on every rank), each call preceded by a barrier: no contender always follows
    the same one (a rotation kept every contender's predecessor fixed, and a peer whose threads
    are still busy after its call, such as gloo's, then slowed the same contender every time).
    Give each size its own `salt` (its bytes): with the same orders at every size, a chance
    excess of one contender's calls right after such a peer biased it at every size alike
    (``auto`` 1.1-1.4x of shm up to 2 KiB in six runs, the same algorithm).
    The orders are drawn before the first call (:func:`interleaved_orders`): drawn between
    iterations, the ~30 us of Python that makes a generator ran between the last call of one
    iteration and the barrier of the next, and at 4 ranks on 2 cores the rank that ran it held
    its core while a peer on that core still had to finish the call: the last call of every
    iteration took 2-3x the others' time (53 against 16 us at 64 B, 80 against 40 us at 64 KiB),
    the first 1.1-1.3x, and a contender that drew the last place more often than the others
    looked slower (``auto`` 2-7% above its own algorithm, shm, at 4 B-32 KiB).
    `after_call(i, it)`, if given, runs after each timed call (contender i of `contenders`,
    iteration it), outside its time (e.g. to record each call's context).
    `run` > 1: each contender's turn is `run` calls in a row, only the last one timed (after
    its barrier), as ``auto`` runs in a loop of one size: a
    call then finds the caches as its own algorithm left them, not as the previous contender
    did (docs/performance.md, "After itself or after another contender")."""
    from mpi4py import MPI
    names = list(contenders)
    samples = np.zeros((len(names), iters))
    orders = interleaved_orders(len(names), iters, salt)
    for it in range(iters):
        for i in orders[it]:
            f = contenders[names[i]]
            for _ in range(run - 1):
                f()
            world.Barrier()
            t0 = time.perf_counter()
            f()
            samples[i, it] = time.perf_counter() - t0
            if after_call is not None:
                after_call(i, it)
    world.Allreduce(MPI.IN_PLACE, samples, op=MPI.MAX)
    return {name: samples[i] for i, name in enumerate(names)}


def bus_bandwidth(nbytes: int, seconds: float, p: int) -> float:
    """Allreduce bus bandwidth (bytes/s) as NCCL's tests define it: 2(p-1)/p * bytes / time."""
    return 2 * (p - 1) / p * nbytes / seconds if seconds > 0 and p > 1 else 0.0


class Progress:
    """A progress bar on rank 0 (tqdm when installed, else nothing)."""

    def __init__(self, total: int, enabled: bool, desc: str):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, unit="size", leave=False)
            except ImportError:
                pass

    def update(self, text: str = "") -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
