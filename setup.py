"""Build the Cython extensions in ext/ against an MPI library.

MPI is found in this order (the same knobs mpi4py uses):
  1. MPICC=/path/to/mpicc      the cluster's MPI compiler wrapper: used as the C compiler
  2. mpicc on PATH             (the `mpich` wheel puts one in the build environment)
  3. <prefix>/include/mpi.h    for every prefix on sys.path (the `mpich` wheel layout)
"""
import glob
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

import mpi4py
import numpy
from setuptools import Extension, setup
from Cython.Build import cythonize


def mpicc_flags(mpicc):
    """Include dirs, library dirs and libraries from `mpicc -show` (MPICH) or `--showme` (Open MPI)."""
    for flag in ("-show", "--showme"):
        try:
            out = subprocess.run([mpicc, flag], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            continue
        inc, libdirs, libs = [], [], []
        for tok in shlex.split(out)[1:]:
            if tok.startswith("-I"):
                inc.append(tok[2:])
            elif tok.startswith("-L"):
                libdirs.append(tok[2:])
            elif tok.startswith("-l"):
                libs.append(tok[2:])
        if inc or libs:
            return inc, libdirs, libs
    return None


def find_mpi():
    mpicc = os.environ.get("MPICC") or shutil.which("mpicc")
    if mpicc:
        found = mpicc_flags(mpicc)
        if found:
            return found
    prefixes = {sys.prefix, sysconfig.get_paths()["data"]}
    for p in sys.path:
        # <prefix>/lib/pythonX.Y/site-packages -> <prefix>
        prefixes.add(os.path.abspath(os.path.join(p, "..", "..", "..")))
    for prefix in sorted(prefixes):
        if os.path.exists(os.path.join(prefix, "include", "mpi.h")):
            return [os.path.join(prefix, "include")], [os.path.join(prefix, "lib")], ["mpi"]
    sys.exit("aluminum_py: no MPI found. Install the `mpich` wheel, or set MPICC to your MPI's mpicc.")


if os.environ.get("MPICC"):
    os.environ.setdefault("CC", os.environ["MPICC"])

inc, libdirs, libs = find_mpi()
# _core.pyx is a list of `include "core/*.pxi"` lines and cimports ext/libal.pxd (mpi4py's
# MPI.pyx layout). cythonize follows those includes and cimports to decide what to regenerate;
# `depends` makes the C compile step rebuild when a header changes too.
core_depends = sorted(glob.glob("ext/core/*.pxi") + glob.glob("ext/shm/*.h") +
                      glob.glob("ext/device/*.h")) + [
    "ext/libal.pxd", "ext/al_reduce.h", "ext/al_shm.h", "ext/al_device.h"]
ext = Extension(
    "aluminum_py._core",
    sources=["ext/_core.pyx"],
    depends=core_depends,
    include_dirs=["ext", mpi4py.get_include(), numpy.get_include()] + inc,
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    library_dirs=libdirs,
    libraries=libs + ["dl"],
    extra_compile_args=["-O3", "-ffp-contract=off", "-Wno-unused-function"],
)

def nccl_header_dir():
    """The nvidia-nccl-cu12 wheel's include folder if the wheel is installed at build time; else
    None (ext/nccl_fallback.h declares the part of nccl.h we use). NCCL itself is dlopen'ed."""
    if os.environ.get("AL_NCCL_FALLBACK_HEADER"):
        return None
    try:
        import nvidia.nccl
    except ImportError:
        return None
    for base in nvidia.nccl.__path__:
        inc = os.path.join(base, "include")
        if os.path.exists(os.path.join(inc, "nccl.h")):
            return inc
    return None


nccl_inc = nccl_header_dir()
nccl_ext = Extension(
    "aluminum_py._nccl",
    sources=["ext/_nccl.pyx"],
    include_dirs=["ext", "ext/cuda_stubs"] + ([nccl_inc] if nccl_inc else []),
    define_macros=[("AL_HAVE_NCCL_H", "1")] if nccl_inc else [],
    libraries=["dl"],
    extra_compile_args=["-O2", "-Wno-unused-function"],
)

planning_ext = Extension("aluminum_py._planning", sources=["ext/_planning.pyx"],
                         extra_compile_args=["-O3"])
dlpack_ext = Extension("aluminum_py._dlpack", sources=["ext/_dlpack.pyx"],
                       extra_compile_args=["-O2"])

# The `mpich` wheel is the default MPI; a build against the cluster's MPI (MPICC set) must not
# pull it in, or mpi4py could load the wrong libmpi at run time.
install_requires = ["mpi4py>=4", "numpy", "scipy"] + ([] if os.environ.get("MPICC") else ["mpich"])

setup(install_requires=install_requires, ext_modules=cythonize([ext, nccl_ext, planning_ext, dlpack_ext], compiler_directives={"language_level": "3"}, include_path=["ext"]))
