"""Test doubles of aluminum_py's environment.

* :mod:`aluminum_py.testing.cuda_standin`: a CUDA driver stand-in (a small C library, built on
  first use) that the library loads instead of libcuda.so.1 when ``AL_CUDA_LIBRARY`` names it,
  so that the CUDA code path runs, with CUDA's semantics, on machines without a GPU.

Importing this package builds nothing.
"""
