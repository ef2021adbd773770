"""``algorithm="auto"``: the rule (:class:`Chooser`) and the tuning table it may read.

The rule: the cost model of :mod:`aluminum_py.algorithms` chooses (on one node with a segment,
the shm formula against the alpha-beta model; across nodes, the alpha-beta model); a tuning
entry measured on this very topology, element size, buffer kind and MPI library overrides it
only over a range of at least :data:`MIN_RUN` neighbouring measured sizes where one algorithm
beat the model's choice, in each of at least :data:`MIN_PASSES` interleaved passes, by more
than the spread between those passes (:func:`verdicts`).  Nothing is learned in use: the same
inputs give the same choice.  The file format is in docs/tuning.md.
"""
from __future__ import annotations

import bisect
import datetime
import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from . import config, topology
from .algorithms import ShmCost, model_times
from .files import open_private, read_regular

FORMAT = "aluminum_py.tuning"
VERSION = 2
MIN_PASSES = 3              # passes of the sweep an override needs
MIN_RUN = 2                 # neighbouring measured sizes an override spans at least
MAX_FILE_BYTES = 16 << 20   # a tuning file larger than this is not read
MAX_ENTRIES = 4096          # entries of a table, ...
MAX_SIZES = 1024            # ... sizes measured per entry, ...
MAX_PASSES = 64             # ... and passes
MAX_BYTES = 2 ** 62         # a size (bytes per message)
MAX_RANKS = 2 ** 31 - 1


class TuningWarning(UserWarning):
    """The tuning file could not be used (missing pieces, corrupt, other version)."""


def default_path() -> str:
    """AL_TUNING_FILE if set, else a per-user cache file."""
    return config.tuning_file() or os.path.join(config.cache_home(), "aluminum_py", "tuning.json")


def describe_topology(comm_size: int, ranks_per_node) -> str:
    """``"4 ranks as 2 nodes x 2"``, ``"3 ranks as 2 nodes (2+1)"``."""
    rpn = tuple(ranks_per_node)
    nodes = f"{len(rpn)} node{'s' if len(rpn) != 1 else ''}"
    if len(set(rpn)) == 1:
        return f"{comm_size} ranks as {nodes} x {rpn[0]}"
    return f"{comm_size} ranks as {nodes} ({'+'.join(map(str, rpn))})"


def make_key(comm_size: int, ranks_per_node, buffer: str, dtype_size: int, mpi: str) -> str:
    """The entry's place in the table: one per (rank count, ranks of every node, buffer,
    element size, MPI library)."""
    rpn = list(ranks_per_node)
    topo = f"{len(rpn)}x{rpn[0]}" if len(set(rpn)) == 1 else "+".join(map(str, rpn))
    return f"{comm_size}/{topo}/{buffer}/{dtype_size}/{mpi}"


def entry_key(entry: dict) -> str:
    return make_key(entry["comm_size"], entry["ranks_per_node"], entry["buffer"],
                    entry["dtype_size"], entry["mpi"])


def mpi_version() -> str:
    """The MPI library's name and version, whitespace normalised ("MPICH Version: 5.0.2")."""
    from mpi4py import MPI
    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def empty_table() -> dict:
    return {"format": FORMAT, "version": VERSION, "entries": {}}


# ---- the file

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
        if table.get("version") != VERSION:
            raise ValueError(f"version {table.get('version')!r}, this library reads version "
                             f"{VERSION}: run bench crossover --tune again")
        entries = table.get("entries")
        if not isinstance(entries, dict):
            raise ValueError("no 'entries' object")
        if len(entries) > MAX_ENTRIES:
            raise ValueError(f"{len(entries)} entries, more than the {MAX_ENTRIES} accepted")
        good, bad = {}, []
        for key, entry in entries.items():
            try:
                entry = validate_entry(entry)
                good[entry_key(entry)] = entry
            except (KeyError, TypeError, ValueError) as e:
                bad.append(f"{key!r} ({e})")
        if bad and warn:
            warnings.warn(f"tuning file {path}: entr{'ies' if len(bad) > 1 else 'y'} "
                          f"{'; '.join(bad)} ignored", TuningWarning, stacklevel=2)
        table["entries"] = good
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


def _times(times, n: int, algs=None) -> dict:
    """An algorithm -> seconds per size object, checked (`algs`: the names it must have)."""
    if type(times) is not dict or not times or (algs is not None and set(times) != set(algs)):
        raise ValueError("times must be an object: per algorithm, a time per size"
                         + ("" if algs is None else ", the same algorithms in every pass"))
    for ts in times.values():
        if type(ts) is not list or len(ts) != n:
            raise ValueError("times do not match sizes")
        if any(type(t) not in (int, float) or not 0 < t < math.inf for t in ts):
            raise ValueError("times must be positive and finite")
    return {a: [float(t) for t in ts] for a, ts in times.items()}


