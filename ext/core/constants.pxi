# Python names of the C constants (mpi4py's constant.pxi style): every value is read from the C
# enum (core/types.pxi, al_reduce.h), so the Python side (communicator.py, schedules.py, ops.py)
# holds no copy that could drift.

KIND_NAMES = tuple(KIND_INFO[k].name.decode("ascii") for k in range(K_NKINDS))
KINDS = {name: k for k, name in enumerate(KIND_NAMES)}
RECV_MODES = {"none": RECV_NONE, "into": RECV_INTO, "tmp_reduce": RECV_TMP_REDUCE,
              "into_reduce": RECV_INTO_REDUCE}
STEP_SOURCES = {"send": FROM_SEND, "recv": FROM_RECV}
ERR_TIMEOUT = AL_ERR_TIMEOUT

# reduction op codes by op name (aluminum_py.ops.Op.code)
REDUCTION_OPS = {
    "SUM": AL_SUM, "PROD": AL_PROD, "MIN": AL_MIN, "MAX": AL_MAX,
    "LAND": AL_LAND, "LOR": AL_LOR, "LXOR": AL_LXOR,
    "BAND": AL_BAND, "BOR": AL_BOR, "BXOR": AL_BXOR, "AVG": AL_AVG,
}
# dtype codes by numpy dtype name (aluminum_py.ops.DTYPES)
DTYPES = {
    "int8": AL_INT8, "int16": AL_INT16, "int32": AL_INT32, "int64": AL_INT64,
    "uint8": AL_UINT8, "uint16": AL_UINT16, "uint32": AL_UINT32, "uint64": AL_UINT64,
    "float16": AL_FLOAT16, "bfloat16": AL_BFLOAT16, "float32": AL_FLOAT32,
    "float64": AL_FLOAT64, "complex64": AL_COMPLEX64, "complex128": AL_COMPLEX128,
}
