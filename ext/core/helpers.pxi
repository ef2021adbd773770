# Small module functions: buffer addresses, the MPI thread level, the reduction kernels
# for tests and benchmarks.

cnp.import_array()

def addr(cnp.ndarray a):
    """Address of an ndarray's data."""
    return <intptr_t>cnp.PyArray_DATA(a)

def thread_level():
    """The MPI thread support level as an int (mpi4py.MPI.THREAD_* values)."""
    cdef int provided = 0
    mpi.MPI_Query_thread(&provided)
    return provided

def thread_multiple():
    cdef int provided = 0
    mpi.MPI_Query_thread(&provided)
    return provided == mpi.MPI_THREAD_MULTIPLE

def reduce_into(int dtype, int rop, out, a, b):
    """out[:] = a OP b with the native kernel (numpy arrays of equal size; testing and benches)."""
    cdef Py_buffer bo, ba, bb
    cdef int rc
    PyObject_GetBuffer(out, &bo, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
    PyObject_GetBuffer(a, &ba, PyBUF_C_CONTIGUOUS)
    PyObject_GetBuffer(b, &bb, PyBUF_C_CONTIGUOUS)
    try:
        if ba.len != bo.len or bb.len != bo.len or bo.itemsize != ba.itemsize:
            raise ValueError("reduce_into: buffers differ in size")
        with nogil:
            rc = al_reduce(dtype, rop, bo.buf, ba.buf, bb.buf, <size_t>(bo.len // bo.itemsize))
        if rc != 0:
            raise ValueError(f"reduce_into: op {rop} not defined for dtype {dtype}")
    finally:
        PyBuffer_Release(&bb)
        PyBuffer_Release(&ba)
        PyBuffer_Release(&bo)
