# The Python side of the native core: `_hooks` (aluminum_py.communicator._Hooks) raises every
# error the native code detects, so each error message is written once, in Python, even for
# the Cython fast path (launcher.pxi) and the devices (device.pxi); configure() installs it
# with the dtype codes and the capability table the fast path checks.

cdef object _hooks = None           # aluminum_py.communicator._Hooks instance
cdef dict _dtype_codes = {}         # np.dtype -> dtype code
cdef int _valid[16][16]             # capability table: _valid[dtype][op]
memset(_valid, 0, sizeof(_valid))

def configure(hooks, dtype_codes, valid_pairs):
    """Install the Python helpers and the capability table (called once at import)."""
    global _hooks, _dtype_codes
    _hooks = hooks
    _dtype_codes = dict(dtype_codes)
    memset(_valid, 0, sizeof(_valid))
    for d, o in valid_pairs:
        _valid[d][o] = 1
