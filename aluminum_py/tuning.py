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
from dataclasses import dataclass

import numpy as np

from . import config
from .algorithms import MODELLED, model_choice, model_time

FORMAT = "aluminum_py.tuning"
VERSION = 1
log = logging.getLogger("aluminum_py")


class TuningWarning(UserWarning):
    """The tuning file could not be used (missing pieces, corrupt, other version)."""


def default_path() -> str:
    """AL_TUNING_FILE if set, else a per-user cache file."""
    path = os.environ.get("AL_TUNING_FILE")
    if path:
        return path
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "aluminum_py", "tuning.json")


def make_key(comm_size: int, local_size: int, buffer: str, dtype_size: int, mpi: str) -> str:
    return f"{comm_size}/{local_size}/{buffer}/{dtype_size}/{mpi}"


def mpi_version() -> str:
    """The MPI library's name and version, whitespace normalised ("MPICH Version: 5.0.2")."""
    from mpi4py import MPI
    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def empty_table() -> dict:
    return {"format": FORMAT, "version": VERSION, "entries": {}}


def load(path: str | None = None, *, warn: bool = True) -> dict:
    """Read a tuning file. A missing file is an empty table; a corrupt file or another version
    gives a TuningWarning and an empty table (never an exception)."""
    path = path or default_path()
    if not os.path.exists(path):
        return empty_table()
    try:
        with open(path) as f:
            table = json.load(f)
        if not isinstance(table, dict) or table.get("format") != FORMAT:
            raise ValueError("not an aluminum_py tuning file")
        if table.get("version") != VERSION:
            raise ValueError(f"version {table.get('version')!r}, this library reads version {VERSION}")
        entries = table.get("entries")
        if not isinstance(entries, dict):
            raise ValueError("no 'entries' object")
        good = {}
        for key, entry in entries.items():
            try:
                good[key] = validate_entry(entry)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                if warn:
                    warnings.warn(f"tuning file {path}: entry {key!r} ignored ({e})", TuningWarning,
                                  stacklevel=2)
        table["entries"] = good
        return table
    except (OSError, ValueError) as e:
        if warn:
            warnings.warn(f"tuning file {path} ignored, auto uses the cost model ({e})",
                          TuningWarning, stacklevel=2)
        return empty_table()


def validate_entry(entry: dict) -> dict:
    """Check an entry read from a file; the fit and the ranges are recomputed from the times
    (the stored ones are for people reading the file)."""
    sizes = [int(s) for s in entry["sizes"]]
    if not sizes or sizes != sorted(set(sizes)) or sizes[0] <= 0:
        raise ValueError("sizes must be positive and increasing")
    times = {str(a): [float(t) for t in ts] for a, ts in dict(entry["times"]).items()}
    if not times or any(len(ts) != len(sizes) for ts in times.values()):
        raise ValueError("times do not match sizes")
    if any(not (0 < t < math.inf) for ts in times.values() for t in ts):
        raise ValueError("times must be positive and finite")
    for k in ("comm_size", "local_size", "dtype_size"):
        entry[k] = int(entry[k])
        if entry[k] < 1:
            raise ValueError(f"{k} must be positive")
    for k in ("buffer", "mpi"):
        entry[k] = str(entry[k])
    entry["sizes"], entry["times"] = sizes, times
    entry["fit"] = fit_all(sizes, times)
    entry["ranges"] = win_ranges(sizes, times)
    return entry


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
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return save(merge(load(path), entry), path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def merge(table: dict, entry: dict) -> dict:
    """Add or replace `entry` (keyed by its configuration); other entries are kept."""
    key = make_key(entry["comm_size"], entry["local_size"], entry["buffer"], entry["dtype_size"],
                   entry["mpi"])
    table.setdefault("entries", {})[key] = entry
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


def win_ranges(sizes, times: dict) -> list[dict]:
    """Consecutive measured sizes where the same algorithm is fastest."""
    algs = list(times)
    ranges: list[dict] = []
    for i, n in enumerate(sizes):
        best = min(algs, key=lambda a: times[a][i])
        if ranges and ranges[-1]["algorithm"] == best:
            ranges[-1]["max_bytes"] = n
        else:
            ranges.append({"algorithm": best, "min_bytes": n, "max_bytes": n})
    return ranges


def make_entry(comm_size, local_size, buffer, dtype_size, mpi, sizes, times) -> dict:
    return {"comm_size": comm_size, "local_size": local_size, "buffer": buffer,
            "dtype_size": dtype_size, "mpi": mpi,
            "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "sizes": list(sizes), "times": {a: list(map(float, t)) for a, t in times.items()},
            "ranges": win_ranges(sizes, times), "fit": fit_all(sizes, times)}


def fit_machine(entry: dict) -> tuple[float, float, float] | None:
    """(alpha, beta, gamma) of the cost model fitted to an entry's measured times of the
    modelled algorithms (least squares on relative error; the model is linear in them)."""
    p = entry["comm_size"]
    rows, rhs = [], []
    for alg in MODELLED:
        for n, t in zip(entry["sizes"], entry["times"].get(alg, [])):
            coeffs = [model_time(alg, p, n, unit) for unit in ((1, 0, 0), (0, 1, 0), (0, 0, 1))]
            rows.append([c / t for c in coeffs])
            rhs.append(1.0)
    if len(rows) < 3 or p < 2:
        return None
    sol, *_ = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)
    a, b, g = (float(max(x, 0.0)) for x in sol)
    if a == b == g == 0.0:
        return None
    return a, b, g


