"""aluminum_py: MPI-style collectives for Python with fast allreduce algorithms and a native
progress engine: the public API (docs/api.md; start with docs/quickstart.md)."""
from mpi4py import MPI as _MPI  # noqa: F401  (initialises MPI and loads libmpi before _core)

from . import _core, timeline
from .algorithms import algorithms
from .communicator import Communicator
from .errors import Error, MPIError, NcclError, TimeoutError, UnavailableError
from .ops import AVG, BAND, BOR, BXOR, LAND, LOR, LXOR, MAX, MIN, OPS, PROD, SUM, Op
from .request import Request, Testall, Testany, Waitall, Waitany, Waitsome
from .status import ANY_SOURCE, ANY_TAG, UNDEFINED, Status
from .tuning import Choice, TuningWarning


def explain(comm: Communicator, nbytes: int, dtype="float32") -> Choice:
    """Which algorithm ``algorithm="auto"`` picks on `comm` for an Allreduce of `nbytes` bytes
    of `dtype`, and why. Example: ``print(al.explain(comm, 1 << 20))``."""
    return comm.explain(nbytes, dtype)

from ._shutdown import install as _install_shutdown

__version__ = "0.1.0"
__all__ = ["Communicator", "Request", "Waitall", "algorithms", "explain", "Choice", "timeline",
           "TuningWarning", "Error", "MPIError", "NcclError",
           "TimeoutError", "UnavailableError", "Op", "SUM", "PROD", "MIN", "MAX", "LAND", "LOR",
           "LXOR", "BAND", "BOR", "BXOR", "AVG", "OPS"]
# point to point beyond Send/Recv, and the waits of several requests
__all__ += ["Status", "ANY_SOURCE", "ANY_TAG", "UNDEFINED", "Waitany", "Testany", "Testall",
            "Waitsome"]

_install_shutdown()
