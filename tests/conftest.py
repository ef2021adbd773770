"""Test layout.

* tests/test_*.py          single-process tests (no launcher): schedules, kernels, tables, parsing.
* tests/gpu/test_*.py      GPU suite: collected by the plain run (one rank) whenever a CUDA device
                           is present (it skips cleanly without one); at two ranks
                           ``mpiexec -n 2 python -m pytest --with-mpi tests/gpu``. Without a GPU
                           it runs on the CUDA/NCCL/CuPy stand-ins at 1, 2 and 4 ranks
                           (tests/test_mpi_suite.py::test_gpu_suite_on_standins).
* tests/mpi/test_*.py      multi-rank tests. The outer pytest run launches them itself under
                           ``mpiexec -n N`` for N in 1, 2, 3, 4 (tests/test_mpi_suite.py); they are
                           not collected by the outer run.
* tests/standin/test_*.py  the CUDA code path against the CUDA driver stand-in
                           (aluminum_py.testing.cuda_standin), launched by
                           tests/test_mpi_suite.py::test_cuda_standin_suite at 1 and 2 ranks with
                           AL_CUDA_LIBRARY set; not collected by the outer run.
"""
import os

from aluminum_py.gpu import cuda_device_count

collect_ignore = (([] if cuda_device_count() > 0 else ["gpu"]) +
                  ([] if os.environ.get("AL_TEST_INNER") else ["mpi", "standin"]))
