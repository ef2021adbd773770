"""Reduction ops, dtypes and the capability table that drives checks, dispatch and tests.

Op and dtype codes are those of ``ext/al_reduce.h``, read from the native core.
"""
from __future__ import annotations

import numpy as np

from . import _core


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


def _op(name: str) -> Op:
    return Op(name, _core.REDUCTION_OPS[name])


SUM, PROD, MIN, MAX = _op("SUM"), _op("PROD"), _op("MIN"), _op("MAX")
LAND, LOR, LXOR = _op("LAND"), _op("LOR"), _op("LXOR")
BAND, BOR, BXOR = _op("BAND"), _op("BOR"), _op("BXOR")
AVG = _op("AVG")
OPS = (SUM, PROD, MIN, MAX, LAND, LOR, LXOR, BAND, BOR, BXOR, AVG)
_BY_NAME = {o.name: o for o in OPS}

# dtype name -> kind (which ops it supports, below)
_DTYPE_KINDS = {
    "int8": "int", "int16": "int", "int32": "int", "int64": "int",
    "uint8": "int", "uint16": "int", "uint32": "int", "uint64": "int",
    "float16": "float", "bfloat16": "float", "float32": "float", "float64": "float",
    "complex64": "complex", "complex128": "complex",
}
# dtype name -> (code, kind)
DTYPES = {name: (_core.DTYPES[name], kind) for name, kind in _DTYPE_KINDS.items()}
BFLOAT16 = _core.DTYPES["bfloat16"]

# the capability table: which ops each kind of dtype supports (as MPI defines them, plus AVG)
OPS_FOR_KIND = {
    "int": (SUM, PROD, MIN, MAX, LAND, LOR, LXOR, BAND, BOR, BXOR),
    "float": (SUM, PROD, MIN, MAX, AVG),
    "complex": (SUM, PROD),
}
# (dtype code, op code) pairs the kernels accept: check_op and the native core's table
VALID_PAIRS = {(code, o.code) for code, kind in DTYPES.values() for o in OPS_FOR_KIND[kind]}


def _dtype_table() -> dict:
    """np.dtype -> (code, kind) for the dtypes numpy knows at import: its own, and bfloat16 where
    ml_dtypes is imported already. Importing ml_dtypes costs most of a second of CPU in every
    process, so it is left to the first bfloat16 buffer (:func:`known_dtype`, :func:`dtype_named`)."""
    table = {}
    for name, (code, kind) in DTYPES.items():
        try:
            table[np.dtype(name)] = (code, kind)
        except TypeError:
            pass
    return table


DTYPE_CODES = _dtype_table()   # np.dtype -> (code, kind); known_dtype adds to it


def known_dtype(dtype: np.dtype) -> bool:
    """Whether buffers of `dtype` are supported. A dtype of DTYPES that numpy learnt after this
    module's import (bfloat16: an array of it exists only once ml_dtypes is imported) is added
    to DTYPE_CODES and to the native core's table here, on first use."""
    if dtype in DTYPE_CODES:
        return True
    entry = DTYPES.get(dtype.name)
    try:
        if entry is None or np.dtype(dtype.name) != dtype:
            return False
    except TypeError:
        return False
    DTYPE_CODES[dtype] = entry
    _core.add_dtype(dtype, entry[0])
    return True


def dtype_named(name: str) -> np.dtype | None:
    """The supported dtype called `name` (a DLPack tensor's dtype), importing ml_dtypes for
    bfloat16 where numpy does not know it yet; None if unsupported or ml_dtypes is missing."""
    if name not in DTYPES:
        return None
    try:
        dt = np.dtype(name)
    except TypeError:
        try:
            import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
            dt = np.dtype(name)
        except (ImportError, TypeError):
            return None
    return dt if known_dtype(dt) else None


def supported_dtypes() -> list[str]:
    """Names of the dtypes this installation supports (bfloat16 needs ml_dtypes)."""
    return [name for name in DTYPES if dtype_named(name) is not None]


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
    if (dtype_code, op.code) not in VALID_PAIRS:
        kind = next(k for c, k in DTYPE_CODES.values() if c == dtype_code)
        allowed = ", ".join(o.name for o in OPS_FOR_KIND[kind])
        raise TypeError(f"op: {op.name} is not defined for dtype {dtype} (allowed: {allowed})")
