"""What the GPU backend needs to know of NCCL beyond the binding (:mod:`aluminum_py.nccl`):
which ops it has, its point-to-point rules (no tags, no wildcard source), the CTA-limit defaults
and the communicator's blocking mode."""
from __future__ import annotations

from .. import config
from ..errors import UnavailableError

# al.Op name -> NCCL's name of the reduction
NCCL_OP_NAMES = {"SUM": "sum", "PROD": "prod", "MIN": "min", "MAX": "max", "AVG": "avg"}


def op_name(op, hint: str = "") -> str:
    """NCCL's name of the reduction `op` (an al.Op), or TypeError: NCCL has no such op."""
    name = NCCL_OP_NAMES.get(op.name)
    if name is None:
        raise TypeError(f"op: NCCL has no {op.name}{hint}")
    return name


def check_p2p_args(tag, source, any_source, any_tag=None) -> None:
    """GPU point-to-point goes through NCCL, which has neither tags nor wildcard sources: `tag`
    must be 0, or, for a receive, `any_tag` (every NCCL message matches it); a receive from
    `any_source` is unavailable (an NCCL receive names its peer; nothing can probe for one)."""
    if tag != 0 and (any_tag is None or tag != any_tag):
        raise ValueError("tag: GPU buffers go through NCCL, which has no tags; use tag=0")
    if source is not None and source == any_source:
        raise UnavailableError("source: GPU buffers go through NCCL, which cannot receive from "
                               "ANY_SOURCE (each receive names its peer, and Probe cannot see "
                               "NCCL messages); pass the sending rank as source")


def cta_limits(min_ctas, max_ctas) -> tuple[int | None, int | None]:
    """The thread-block limits of one op: as given, else AL_NCCL_MIN_CTAS / AL_NCCL_MAX_CTAS."""
    if min_ctas is None or max_ctas is None:
        env_min, env_max = config.nccl_ctas()
        min_ctas = env_min if min_ctas is None else min_ctas
        max_ctas = env_max if max_ctas is None else max_ctas
    return min_ctas, max_ctas


def blocking_mode():
    """ncclConfig_t.blocking: 0 under a hang timeout (AL_HANG_TIMEOUT, 1800 s unless set; with
    AL_HANG_TIMEOUT=0 NCCL's default, 1)."""
    return False if config.hang_timeout() is not None else None
