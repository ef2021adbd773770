"""The tuning table (what ``bench crossover --tune`` measured: JSON, per configuration) and
:class:`Chooser`, which chooses ``algorithm="auto"``'s algorithm from it or, where it has nothing
that applies, from the cost model of :mod:`aluminum_py.algorithms`. The file format and the
lookup rules are in docs/tuning.md.
"""
from __future__ import annotations

import datetime
import json
import logging
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field

import numpy as np

from . import config, topology
from .files import open_private, read_regular
from .algorithms import MODELLED, ShmCost, model_time, model_times, shm_terms

FORMAT = "aluminum_py.tuning"
VERSION = 2                 # 2: entries record their topology (nodes, ranks per node)
READABLE = (1, 2)           # version 1 tables load; their entries' topology: see legacy_topology
log = logging.getLogger("aluminum_py")


class TuningWarning(UserWarning):
    """The tuning file could not be used (missing pieces, corrupt, other version)."""


def default_path() -> str:
    """AL_TUNING_FILE if set, else a per-user cache file."""
    path = config.tuning_file()
    if path:
        return path
    return os.path.join(config.cache_home(), "aluminum_py", "tuning.json")


def describe_topology(comm_size: int, ranks_per_node) -> str:
    """``"4 ranks as 2 nodes x 2"``, ``"3 ranks as 2 nodes (2+1)"``; for an entry of a version 1
    table whose topology is not known, ``"4 ranks, 2 on rank 0's node (topology not
    recorded)"`` is given by :func:`entry_topology_name`."""
    rpn = tuple(ranks_per_node)
    m = len(rpn)
    nodes = f"{m} node{'s' if m != 1 else ''}"
    if len(set(rpn)) == 1:
        return f"{comm_size} ranks as {nodes} x {rpn[0]}"
    return f"{comm_size} ranks as {nodes} ({'+'.join(map(str, rpn))})"


def entry_topology_name(entry: dict) -> str:
    if entry.get("ranks_per_node") is None:
        return (f"{entry['comm_size']} ranks, {entry['local_size']} on rank 0's node "
                f"(topology not recorded)")
    return describe_topology(entry["comm_size"], entry["ranks_per_node"])


def make_key(comm_size: int, ranks_per_node, buffer: str, dtype_size: int, mpi: str,
             local_size: int = 0) -> str:
    """The entry's place in the table: one per (rank count, ranks per node of every node,
    buffer, element size, MPI library). ``ranks_per_node`` None: a version 1 entry whose
    topology is not known (keyed by rank 0's node size, `local_size`, as version 1 was)."""
    if ranks_per_node is None:
        topo = f"{local_size}?"
    elif len(set(ranks_per_node)) == 1:
        topo = f"{len(ranks_per_node)}x{ranks_per_node[0]}"
    else:
        topo = "+".join(map(str, ranks_per_node))
    return f"{comm_size}/{topo}/{buffer}/{dtype_size}/{mpi}"


def entry_key(entry: dict) -> str:
    return make_key(entry["comm_size"], entry.get("ranks_per_node"), entry["buffer"],
                    entry["dtype_size"], entry["mpi"], entry["local_size"])


def mpi_version() -> str:
    """The MPI library's name and version, whitespace normalised ("MPICH Version: 5.0.2")."""
    from mpi4py import MPI
    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def empty_table() -> dict:
    return {"format": FORMAT, "version": VERSION, "entries": {}}


