"""One timing mechanism for every benchmark: interleaved contenders in a random order per
iteration, barrier before each call, samples are the max over ranks of one call."""
from __future__ import annotations

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
               lo: int = 5, hi: int = 1000) -> int:
    """Warm every contender up once and pick an iteration count that fits `budget` seconds
    (identical on all ranks: from the max over ranks)."""
    t = 0.0
    for f in contenders.values():
        world.Barrier()
        t0 = time.perf_counter()
        f()
        t += time.perf_counter() - t0
    t = world.allreduce(t, op=_max())
    return int(min(hi, max(lo, budget / max(t, 1e-9))))


def _max():
    from mpi4py import MPI
    return MPI.MAX


def time_interleaved(world, contenders: dict[str, Callable[[], object]], iters: int) -> dict[str, np.ndarray]:
    """Per contender, `iters` samples (seconds) of the max over ranks of one call. Every
    iteration runs the contenders in a fresh random order (seeded by the iteration, so the same
    on every rank), each call preceded by a barrier: no contender always follows the same one
    (a rotation kept every contender's predecessor fixed, and a peer whose threads are still
    busy after its call, such as gloo's, then slowed the same contender every time)."""
    from mpi4py import MPI
    names = list(contenders)
    samples = np.zeros((len(names), iters))
    for it in range(iters):
        for i in np.random.default_rng(it).permutation(len(names)):
            f = contenders[names[i]]
            world.Barrier()
            t0 = time.perf_counter()
            f()
            samples[i, it] = time.perf_counter() - t0
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