def validate_entry(entry: dict) -> dict:
    """Check every field of an entry read from a file (type and range: nothing that chooses
    from it can fail on its content).  Raises KeyError, TypeError or ValueError."""
    if type(entry) is not dict:
        raise TypeError("an entry must be an object")
    sizes = _ints(entry["sizes"], "sizes", 1, MAX_BYTES, MAX_SIZES)
    if not sizes or sizes != sorted(set(sizes)):
        raise ValueError("sizes must be positive and increasing")
    times = _times(entry["times"], len(sizes))
    passes = entry.get("passes", [times])
    if type(passes) is not list or not 0 < len(passes) <= MAX_PASSES:
        raise ValueError(f"passes must be a list of 1 to {MAX_PASSES} objects")
    passes = [_times(p, len(sizes), times) for p in passes]
    for k in ("comm_size", "local_size"):
        _int(entry, k, 1, MAX_RANKS)
    _int(entry, "dtype_size", 1, 64)
    for k in ("buffer", "mpi"):
        if type(entry[k]) is not str:
            raise ValueError(f"{k} must be a string")
    rpn = _ints(entry["ranks_per_node"], "ranks_per_node", 1, MAX_RANKS, entry["comm_size"])
    if not rpn or sum(rpn) != entry["comm_size"]:
        raise ValueError(f"ranks_per_node {rpn} do not add up to comm_size {entry['comm_size']}")
    if entry["local_size"] != rpn[0]:
        raise ValueError(f"local_size {entry['local_size']} is not rank 0's node's {rpn[0]} ranks")
    return dict(entry, sizes=sizes, times=times, passes=passes, nodes=len(rpn))


