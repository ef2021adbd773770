# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Inner loop of LIBRA's dynamic program (aluminum_py.planning.libra), in C."""
from libc.math cimport INFINITY


def minplus(const double[:, ::1] A, const double[:, ::1] H, int z0, double[::1] out):
    """out[z] = min(out[z], min over rows p and z0 <= z' <= z of A[p, z'] + H[p, z - z'])
    for z0 <= z < out.shape[0]."""
    cdef Py_ssize_t P = A.shape[0], Z1 = out.shape[0], p, zp, z
    cdef double a, v
    with nogil:
        for p in range(P):
            for zp in range(z0, Z1):
                a = A[p, zp]
                if a == INFINITY:
                    continue
                for z in range(zp, Z1):
                    v = a + H[p, z - zp]
                    if v < out[z]:
                        out[z] = v
