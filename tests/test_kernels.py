"""The native reduction kernels (ext/al_reduce.h) against numpy, every dtype x op."""
import numpy as np
import pytest

from aluminum_py import _core
from aluminum_py.ops import DTYPES, OPS, OPS_FOR_KIND, check_op, supported_dtypes

# every supported dtype (bfloat16 where ml_dtypes is installed: supported_dtypes imports it)
PAIRS = [(name, *DTYPES[name], op) for name in supported_dtypes() for op in OPS_FOR_KIND[DTYPES[name][1]]]


def numpy_op(op, a, b):
    dt = a.dtype
    if op.name in ("SUM", "AVG"):
        return np.add(a, b, dtype=dt)
    if op.name == "PROD":
        return np.multiply(a, b, dtype=dt)
    if op.name == "MIN":
        return np.minimum(a, b)
    if op.name == "MAX":
        return np.maximum(a, b)
    if op.name in ("LAND", "LOR", "LXOR"):
        f = {"LAND": np.logical_and, "LOR": np.logical_or, "LXOR": np.logical_xor}[op.name]
        return f(a != 0, b != 0).astype(dt)
    f = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op.name]
    return f(a, b)


def random_array(dt, n, rng):
    dt = np.dtype(dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        a = rng.integers(info.min, info.max, size=n, dtype=dt, endpoint=True)
        a[::5] = 0   # zeros for the logical ops
        return a
    if dt.kind == "c":
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dt)
    return (rng.standard_normal(n) * 100).astype(dt)


@pytest.mark.parametrize("dtype,code,kind,op", PAIRS, ids=[f"{p[0]}-{p[3].name}" for p in PAIRS])
def test_kernel_matches_numpy(dtype, code, kind, op):
    """Full-range integers (wraparound), random floats with rounding: bit-identical to numpy."""
    rng = np.random.default_rng(code * 100 + op.code)
    for n in (0, 1, 7, 1000, 4099):
        a, b = random_array(dtype, n, rng), random_array(dtype, n, rng)
        out = np.empty_like(a)
        with np.errstate(all="ignore"):
            _core.reduce_into(code, op.code, out, a, b)
            expected = numpy_op(op, a, b)
        if kind == "complex" and op.name == "PROD":
            np.testing.assert_allclose(out, expected, rtol=1e-6 if dtype == "complex64" else 1e-14)
        else:
            assert np.array_equal(out, expected, equal_nan=True), dtype


def test_kernel_in_place_alias():
    a = np.arange(100, dtype=np.float32)
    b = np.ones(100, dtype=np.float32)
    _core.reduce_into(10, 0, a, a, b)
    assert np.array_equal(a, np.arange(100, dtype=np.float32) + 1)


def test_float16_rounding_and_specials():
    a = np.array([65504, 1, np.inf, -np.inf, np.nan, 6e-8, 2049], dtype=np.float16)
    b = np.array([65504, 2**-11, 1, np.inf, 1, 6e-8, 1], dtype=np.float16)
    out = np.empty_like(a)
    _core.reduce_into(8, 0, out, a, b)
    with np.errstate(all="ignore"):
        assert np.array_equal(out, a + b, equal_nan=True)


def test_capability_table_rejects():
    for name in supported_dtypes():
        (code, kind), dt = DTYPES[name], np.dtype(name)
        for op in OPS:
            if op in OPS_FOR_KIND[kind]:
                check_op(op, code, dt)
            else:
                with pytest.raises(TypeError, match="op"):
                    check_op(op, code, dt)


@pytest.mark.parametrize("dtype,code", [("float16", 8), ("float32", 10), ("float64", 11)])
def test_min_max_symmetric_with_nan_and_signed_zero(dtype, code):
    """a op b and b op a are the same bits (ranks must agree); NaN propagates like numpy."""
    a = np.array([np.nan, 1.0, 0.0, -0.0, np.nan, -np.inf], dtype=dtype)
    b = np.array([1.0, np.nan, -0.0, 0.0, np.nan, np.inf], dtype=dtype)
    for opc, ref in ((2, np.minimum), (3, np.maximum)):
        ab, ba = np.empty_like(a), np.empty_like(a)
        _core.reduce_into(code, opc, ab, a, b)
        _core.reduce_into(code, opc, ba, b, a)
        assert ab.tobytes() == ba.tobytes()
        assert np.array_equal(np.isnan(ab), np.isnan(ref(a, b)))
        assert np.array_equal(ab[~np.isnan(ab)], ref(a, b)[~np.isnan(ab)])
    mn = np.empty_like(a)
    _core.reduce_into(code, 2, mn, a, b)
    assert np.signbit(mn[2]) and np.signbit(mn[3])          # min(+0, -0) = -0
    mx = np.empty_like(a)
    _core.reduce_into(code, 3, mx, a, b)
    assert not np.signbit(mx[2]) and not np.signbit(mx[3])  # max(+0, -0) = +0