MAX_FILE_BYTES = 16 << 20  # a tuning file larger than this is not read
MAX_ENTRIES = 4096          # entries of a table, ...
MAX_SIZES = 1024            # ... sizes measured per entry
MAX_BYTES = 2 ** 62         # a size (bytes per message)
MAX_RANKS = 2 ** 31 - 1


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"number {text} out of range")
    return x


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def load(path: str | None = None, *, warn: bool = True) -> dict:
    """Read a tuning file. A missing file is an empty table; anything else that is not a table
    of this library (not a regular file, unreadable, larger than MAX_FILE_BYTES, not JSON,
    another version, a field of the wrong type or out of range) gives one TuningWarning and an
    empty table, or, for bad entries only, one TuningWarning naming them and the table without
    them: never an exception, never a blocking open (a FIFO)."""
    path = path or default_path()
    if not os.path.lexists(path):
        return empty_table()
    try:
        text = read_regular(path, MAX_FILE_BYTES)
        table = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
        if not isinstance(table, dict) or table.get("format") != FORMAT:
            raise ValueError("not an aluminum_py tuning file")
        if table.get("version") not in READABLE:
            raise ValueError(f"version {table.get('version')!r}, this library reads versions "
                             f"{', '.join(map(str, READABLE))}")
        entries = table.get("entries")
        if not isinstance(entries, dict):
            raise ValueError("no 'entries' object")
        if len(entries) > MAX_ENTRIES:
            raise ValueError(f"{len(entries)} entries, more than the {MAX_ENTRIES} accepted")
        good, bad = {}, []
        for key, entry in entries.items():
            try:
                entry = validate_entry(entry)
                good[entry_key(entry)] = entry        # version 1 keys become version 2 keys
            except (KeyError, TypeError, ValueError) as e:
                bad.append(f"{key!r} ({e})")
        if bad and warn:
            warnings.warn(f"tuning file {path}: entr{'ies' if len(bad) > 1 else 'y'} "
                          f"{'; '.join(bad)} ignored", TuningWarning, stacklevel=2)
        table["entries"] = good
        table["version"] = VERSION      # what save() writes: the entries are version 2's now
        return table
    except (OSError, ValueError, RecursionError) as e:
        if warn:
            why = "JSON nested too deeply" if isinstance(e, RecursionError) else e
            warnings.warn(f"tuning file {path} ignored, auto uses the cost model ({why})",
                          TuningWarning, stacklevel=2)
        return empty_table()


def _int(entry: dict, key: str, lo: int, hi: int) -> int:
    v = entry[key]
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{key} must be a whole number from {lo} to {hi}, not {v!r}"[:200])
    return v


def _ints(values, what: str, lo: int, hi: int, most: int) -> list[int]:
    if type(values) is not list or len(values) > most:
        raise ValueError(f"{what} must be a list of at most {most} numbers")
    if any(type(v) is not int or not lo <= v <= hi for v in values):
        raise ValueError(f"{what} must be whole numbers from {lo} to {hi}")
    return values


def validate_entry(entry: dict) -> dict:
    """Check every field of an entry read from a file (type and range: nothing that chooses
    from it can fail on its content); the fit and the ranges are recomputed from the times
    (the stored ones are for people reading the file). Raises KeyError, TypeError or
    ValueError."""
    if type(entry) is not dict:
        raise TypeError("an entry must be an object")
    sizes = _ints(entry["sizes"], "sizes", 1, MAX_BYTES, MAX_SIZES)
    if not sizes or sizes != sorted(set(sizes)):
        raise ValueError("sizes must be positive and increasing")
    if type(entry["times"]) is not dict or not entry["times"]:
        raise ValueError("times must be an object: per algorithm, a time per size")
    times = {}
    for a, ts in entry["times"].items():
        if type(ts) is not list or len(ts) != len(sizes):
            raise ValueError("times do not match sizes")
        if any(type(t) not in (int, float) or not 0 < t < math.inf for t in ts):
            raise ValueError("times must be positive and finite")
        times[a] = [float(t) for t in ts]
    for k in ("comm_size", "local_size"):
        entry[k] = _int(entry, k, 1, MAX_RANKS)
    entry["dtype_size"] = _int(entry, "dtype_size", 1, 64)
    for k in ("buffer", "mpi"):
        if type(entry[k]) is not str:
            raise ValueError(f"{k} must be a string")
    rpn = entry.get("ranks_per_node")
    if rpn is None:
        rpn = legacy_topology(entry["comm_size"], entry["local_size"])
    else:
        rpn = _ints(rpn, "ranks_per_node", 1, MAX_RANKS, entry["comm_size"])
        if not rpn or sum(rpn) != entry["comm_size"]:
            raise ValueError(f"ranks_per_node {rpn} do not add up to comm_size "
                             f"{entry['comm_size']}")
        if entry["local_size"] != rpn[0]:
            raise ValueError(f"local_size {entry['local_size']} is not rank 0's node's "
                             f"{rpn[0]} ranks")
    entry["ranks_per_node"] = rpn
    entry["nodes"] = None if rpn is None else len(rpn)
    entry["sizes"], entry["times"] = sizes, times
    for k, ok in (("choice", lambda v: type(v) is str and v in times),
                  ("margin", lambda v: type(v) in (int, float) and 0 < v < math.inf),
                  ("decided", lambda v: v in ("median", "worst case", "in use"))):
        if k in entry and (type(entry[k]) is not list or len(entry[k]) != len(sizes)
                           or not all(ok(v) for v in entry[k])):
            raise ValueError(f"{k} must be a list with one valid value per size")
    entry["fit"] = fit_all(sizes, times)
    entry["ranges"] = win_ranges(sizes, times, entry.get("choice"))
    return entry


