"""Benchmarks behind ``python -m aluminum_py bench ...`` (run under mpiexec; ``cluster`` runs
mpiexec itself, inside an emulated cluster)."""