def make_entry(comm_size, ranks_per_node, buffer, dtype_size, mpi, sizes, passes) -> dict:
    """A table entry; `ranks_per_node`: the ranks of each node in node order
    (``topology.ranks_per_node``), rank 0's first; `passes`: per pass of the sweep, per
    algorithm, its time (s) at each of `sizes` (one pass: a dict alone).  ``times`` is the
    median over the passes, ``topology`` and ``overrides`` are for people reading the file
    (:class:`Chooser` works them out again from the passes)."""
    passes = [passes] if isinstance(passes, dict) else list(passes)
    rpn = [int(n) for n in ranks_per_node]
    if sum(rpn) != comm_size or not rpn or min(rpn) < 1:
        raise ValueError(f"ranks_per_node {rpn}: not a topology of {comm_size} ranks")
    passes = [{a: [float(t) for t in ts] for a, ts in p.items()} for p in passes]
    times = {a: [float(np.median([p[a][i] for p in passes])) for i in range(len(sizes))]
             for a in passes[0]}
    return {"comm_size": comm_size, "nodes": len(rpn), "ranks_per_node": rpn,
            "local_size": rpn[0], "topology": describe_topology(comm_size, rpn),
            "buffer": buffer, "dtype_size": dtype_size, "mpi": mpi,
            "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "sizes": list(sizes), "times": times, **({"passes": passes} if len(passes) > 1 else {})}


def _temp_path(path: str) -> str:
    """The one temporary file of the table at `path`: written, then renamed over the table."""
    return path + ".tmp"


def save(table: dict, path: str | None = None) -> str:
    """Write atomically (a temporary file renamed over the table, readable as the umask
    allows); returns the path.  The temporary file has one name per table, so one left by a
    writer killed before the rename is overwritten by the next save, and an error in between
    removes it.  Writers of one table take its lock first (:func:`merge_into_file`)."""
    path = os.path.abspath(path or default_path())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = _temp_path(path)
    try:
        os.unlink(tmp)                      # a killed writer's, or a planted link: not followed
    except FileNotFoundError:
        pass
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def merge(table: dict, entry: dict) -> dict:
    """Add or replace `entry` (keyed by its configuration); other entries are kept."""
    table.setdefault("entries", {})[entry_key(entry)] = entry
    table["format"], table["version"] = FORMAT, VERSION
    return table


def merge_into_file(entry: dict, path: str | None = None) -> str:
    """Read, merge `entry`, write, holding an exclusive lock (so concurrent --tune runs on a
    shared file do not lose each other's entries). Returns the path."""
    import fcntl
    path = os.path.abspath(path or default_path())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with os.fdopen(open_private(path + ".lock", truncate=False), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return save(merge(load(path), entry), path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# ---- where a table overrides the model

def passes_of(entry: dict) -> list:
    """Per pass of the sweep, per algorithm, its times: a one-pass entry has its times only."""
    return entry.get("passes") or [entry["times"]]


class Verdict(NamedTuple):
    """The best measured alternative to the model's choice at one size."""

    algorithm: str      # the alternative
    model: str          # the model's choice
    margin: float       # the least, over the passes, of the model's time over the alternative's
    spread: float       # the larger spread between passes of the two's times (max/min - 1)

    @property
    def beyond_noise(self) -> bool:
        return self.margin - 1 > self.spread


class Override(NamedTuple):
    """A range of neighbouring measured sizes where one algorithm beat the model's choice
    beyond noise at every size: the table may run it there."""

    algorithm: str
    model: str          # the model's choice at the range's first size
    min_bytes: int
    max_bytes: int
    margin: float       # the least margin over the range's sizes
    spread: float       # the largest spread over them
    margins: tuple = ()     # the margin at each measured size of the range


def verdicts(sizes, passes: list, model: list, usable) -> list:
    """Per measured size, every alternative to `model` (the model's choice per size) among the
    `usable` algorithms timed in each of `passes`, as Verdicts, the best first (beyond noise,
    then the largest margin); an empty list where nothing compares (fewer than MIN_PASSES
    passes, the model's choice not timed)."""
    out = []
    for i in range(len(sizes)):
        m, vs = model[i], []
        if len(passes) >= MIN_PASSES and m in passes[0]:
            tm = [p[m][i] for p in passes]
            for a in passes[0]:
                if a != m and a in usable:
                    ta = [p[a][i] for p in passes]
                    vs.append(Verdict(a, m, min(x / y for x, y in zip(tm, ta)),
                                      max(max(tm) / min(tm), max(ta) / min(ta)) - 1))
        out.append(sorted(vs, key=lambda v: (v.beyond_noise, v.margin), reverse=True))
    return out


def overrides(sizes, found: list) -> list:
    """Every range where one alternative is beyond noise (:func:`verdicts`) at MIN_RUN or
    more neighbouring sizes (a single size is an island, not a range), by algorithm, then
    size.  Ranges of several algorithms may overlap: :meth:`Chooser.explain` takes, at each
    size, the one of the largest margin there."""
    out = []
    for a in sorted({v.algorithm for vs in found for v in vs}):
        at = [next((v for v in vs if v.algorithm == a and v.beyond_noise), None) for vs in found]
        i = 0
        while i < len(at):
            j = i
            while j < len(at) and at[j] is not None:
                j += 1
            if j - i >= MIN_RUN:
                vs = at[i:j]
                out.append(Override(a, vs[0].model, sizes[i], sizes[j - 1],
                                    min(v.margin for v in vs), max(v.spread for v in vs),
                                    tuple(v.margin for v in vs)))
            i = j + 1
    return out


# ---- the rule

@dataclass
class Choice:
    """auto's decision for one message: the algorithm and which rule decided."""

    algorithm: str
    source: str                 # "model", "table" (an override of the model) or "forced"
    detail: str

    def __str__(self) -> str:
        return f"{self.algorithm} ({self.source}: {self.detail})"


class Model:
    """The cost model's choice for one communicator of host buffers: among the usable modelled
    algorithms, the lowest predicted time (with a segment, "shm" by its formula)."""

    def __init__(self, comm_size: int, nodes: int, usable, params, shm: ShmCost | None):
        self.p, self.nodes, self.params = comm_size, nodes, params
        self.shm = shm if "shm" in usable else None
        self.usable = tuple(usable)

    def __call__(self, nbytes: int, itemsize: int) -> Choice:
        times = {a: t for a, t in model_times(self.p, nbytes, self.params, self.shm).items()
                 if a in self.usable}
        best = min(times, key=times.get)
        if self.p <= 1:
            return Choice(best, "forced", "one rank: nothing to exchange")
        a, b, g = self.params
        where = "one node" if self.nodes == 1 else f"{self.nodes} nodes"
        detail = (f"{where}, cost model: alpha-beta (alpha={a:.3g} s, beta={b:.3g} s/B, "
                  f"gamma={g:.3g} s/B)")
        if self.shm is not None:
            detail += (f" and the shm formula (sync={self.shm.sync:.3g} s, byte="
                       f"{self.shm.byte:.3g} s/B)")
        ranked = sorted(times, key=times.get)
        detail += ": " + ", ".join(f"{x} {times[x] * 1e6:.1f} us" for x in ranked[:2])
        return Choice(best, "model", detail)


def gpu_model(nbytes: int, itemsize: int) -> Choice:
    """The rule for GPU buffers without a table: NCCL where it loads, else host transfer
    ("ht_auto": the host rule on pinned buffers)."""
    from . import nccl
    if nccl.available():
        return Choice("nccl", "model", "GPU buffers: NCCL, which loads")
    return Choice("ht_auto", "model", "GPU buffers: NCCL does not load, so host transfer")


class Chooser:
    """``algorithm="auto"`` for one communicator and one kind of buffer: `model` (nbytes,
    itemsize) -> Choice, overridden where a tuning entry of this topology (`entries`:
    dtype_size -> entry) measured so (:func:`overrides`); every rank builds it from what rank
    0 read (:func:`shared_data`), so every rank chooses alike."""

    def __init__(self, model: Callable[[int, int], Choice], entries: dict, usable,
                 topology: str = "", others=()):
        self.model = model
        self.usable = tuple(usable)
        self.topology = topology
        self.others = tuple(others)
        self.entries = entries
        self.overrides = {}             # dtype_size -> [Override]
        for ds, e in entries.items():
            model_at = [model(n, ds).algorithm for n in e["sizes"]]
            self.overrides[ds] = overrides(e["sizes"], verdicts(e["sizes"], passes_of(e),
                                                                model_at, self.usable))

    @classmethod
    def from_data(cls, data: "TuningData", usable, shm_limits=None, model=None) -> "Chooser":
        """From :func:`shared_data`'s answer: `usable` the algorithms auto may pick,
        `shm_limits` the segment's (small, slot, chunk, chunk_upto) (None: no segment), `model`
        the rule without a table (default: the host cost model)."""
        rpn = data.ranks_per_node
        if model is None:
            shm = (ShmCost(*data.shm_params, *shm_limits)
                   if shm_limits is not None and data.shm_params is not None else None)
            model = Model(sum(rpn), len(rpn), usable, data.params, shm)
        return cls(model, data.exact, usable, describe_topology(sum(rpn), rpn), data.others)

    def choose(self, nbytes: int, dtype_size: int) -> str:
        """The algorithm for a message of `nbytes` bytes of `dtype_size`-byte elements."""
        return self.explain(nbytes, dtype_size).algorithm

    def explain(self, nbytes: int, dtype_size: int) -> Choice:
        """The choice for a message of `nbytes` bytes of `dtype_size`-byte elements, and why."""
        base = self.model(nbytes, dtype_size)
        entry = self.entries.get(dtype_size)
        if base.source == "forced":
            return base
        if entry is None:
            other = (f" (the table's entries for {'; '.join(self.others)} are not used: "
                     f"measured on another topology)" if self.others else "")
            base.detail += (f"; no tuning entry for {self.topology} and {dtype_size}-byte "
                            f"elements{other}")
            return base
        covering = [o for o in self.overrides[dtype_size] if o.min_bytes <= nbytes <= o.max_bytes]
        if covering:
            # the largest margin at the measured size at or below nbytes (in every covering range)
            sizes = entry["sizes"]
            at = sizes.index(sizes[bisect.bisect_right(sizes, nbytes) - 1])
            o = max(covering, key=lambda o: o.margins[at - sizes.index(o.min_bytes)])
            return Choice(o.algorithm, "table",
                              f"the tuning entry for {self.topology}, {dtype_size}-byte "
                              f"elements, overrides the model's {o.model} from {o.min_bytes} "
                              f"to {o.max_bytes} B: at least {o.margin:.2f}x faster in each "
                              f"of {len(passes_of(entry))} passes, spread between passes "
                              f"{o.spread:.0%}; the model: {base.detail}")
        n = len(passes_of(entry))
        why = (f"{n} pass{'es' if n != 1 else ''}, {MIN_PASSES} needed to override"
               if n < MIN_PASSES else "no override at this size")
        base.detail += f"; the tuning entry for {self.topology}: {why}"
        return base


@dataclass
class TuningData:
    """What rank 0 read from the tuning table for one communicator (:func:`shared_data`)."""

    exact: dict             # dtype_size -> entry measured on this very topology
    params: tuple           # the cost model's (alpha, beta, gamma)
    ranks_per_node: tuple   # this communicator's topology
    others: tuple           # topologies of the entries not used (explain's message)
    shm_params: tuple | None = None     # the shm formula's (sync, byte)


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
            exact, others = find_data(load(), rpn, buffer, mpi_version())
            data = TuningData(exact, config.model_params(), rpn, others,
                              config.shm_model_params())
        except Exception as e:
            data = e
    data = mpi_comm.bcast(data, root=0)
    if isinstance(data, Exception):
        raise data
    return data


def find_data(table: dict, ranks_per_node, buffer: str, mpi: str):
    """What rank 0 broadcasts for a communicator of topology `ranks_per_node` (ranks of each
    node, in node order): the entries measured on that very topology, by dtype size, and the
    descriptions of the entries of this buffer and MPI measured on other topologies (not
    used; explain names them)."""
    rpn = tuple(ranks_per_node)
    exact, others = {}, set()
    for e in table.get("entries", {}).values():
        if e.get("buffer") == buffer and e.get("mpi") == mpi:
            if tuple(e["ranks_per_node"]) == rpn:
                exact[e["dtype_size"]] = e
            else:
                others.add(describe_topology(e["comm_size"], e["ranks_per_node"]))
    return exact, tuple(sorted(others))