@dataclass
class Choice:
    """auto's decision for one message: the algorithm and why."""

    algorithm: str
    source: str                 # "table", "table-extrapolated", "model-fitted", "model"
    detail: str

    def __str__(self) -> str:
        return f"{self.algorithm} ({self.source}: {self.detail})"


class Chooser:
    """``algorithm="auto"`` for one communicator and one kind of buffer: chooses from the data
    rank 0 found (:func:`shared_data`), so every rank chooses alike."""

    def __init__(self, comm_size: int, entries: dict, fitted: dict, default_params, usable):
        self.comm_size = comm_size
        self.entries = entries          # dtype_size -> entry (exact configuration)
        self.fitted = fitted            # dtype_size -> ((alpha, beta, gamma), source key)
        self.default_params = default_params
        self.usable = tuple(usable)     # algorithms auto may pick

    def choose(self, nbytes: int, dtype_size: int) -> str:
        """The algorithm for a message of `nbytes` bytes of `dtype_size`-byte elements."""
        return self.explain(nbytes, dtype_size).algorithm

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
            params, key = fitted
            alg = model_choice(self.comm_size, nbytes, params)
            return Choice(alg, "model-fitted", f"cost model with alpha={params[0]:.3g} s, "
                          f"beta={params[1]:.3g} s/B, gamma={params[2]:.3g} s/B fitted to "
                          f"the table entry {key!r}")
        alg = model_choice(self.comm_size, nbytes, self.default_params)
        a, b, g = self.default_params
        why = ("no usable tuning entry" if self.entries else "no tuning entry")
        return Choice(alg, "model", f"{why} for {self.comm_size} ranks and {dtype_size}-byte "
                      f"elements; cost model with alpha={a:.3g} s, beta={b:.3g} s/B, gamma={g:.3g} s/B")

    def _from_table(self, entry: dict, nbytes: int) -> Choice:
        sizes = entry["sizes"]
        algs = [a for a in entry["times"] if a in self.usable]
        if not algs:
            alg = model_choice(self.comm_size, nbytes, self.default_params)
            return Choice(alg, "model", "the table entry has no usable algorithm")
        if nbytes <= sizes[0]:
            i = 0
            best = min(algs, key=lambda a: entry["times"][a][i])
            return Choice(best, "table", f"fastest at {sizes[0]} B, the smallest size measured")
        if nbytes > sizes[-1]:
            # anchored at the largest measured size, growing with each algorithm's fitted beta
            fit = entry["fit"]
            est = {a: entry["times"][a][-1] + fit[a]["beta"] * (nbytes - sizes[-1]) for a in algs}
            best = min(est, key=est.get)
            return Choice(best, "table-extrapolated", f"measured time at {sizes[-1]} B plus the "
                          f"fitted beta predicts {est[best] * 1e6:.1f} us at {nbytes} B")
        j = int(np.searchsorted(sizes, nbytes))
        if sizes[j] == nbytes:
            best = min(algs, key=lambda a: entry["times"][a][j])
            return Choice(best, "table", f"measured fastest at {nbytes} B "
                          f"({entry['times'][best][j] * 1e6:.1f} us)")
        lo, hi = sizes[j - 1], sizes[j]
        f = (math.log(nbytes) - math.log(lo)) / (math.log(hi) - math.log(lo))
        est = {a: math.exp((1 - f) * math.log(entry["times"][a][j - 1]) +
                           f * math.log(entry["times"][a][j])) for a in algs}
        best = min(est, key=est.get)
        return Choice(best, "table", f"interpolated between {lo} B and {hi} B: "
                      f"{est[best] * 1e6:.1f} us")


def shared_data(mpi_comm, size: int, local_size: int, buffer: str):
    """(exact entries, fitted parameters, model parameters) for `buffer` ("host"/"cuda"): rank
    0 of `mpi_comm` reads the tuning table and broadcasts it, so every rank chooses alike
    (collective; an error on rank 0 is raised on every rank, or the others would wait forever)."""
    data = None
    if mpi_comm.Get_rank() == 0:
        try:
            exact, fitted = find_data(load(), size, local_size, buffer, mpi_version())
            data = (exact, fitted, config.model_params())
        except Exception as e:
            data = e
    data = mpi_comm.bcast(data, root=0)
    if isinstance(data, Exception):
        raise data
    return data


def find_data(table: dict, comm_size: int, local_size: int, buffer: str, mpi: str):
    """What rank 0 broadcasts: exact entries by dtype size, and fitted machine parameters from
    the nearest rank count's entry for the other dtype sizes."""
    exact, fitted = {}, {}
    candidates = [e for e in table.get("entries", {}).values()
                  if e.get("buffer") == buffer and e.get("mpi") == mpi]
    for e in candidates:
        if e["comm_size"] == comm_size and e["local_size"] == local_size:
            exact[e["dtype_size"]] = e
    for e in sorted(candidates, key=lambda e: (abs(math.log(e["comm_size"] / comm_size)),
                                                e["local_size"] != local_size)):
        ds = e["dtype_size"]
        if ds in exact or ds in fitted:
            continue
        params = fit_machine(e)
        if params is not None:
            fitted[ds] = (params, make_key(e["comm_size"], e["local_size"], buffer, ds, mpi))
    return exact, fitted
