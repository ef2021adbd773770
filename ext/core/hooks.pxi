# The Python side of the native core: `_hooks` (aluminum_py.backends.host._Hooks) raises every
# error the native code detects, so each error message is written once, in Python, even for
# the Cython call path (msgbuffer.pxi, collectives.pxi) and the devices (device.pxi);
# configure() installs it with the dtype codes and the capability table the call path checks.

cdef object _hooks = None           # aluminum_py.backends.host._Hooks instance
cdef object _config = None          # aluminum_py.config (its _hang_timeout is read per call)
cdef object _Op = None              # aluminum_py.ops.Op (msgbuffer.pxi's op_code)
cdef dict _dtype_codes = {}         # np.dtype -> dtype code
cdef object _IN_PLACE = None        # mpi4py's MPI.IN_PLACE (msgbuffer.pxi's in-place forms)
cdef int _valid[16][16]             # capability table: _valid[dtype][op]
memset(_valid, 0, sizeof(_valid))

def configure(hooks, dtype_codes, valid_pairs):
    """Install the Python helpers and the capability table (called once at import)."""
    global _hooks, _dtype_codes, _config, _Op, _IN_PLACE
    _hooks = hooks
    _IN_PLACE = hooks.IN_PLACE
    _config = hooks.config
    _Op = hooks.Op
    _dtype_codes = dict(dtype_codes)
    memset(_valid, 0, sizeof(_valid))
    for d, o in valid_pairs:
        _valid[d][o] = 1


def add_dtype(dtype, int code):
    """Add a dtype numpy learnt after configure() (bfloat16 once ml_dtypes is imported) to the
    call path's table (aluminum_py.ops.known_dtype)."""
    _dtype_codes[dtype] = code
