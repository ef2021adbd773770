"""Benchmarks behind ``python -m aluminum_py bench ...`` (run under mpiexec)."""