def legacy_topology(comm_size: int, local_size: int) -> list[int] | None:
    """The topology of an entry written before tables recorded it (version 1, or no
    ``ranks_per_node``): all ranks on one node when rank 0's node held them all (the only
    case that local_size decides); else unknown (None: the entry is kept in the file but never
    used; re-run ``bench crossover --tune`` on that topology)."""
    return [comm_size] if local_size == comm_size else None


def save(table: dict, path: str | None = None) -> str:
    """Write atomically (temp file + rename, readable as the umask allows); returns the path."""
    path = path or default_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1)
    os.replace(tmp, path)
    return path


def merge_into_file(entry: dict, path: str | None = None) -> str:
    """Read, merge `entry`, write, holding an exclusive lock (so concurrent --tune runs on a
    shared file do not lose each other's entries). Returns the path."""
    import fcntl
    path = path or default_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with os.fdopen(open_private(path + ".lock", truncate=False), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return save(merge(load(path), entry), path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def merge_learned(learned: list, comm_size: int, ranks_per_node, mpi: str,
                  path: str | None = None) -> tuple[str, int]:
    """Merge what "auto" learned in use (``Communicator.learned()``) into the tuning table's
    exact host entries: at each measured size that is a learned class's power of two, the
    entry's ``choice`` becomes the learned one, ``decided`` "in use" and ``margin`` the
    runner-up's median over the choice's.  Classes without such an entry or size are left out
    (their times are not the crossover's: nothing else is written).  Returns (path, sizes
    changed)."""
    import fcntl
    path = path or default_path()
    if not learned or not os.path.exists(path):
        return path, 0
    with os.fdopen(open_private(path + ".lock", truncate=False), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            table, changed = load(path), 0
            for r in learned:
                key = make_key(comm_size, ranks_per_node, "host", r["itemsize"], mpi,
                               ranks_per_node[0])
                entry = table.get("entries", {}).get(key)
                if entry is None or r["bytes"] not in entry["sizes"] or \
                        r["choice"] not in entry["times"]:
                    continue
                i, n = entry["sizes"].index(r["bytes"]), len(entry["sizes"])
                times = entry["times"]
                entry.setdefault("choice", [min(times, key=lambda a: times[a][j])
                                            for j in range(n)])
                entry.setdefault("decided", ["median"] * n)
                entry.setdefault("margin", [1.0] * n)
                med = r["medians"]
                others = [t for a, t in med.items() if a != r["choice"]]
                entry["choice"][i], entry["decided"][i] = r["choice"], "in use"
                entry["margin"][i] = (min(others) / med[r["choice"]] if others and
                                      med.get(r["choice"]) else 1.0)
                entry["ranges"] = win_ranges(entry["sizes"], times, entry["choice"])
                changed += 1
            if changed:
                save(table, path)
            return path, changed
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def merge(table: dict, entry: dict) -> dict:
    """Add or replace `entry` (keyed by its configuration); other entries are kept, except a
    version 1 entry of unknown topology with the same rank count, rank 0's node size, buffer,
    element size and MPI, which the new measurement replaces."""
    entries = table.setdefault("entries", {})
    stale = make_key(entry["comm_size"], None, entry["buffer"], entry["dtype_size"],
                     entry["mpi"], entry["local_size"])
    entries.pop(stale, None)
    entries[entry_key(entry)] = entry
    table["format"], table["version"] = FORMAT, VERSION
    return table


def fit_alpha_beta(sizes, times) -> dict:
    """Least-squares t = alpha + beta * n over the measured sizes (seconds, seconds per byte)."""
    n = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if len(n) == 1:
        return {"alpha": float(t[0]), "beta": 0.0}
    # weight by 1/t so small sizes count as much as large ones (relative error)
    w = 1.0 / np.maximum(t, 1e-12)
    A = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    return {"alpha": float(max(alpha, 0.0)), "beta": float(max(beta, 0.0))}


def fit_all(sizes, times: dict) -> dict:
    return {alg: fit_alpha_beta(sizes, ts) for alg, ts in times.items()}


def win_ranges(sizes, times: dict, choice=None) -> list[dict]:
    """Consecutive measured sizes where the same algorithm is fastest (the recorded `choice`
    per size where there is one, else the lowest time)."""
    algs = list(times)
    ranges: list[dict] = []
    for i, n in enumerate(sizes):
        best = choice[i] if choice is not None else min(algs, key=lambda a: times[a][i])
        if ranges and ranges[-1]["algorithm"] == best:
            ranges[-1]["max_bytes"] = n
        else:
            ranges.append({"algorithm": best, "min_bytes": n, "max_bytes": n})
    return ranges


def make_entry(comm_size, ranks_per_node, buffer, dtype_size, mpi, sizes, times,
               choice=None, margin=None, decided=None) -> dict:
    """A table entry; `ranks_per_node`: the ranks of each node in node order
    (``topology.ranks_per_node``), rank 0's node first. ``topology`` is for people reading the
    file; ``local_size`` (rank 0's node) is what version 1 readers keyed by.  `choice`,
    `margin`, `decided` (optional, per size): the crossover's decision at each measured size
    (bench.timing.decide: the lower median, or within noise the better worst case), the
    runner-up's median over the chosen one's, and how it was decided."""
    rpn = [int(n) for n in ranks_per_node]
    if sum(rpn) != comm_size or not rpn or min(rpn) < 1:
        raise ValueError(f"ranks_per_node {rpn}: not a topology of {comm_size} ranks")
    return {"comm_size": comm_size, "nodes": len(rpn), "ranks_per_node": rpn,
            "local_size": rpn[0], "topology": describe_topology(comm_size, rpn),
            "buffer": buffer, "dtype_size": dtype_size, "mpi": mpi,
            "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "sizes": list(sizes), "times": {a: list(map(float, t)) for a, t in times.items()},
            "ranges": win_ranges(sizes, times, choice), "fit": fit_all(sizes, times),
            **({} if choice is None else {"choice": list(choice)}),
            **({} if margin is None else {"margin": [float(m) for m in margin]}),
            **({} if decided is None else {"decided": list(decided)})}


def shm_limits(p: int = 2) -> tuple[int, int, int, int] | None:
    """(small, slot, chunk, chunk_upto) of the segments this process makes as rank 0 for `p`
    ranks on its node (AL_SHM_SMALL_BYTES, AL_SHM_SLOT_BYTES rounded as shm_attach rounds them,
    config.shm_chunk_bytes with the engine's yield rule for p ranks, and the size from which
    recvbuf is streamed), None when it makes none: the "shm" formula's protocol limits for
    fitting an entry's shm times."""
    slot = config.shm_slot_bytes()
    if slot == 0:
        return None
    slot = (slot + 4095) // 4096 * 4096
    every = config.engine_yield()
    yielding = (config.default_engine_yield(p) if every is None else every) > 0
    stream = config.shm_stream_bytes()
    upto = stream if stream is not None else config.last_level_cache_bytes() // (2 * max(p, 1))
    return (min(config.shm_small_bytes(), slot), slot, config.shm_chunk_bytes(slot, yielding),
            upto)


def _nonnegative_lstsq(rows, rhs) -> np.ndarray:
    """Least squares with every unknown >= 0 (an active set: the most negative unknown is fixed
    at 0 and the rest solved again; a handful of unknowns)."""
    A, b = np.asarray(rows, dtype=float), np.asarray(rhs, dtype=float)
    free = list(range(A.shape[1]))
    x = np.zeros(A.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(A[:, free], b, rcond=None)
        if sol.min() >= 0:
            x[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return x


def fit_models(entry: dict, limits: tuple[int, ...] | None = None):
    """The cost models fitted to an entry's measured times: ``(abg, shm)``, abg the (alpha,
    beta, gamma) of the modelled algorithms (None: fewer than 3 of their times, or 1 rank)
    and shm the (sync, byte) of the "shm" formula (None: no shm times in the entry, no
    `limits`, the segment's (small, slot[, chunk, chunk_upto]), or fewer than 2 of them).

    One least-squares fit on relative error of t = c + formula, every unknown >= 0: c is a
    per-call cost every algorithm pays alike (the call path, the benchmark's skew), which the
    choice never depends on; fitted apart, it would be folded into alpha and the
    synchronisation latency, which multiply by different counts (2(p-1) for ring, 1 for a
    symmetric shm call), and the formulas would be compared on different scales."""
    p = entry["comm_size"]
    if p < 2:
        return None, None
    rows, rhs = [], []
    units = ((1, 0, 0), (0, 1, 0), (0, 0, 1))
    n_abg = n_shm = 0
    for alg in MODELLED:
        for n, t in zip(entry["sizes"], entry["times"].get(alg, [])):
            rows.append([1.0 / t] + [model_time(alg, p, n, u) / t for u in units] + [0.0, 0.0])
            rhs.append(1.0)
            n_abg += 1
    if limits is not None:
        for n, t in zip(entry["sizes"], entry["times"].get("shm", [])):
            syncs, traffic = shm_terms(p, n, *limits)
            rows.append([1.0 / t, 0.0, 0.0, 0.0, syncs / t, traffic / t])
            rhs.append(1.0)
            n_shm += 1
    if n_abg + n_shm < 3:
        return None, None
    cols = [0] + ([1, 2, 3] if n_abg else []) + ([4, 5] if n_shm >= 2 else [])
    x = np.zeros(6)
    keep = [i for i, r in enumerate(rows) if any(r[c] for c in cols[1:])]
    x[cols] = _nonnegative_lstsq([[rows[i][c] for c in cols] for i in keep], [1.0] * len(keep))
    abg = tuple(float(v) for v in x[1:4]) if n_abg >= 3 and x[1:4].any() else None
    shm = tuple(float(v) for v in x[4:6]) if n_shm >= 2 and x[4:6].any() else None
    return abg, shm


def fit_machine(entry: dict) -> tuple[float, float, float] | None:
    """(alpha, beta, gamma) of the cost model fitted to an entry's measured times of the
    modelled algorithms (:func:`fit_models`)."""
    return fit_models(entry)[0]


def ranked(best: str, times: dict) -> tuple:
    """`best` first, then the other algorithms of `times` (name -> seconds) fastest first."""
    return (best,) + tuple(sorted((a for a in times if a != best), key=times.get))


@dataclass
class Choice:
    """auto's decision for one message: the algorithm and why."""

    algorithm: str
    source: str                 # "table", "table-extrapolated", "model-fitted", "model"
    detail: str
    # every usable algorithm, the chosen one first, then by the time the table or the model
    # gives it at this size (what learning in use tries: aluminum_py.learning)
    ranked: tuple = field(default=(), repr=False)

    def __str__(self) -> str:
        return f"{self.algorithm} ({self.source}: {self.detail})"


class Chooser:
    """``algorithm="auto"`` for one communicator and one kind of buffer: chooses from the data
    rank 0 found (:func:`shared_data`), so every rank chooses alike."""

    def __init__(self, comm_size: int, entries: dict, fitted: dict, default_params, usable,
                 ranks_per_node=None, others=(), shm_params=None, shm_limits=None):
        self.comm_size = comm_size
        self.entries = entries          # dtype_size -> entry (exact configuration)
        self.fitted = fitted            # dtype_size -> (abg, shm (sync, byte) or None, key)
        self.default_params = default_params
        self.usable = tuple(usable)     # algorithms auto may pick
        # this communicator's topology, and those of the table's entries (same buffer and
        # MPI) that it does not use because they were measured on another (for explain)
        self.topology = (describe_topology(comm_size, ranks_per_node) if ranks_per_node
                         else f"{comm_size} ranks")
        self.others = tuple(others)
        # the "shm" formula: (sync, byte) by default (rank 0's AL_SHM_SYNC, AL_SHM_BYTE) and the
        # segment's (small, slot, chunk, chunk_upto); shm is modelled only when the communicator
        # has a segment
        self.shm_params = tuple(shm_params) if shm_params is not None else None
        self.shm_limits = (tuple(shm_limits) if shm_limits is not None and "shm" in self.usable
                           else None)

    @classmethod
    def from_data(cls, data: "TuningData", usable, fitted: bool = True,
                  shm_limits=None) -> "Chooser":
        """A Chooser from :func:`shared_data`'s answer (`fitted` False: measured entries only;
        `shm_limits`: the communicator's segment's (small, slot[, chunk, chunk_upto]), None
        without one)."""
        return cls(sum(data.ranks_per_node), data.exact, data.fitted if fitted else {},
                   data.params, usable, data.ranks_per_node, data.others, data.shm_params,
                   shm_limits)

    def choose(self, nbytes: int, dtype_size: int) -> str:
        """The algorithm for a message of `nbytes` bytes of `dtype_size`-byte elements."""
        return self.explain(nbytes, dtype_size).algorithm

    def _shm_cost(self, params) -> ShmCost | None:
        if self.shm_limits is None or params is None:
            return None
        return ShmCost(params[0], params[1], *self.shm_limits)

    def _modelled(self, nbytes: int, params, shm: ShmCost | None, source: str,
                  why: str) -> Choice:
        """The cost model's choice, `why` it has these parameters, and what it predicts."""
        times = model_times(self.comm_size, nbytes, params, shm)
        best = min(times, key=times.get)
        runner = min((a for a in times if a != best), key=times.get, default=None)
        a, b, g = params
        detail = f"{why}cost model with alpha={a:.3g} s, beta={b:.3g} s/B, gamma={g:.3g} s/B"
        if shm is not None:
            rounds = (f", rounds of {shm.chunk} B under {shm.chunk_upto} B"
                      if 0 < shm.chunk < shm.slot else "")
            detail += (f", shm sync={shm.sync:.3g} s, byte={shm.byte:.3g} s/B (one node, "
                       f"segment: symmetric up to {shm.small} B, slots of {shm.slot} B{rounds})")
        elif self.shm_limits is not None:
            detail += ", shm not modelled (the entry has no shm times: tune again)"
        if runner is not None and self.comm_size > 1:
            detail += (f": {best} {times[best] * 1e6:.1f} us, next {runner} "
                       f"{times[runner] * 1e6:.1f} us")
        return Choice(best, source, detail, ranked(best, times))

    def explain(self, nbytes: int, dtype_size: int) -> Choice:
        """The choice for a message of `nbytes` bytes of `dtype_size`-byte elements, and why."""
        entry = self.entries.get(dtype_size)
        if entry is not None:
            return self._from_table(entry, nbytes)
        fitted = self.fitted.get(dtype_size)
        if fitted is None and self.fitted:
            # machine parameters are per byte: a fit for another element size carries over
            fitted = self.fitted[min(self.fitted, key=lambda ds: abs(ds - dtype_size))]
        if fitted is not None:
            params, shm, key = fitted
            return self._modelled(nbytes, params, self._shm_cost(shm), "model-fitted",
                                  f"fitted to the table entry {key!r}: ")
        why = ("no usable tuning entry" if self.entries else "no tuning entry")
        other = ""
        if self.others:
            other = (f" (the table's entries for {'; '.join(self.others)} are not used: "
                     f"measured on another topology)")
        return self._modelled(nbytes, self.default_params, self._shm_cost(self.shm_params),
                              "model", f"{why} for {self.topology} and {dtype_size}-byte "
                              f"elements{other}; ")

    def _from_table(self, entry: dict, nbytes: int) -> Choice:
        choice = self._measured(entry, nbytes)
        if self.shm_limits is not None and "shm" not in entry["times"]:
            choice.detail += " (the entry has no shm times: tune again to let auto choose shm)"
        return choice

    @staticmethod
    def _decided(entry: dict, i: int, algs: list) -> tuple[str, str]:
        """The choice at measured size `i`: the crossover's decision where the entry records
        one that is usable here, else the lowest median; and the words saying so (the margin
        to the runner-up, whether the two were within noise)."""
        times = entry["times"]
        best = min(algs, key=lambda a: times[a][i])
        choice = entry.get("choice")
        if choice is not None and choice[i] in algs:
            best = choice[i]
        runner = min((a for a in algs if a != best), key=lambda a: times[a][i], default=None)
        if runner is None:
            return best, ""
        how = f"; next {runner} {times[runner][i] / times[best][i]:.2f}x"
        decided = entry.get("decided")
        if decided is not None and decided[i] == "worst case":
            how += ", within noise: chosen for its better 90th percentile"
        return best, how

    def _measured(self, entry: dict, nbytes: int) -> Choice:
        sizes = entry["sizes"]
        algs = [a for a in entry["times"] if a in self.usable]
        if not algs:
            return self._modelled(nbytes, self.default_params, self._shm_cost(self.shm_params),
                                  "model", "the table entry has no usable algorithm; ")
        at = lambda i: {a: entry["times"][a][i] for a in algs}     # noqa: E731
        if nbytes <= sizes[0]:
            best, how = self._decided(entry, 0, algs)
            return Choice(best, "table", f"fastest at {sizes[0]} B, the smallest size "
                          f"measured{how}", ranked(best, at(0)))
        if nbytes > sizes[-1]:
            # anchored at the largest measured size, growing with each algorithm's fitted beta
            fit = entry["fit"]
            est = {a: entry["times"][a][-1] + fit[a]["beta"] * (nbytes - sizes[-1]) for a in algs}
            best = min(est, key=est.get)
            return Choice(best, "table-extrapolated", f"measured time at {sizes[-1]} B plus the "
                          f"fitted beta predicts {est[best] * 1e6:.1f} us at {nbytes} B",
                          ranked(best, est))
        j = int(np.searchsorted(sizes, nbytes))
        if sizes[j] == nbytes:
            best, how = self._decided(entry, j, algs)
            return Choice(best, "table", f"measured fastest at {nbytes} B "
                          f"({entry['times'][best][j] * 1e6:.1f} us{how})", ranked(best, at(j)))
        lo, hi = sizes[j - 1], sizes[j]
        f = (math.log(nbytes) - math.log(lo)) / (math.log(hi) - math.log(lo))
        est = {a: math.exp((1 - f) * math.log(entry["times"][a][j - 1]) +
                           f * math.log(entry["times"][a][j])) for a in algs}
        best = min(est, key=est.get)
        return Choice(best, "table", f"interpolated between {lo} B and {hi} B: "
                      f"{est[best] * 1e6:.1f} us", ranked(best, est))


@dataclass
class TuningData:
    """What rank 0 read from the tuning table for one communicator (:func:`shared_data`)."""

    exact: dict             # dtype_size -> entry measured on this very topology
    fitted: dict            # dtype_size -> ((alpha, beta, gamma), key of the entry fitted)
    params: tuple           # the cost model's default (alpha, beta, gamma)
    ranks_per_node: tuple   # this communicator's topology
    others: tuple           # topologies of the entries not used (explain's message)
    shm_params: tuple | None = None     # the "shm" formula's default (sync, byte)
    learn_rounds: int = 0   # AL_AUTO_LEARN (aluminum_py.learning), rank 0's
    recheck_calls: int = 0  # AL_AUTO_RECHECK (aluminum_py.learning), rank 0's


def shared_data(mpi_comm, buffer: str, layout) -> TuningData:
    """The tuning data for `buffer` ("host"/"cuda") on the communicator `mpi_comm`, whose
    node layout is `layout` (per rank its node, canonical: the Communicator's
    ``topology.Topology.layout``): rank 0 reads the tuning table and broadcasts what applies, so
    every rank chooses alike (collective; an error on rank 0 is raised on every rank, or the
    others would wait forever)."""
    rpn = topology.ranks_per_node(layout)
    data = None
    if mpi_comm.Get_rank() == 0:
        try:
            exact, fitted, others = find_data(load(), rpn, buffer, mpi_version())
            data = TuningData(exact, fitted, config.model_params(), rpn, others,
                              config.shm_model_params(), config.auto_learn(),
                              config.auto_recheck())
        except Exception as e:
            data = e
    data = mpi_comm.bcast(data, root=0)
    if isinstance(data, Exception):
        raise data
    return data


def same_shape(a, b) -> bool:
    """Whether a cost model fitted on topology `a` may serve topology `b` (other rank count):
    both one node (shared memory only), or both several nodes with the same number of ranks on
    every node (``4 x 1`` and ``8 x 1``; not ``2 x 2``: ranks that share a node move part of
    the data in memory, which the flat model cannot tell from the network)."""
    if len(a) == 1 or len(b) == 1:
        return len(a) == len(b) == 1
    return len(set(a) | set(b)) == 1


def find_data(table: dict, ranks_per_node, buffer: str, mpi: str):
    """What rank 0 broadcasts for a communicator of topology `ranks_per_node` (ranks of each
    node, in node order): the entries measured on that very topology, by dtype size; for the
    other dtype sizes, cost model parameters fitted to the nearest rank count's entry of the
    same shape (:func:`same_shape`); and the descriptions of the entries measured on other
    topologies (not used; explain names them)."""
    rpn = tuple(ranks_per_node)
    comm_size = sum(rpn)
    exact, fitted = {}, {}
    limits = shm_limits(comm_size) if len(rpn) == 1 else None      # "shm": one node only
    candidates = [e for e in table.get("entries", {}).values()
                  if e.get("buffer") == buffer and e.get("mpi") == mpi]
    usable = [e for e in candidates if e.get("ranks_per_node") is not None]
    for e in usable:
        if tuple(e["ranks_per_node"]) == rpn:
            exact[e["dtype_size"]] = e
    for e in sorted((e for e in usable if same_shape(tuple(e["ranks_per_node"]), rpn)),
                    key=lambda e: (abs(math.log(e["comm_size"] / comm_size)), entry_key(e))):
        ds = e["dtype_size"]
        if ds in exact or ds in fitted:
            continue
        params, shm = fit_models(e, limits)
        if params is not None:
            fitted[ds] = (params, shm, entry_key(e))
    fitted_from = {key for _, _, key in fitted.values()}
    others = sorted({entry_topology_name(e) for e in candidates
                     if e.get("ranks_per_node") is None or tuple(e["ranks_per_node"]) != rpn
                     if entry_key(e) not in fitted_from})
    return exact, fitted, tuple(others)
