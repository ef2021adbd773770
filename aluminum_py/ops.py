"""Reduction ops, dtypes and the capability table that drives checks, dispatch and tests.

Codes match ``ext/al_reduce.h``.
"""
from __future__ import annotations

import numpy as np


class Op:
    """A reduction operation (``al.SUM`` ...). ``AVG`` is SUM followed by division by the size."""

    __slots__ = ("name", "code")

    def __init__(self, name: str, code: int):
        self.name = name
        self.code = code

    def __repr__(self) -> str:
        return f"aluminum_py.{self.name}"

    def __reduce__(self):
        return self.name


SUM, PROD, MIN, MAX = Op("SUM", 0), Op("PROD", 1), Op("MIN", 2), Op("MAX", 3)
LAND, LOR, LXOR = Op("LAND", 4), Op("LOR", 5), Op("LXOR", 6)
BAND, BOR, BXOR = Op("BAND", 7), Op("BOR", 8), Op("BXOR", 9)
AVG = Op("AVG", 10)
OPS = (SUM, PROD, MIN, MAX, LAND, LOR, LXOR, BAND, BOR, BXOR, AVG)
_BY_NAME = {o.name: o for o in OPS}

# dtype name -> (code, kind)
DTYPES = {
    "int8": (0, "int"), "int16": (1, "int"), "int32": (2, "int"), "int64": (3, "int"),
    "uint8": (4, "int"), "uint16": (5, "int"), "uint32": (6, "int"), "uint64": (7, "int"),
    "float16": (8, "float"), "bfloat16": (9, "float"), "float32": (10, "float"),
    "float64": (11, "float"), "complex64": (12, "complex"), "complex128": (13, "complex"),
}
BFLOAT16 = 9

# the capability table: which ops each kind of dtype supports (as MPI defines them, plus AVG)
OPS_FOR_KIND = {
    "int": (SUM, PROD, MIN, MAX, LAND, LOR, LXOR, BAND, BOR, BXOR),
    "float": (SUM, PROD, MIN, MAX, AVG),
    "complex": (SUM, PROD),
}
_VALID = {(code, o.code) for code, kind in DTYPES.values() for o in OPS_FOR_KIND[kind]}


def _dtype_table() -> dict:
    table = {}
    for name, (code, kind) in DTYPES.items():
        try:
            dt = np.dtype(name)
        except TypeError:
            try:
                import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
                dt = np.dtype(name)
            except (ImportError, TypeError):
                continue
        table[dt] = (code, kind)
    return table


DTYPE_CODES = _dtype_table()   # np.dtype -> (code, kind)


def supported_dtypes() -> list[str]:
    """Names of the dtypes this installation supports (bfloat16 needs ml_dtypes)."""
    return [str(dt) for dt in DTYPE_CODES]


def as_op(op) -> Op:
    """Accept al.SUM, its name ("sum"), or an mpi4py op (MPI.SUM)."""
    if isinstance(op, Op):
        return op
    if isinstance(op, str) and op.upper() in _BY_NAME:
        return _BY_NAME[op.upper()]
    try:
        from mpi4py import MPI
        for o in OPS[:-1]:
            if op == getattr(MPI, o.name):
                return o
    except Exception:   # pragma: no cover - not an MPI op
        pass
    raise TypeError(f"op: expected one of aluminum_py.SUM, PROD, MIN, MAX, LAND, LOR, LXOR, BAND, "
                    f"BOR, BXOR, AVG, got {op!r}")


def check_op(op: Op, dtype_code: int, dtype) -> None:
    if (dtype_code, op.code) not in _VALID:
        kind = next(k for c, k in DTYPE_CODES.values() if c == dtype_code)
        allowed = ", ".join(o.name for o in OPS_FOR_KIND[kind])
        raise TypeError(f"op: {op.name} is not defined for dtype {dtype} (allowed: {allowed})")
