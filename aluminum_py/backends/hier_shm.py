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

K = _core.KINDS

_LABELS = {"allreduce": "node allreduce/shm", "reduce_scatter": "node reduce_scatter/shm",
           "allgather": "node allgather/shm", "bcast": "node bcast/shm"}


def attach_segment(state, node_comm) -> None:
    """Set up `state`'s shared-memory segment over `node_comm` (``_core.shm_attach``, collective)
    with this process's settings, of which rank 0's count: a communicator's, and each node's of
    a hierarchical one."""
    slot = config.shm_slot_bytes()
    _core.shm_attach(state, node_comm, slot, min(config.shm_small_bytes(), slot),
                     config.hang_timeout_native(), config.shm_named(), config.shm_test_faults(),
                     config.shm_chunk_bytes(slot, _core.poll_yield() > 0))


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
    def setup(cls, state, comm, topo):
        """Map every node's segment (collective over `comm`, the ranks of `state` in the same
        order, placed as `topo` says: ``topology.Topology``): split `comm` by node, check that
        each node's ranks share a kernel, and run the "shm" setup (``_core.shm_attach``) on each
        node of more than one rank.  Every rank's report is allgathered, so all take the same
        path: (NodeSegments, None), or (None, why) when there is nothing to do (one node, one
        rank per node) or some node failed."""
        layout = topo.layout
        nodes = topo.nodes
        if nodes == 1:
            return None, "the communicator is one node"
        if nodes == len(layout):
            return None, "every node has one rank"
        rank = state.rank
        sub = comm.Split(layout[rank], key=rank)
        err = None
        if len({topo.machines[r] for r in topo.node_members()}) > 1:
            err = (f"the ranks of node {layout[rank]} are on different machines (boot ids "
                   f"differ; AL_NODE_LAYOUT names one node for them?)")
        node_state = _core.CommState(sub, sub)
        if err is None and sub.Get_size() > 1:
            try:
                attach_segment(node_state, sub)
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

    def _plan(self, count: int, inplace: bool) -> "_core.HierPlan":
        """This rank's phases for (count, in place), in the native form the op of a call is
        made from; cached."""
        key = (count, inplace, self.split_from)
        plan = self._plans.get(key)
        if plan is None:
            phases, tmp = schedules.hierarchical_shm(self.state.size, self.state.rank, count,
                                                     inplace, self.layout, self.split_from)
            plan = _core.HierPlan([_native(ph) for ph in phases], tmp, self.members)
            if len(self._plans) >= 256:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def allreduce_op(self, sp: int, rp: int, count: int, code: int, esize: int, opcode: int,
                     inplace: bool, keep):
        """The K_HIER_SHM op of one allreduce on checked buffers (addresses; sp == rp in place),
        not launched (Launcher.hierarchical).  The tag is taken on every rank, steps between
        nodes or not, so that the ranks' tags stay in step."""
        return self._plan(count, inplace).make(self.state, self.node_state, sp, rp, count, code,
                                               esize, opcode, self.state.next_tag(), keep)


_BUFFERS = {"send": 0, "recv": 1, "tmp": 2}        # HierPlan's buffer numbers (hier_shm.pxi)


def _native(ph) -> tuple:
    """A phase of schedules.hierarchical_shm as HierPlan takes it: (label, kind, src, src_off,
    dst, dst_off, count, root, Schedule or None); kind < 0: a local action (-1 copy out of
    scratch, -2 AVG's division)."""
    if isinstance(ph, schedules.NodePhase):
        return (_LABELS[ph.coll], K["shm_" + ph.coll], _BUFFERS[ph.src], ph.src_off,
                _BUFFERS[ph.dst], ph.dst_off, ph.count, ph.root, None)
    if isinstance(ph, schedules.NetPhase):
        return ("between nodes", K["schedule"], 1, 0, 1, 0, 0, 0, _core.Schedule(ph.steps, ph.tmp))
    if ph.what == "copy_tmp":
        return ("copy from scratch", -1, 2, 0, 1, ph.off, ph.cnt, 0, None)
    return ("AVG division", -2, 1, 0, 1, ph.off, ph.cnt, 0, None)
