"""The shared-memory segments of a communicator that spans several nodes, one per node over the
node's sub-communicator, and the "hierarchical" allreduce over them: per call one native op
(``K_HIER_SHM``, ``ext/core/hier_shm.pxi``) whose phases, built by
:func:`aluminum_py.schedules.hierarchical_shm`, are shm collectives inside the node and a
schedule between nodes.  Without segments (one node, one rank per node, or a setup that failed
on some node) "hierarchical" keeps its point-to-point schedule (``schedules.hierarchical``).
"""
from __future__ import annotations

from .. import _core, config, schedules
from ..errors import Error, TimeoutError
from ..ops import AVG
from ..topology import machine_id

K = _core.KINDS

_LABELS = {"allreduce": "node allreduce/shm", "reduce_scatter": "node reduce_scatter/shm",
           "allgather": "node allgather/shm", "bcast": "node bcast/shm"}


class NodeSegments:
    """This rank's node segment and the plans of the hierarchical allreduce over it (made by
    :meth:`setup`; :meth:`close` unmaps and frees)."""

    def __init__(self, state, node_state, node_comm, layout):
        self.state = state                  # the communicator's CommState (the inter-node steps)
        self.node_state = node_state        # the node's CommState: its al_comm holds the segment
        self.node_comm = node_comm
        self.layout = layout
        self.members = tuple(r for r in range(state.size) if layout[r] == layout[state.rank])
        self._plans: dict = {}
        # where the reduce-scatter form starts (None: schedules.HIER_SHM_SPLIT_FROM); set the
        # same on every rank, only to time the forms (bench/hierarchical_forms.py)
        self.split_from = None

    @classmethod
    def setup(cls, state, comm, layout):
        """Map every node's segment (collective over `comm`, the ranks of `state` in the same
        order): split `comm` by node, check that each node's ranks share a kernel, and run the
        "shm" setup (``_core.shm_attach``) on each node of more than one rank.  Every rank's
        report is allgathered, so all take the same path: (NodeSegments, None), or (None, why)
        when there is nothing to do (one node, one rank per node) or some node failed."""
        nodes = len(set(layout))
        if nodes == 1:
            return None, "the communicator is one node"
        if nodes == len(layout):
            return None, "every node has one rank"
        rank = state.rank
        sub = comm.Split(layout[rank], key=rank)
        err = None
        if len(set(sub.allgather(machine_id()))) > 1:
            err = (f"the ranks of node {layout[rank]} are on different machines (boot ids "
                   f"differ; AL_NODE_LAYOUT names one node for them?)")
        node_state = _core.CommState(sub, sub)
        if err is None and sub.Get_size() > 1:
            slot = config.shm_slot_bytes()
            try:
                _core.shm_attach(node_state, sub, slot, min(config.shm_small_bytes(), slot),
                                 config.hang_timeout_native(), config.shm_named())
            except TimeoutError:
                raise
            except Error as e:
                err = f"node {layout[rank]}: {e}"
        errors = comm.allgather(err)
        if any(errors):
            _core.shm_detach(node_state)
            sub.Free()
            return None, "; ".join(dict.fromkeys(e for e in errors if e))
        return cls(state, node_state, sub, layout), None

    def close(self) -> None:
        _core.shm_detach(self.node_state)
        self.node_comm.Free()

    def info(self):
        """The node segment as this rank sees it (``_core.shm_info``; None on a node of one)."""
        return _core.shm_info(self.node_state)

    def _plan(self, count: int, inplace: bool):
        """(phases, scratch elements) of this rank for (count, in place), each step phase with
        its native Schedule; cached."""
        key = (count, inplace, self.split_from)
        plan = self._plans.get(key)
        if plan is None:
            phases, tmp = schedules.hierarchical_shm(self.state.size, self.state.rank, count,
                                                     inplace, self.layout, self.split_from)
            plan = (tuple((ph, _core.Schedule(ph.steps, ph.tmp)
                           if isinstance(ph, schedules.NetPhase) else None) for ph in phases),
                    tmp)
            if len(self._plans) >= 256:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def allreduce_op(self, sp: int, rp: int, count: int, code: int, esize: int, opcode: int,
                     inplace: bool, keep):
        """The K_HIER_SHM op of one allreduce on checked buffers (addresses; sp == rp in place),
        not launched (Launcher.hierarchical)."""
        phases, tmp = self._plan(count, inplace)
        tag = self.state.next_tag()         # on every rank, steps between nodes or not
        avg = opcode == AVG.code
        base = {"send": sp, "recv": rp}
        built = []
        for ph, sched in phases:
            if isinstance(ph, schedules.NodePhase):
                to_tmp = ph.dst == "tmp"
                nop = _core.make_op(self.node_state, K["shm_" + ph.coll], _LABELS[ph.coll],
                                    base[ph.src] + ph.src_off * esize,
                                    0 if to_tmp else base[ph.dst] + ph.dst_off * esize,
                                    ph.count, code, esize, opcode, root=ph.root)
                built.append((_LABELS[ph.coll], nop, 0, 0, 0, to_tmp))
            elif sched is not None:
                nop = _core.make_op(self.state, K["schedule"], "between nodes", rp, rp, count,
                                    code, esize, opcode, tag=tag, schedule=sched)
                built.append(("between nodes", nop, 0, 0, 0, False))
            elif ph.what == "copy_tmp":
                built.append(("copy from scratch", None, rp + ph.off * esize, 0, ph.cnt, True))
            elif avg:
                built.append(("AVG division", None, rp + ph.off * esize, 0, ph.cnt, False))
        return _core.make_hier_op(self.state, "allreduce/hierarchical", count, code, esize,
                                  opcode, float(self.state.size) if avg else 0.0, tmp * esize,
                                  built, self.members, keep)
