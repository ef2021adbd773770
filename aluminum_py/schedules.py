"""Allreduce algorithms as pure schedule builders.

A schedule is, for one rank, the list of steps it performs: per step an optional local copy
(sendbuf -> recvbuf), an optional receive and an optional send.  A receive either lands in the
result buffer (``into``), or is reduced into it (``tmp_reduce``: into scratch, then
``recvbuf[off] = SRC[off] op scratch``; ``into_reduce``: into the result buffer, then
``recvbuf[off] = sendbuf[off] op recvbuf[off]``, which saves the scratch and the copy for
out-of-place calls).  The native engine executes schedules (``ext/core/schedule.pxi``), the same
machine for blocking and nonblocking calls; :func:`simulate` executes them in numpy for every rank
at once, so the algorithms are tested for many rank counts without MPI.

Offsets and counts are in elements.  Sends and receives of zero elements are dropped on both
sides (both ends compute the same block sizes).  Out of place, the builder tracks which blocks of
the result buffer already hold partial results ("valid"); untouched blocks are read from sendbuf,
so no algorithm starts with a full copy of the input.

Algorithms (p ranks, n elements; paper section III-B and Thakur et al. 2005):

* ``recursive_doubling``: log2(p) full-vector exchanges.  Non-powers of two fold the first 2r
  ranks (r = p - 2^floor(log2 p)) in pairs before and out after.
* ``rabenseifner``: reduce-scatter by recursive halving, then allgather by recursive doubling,
  over 2^floor(log2 p) blocks, with the same fold.
* ``ring``: reduce-scatter then allgather around the ring, p blocks, any p.
* ``hierarchical``: binomial-tree reduce inside each node to its leader (its lowest rank), an
  allreduce among the node leaders (recursive doubling below :data:`HIER_RING_FROM` elements,
  ring from there), binomial-tree broadcast inside each node; from :data:`HIER_SPLIT_FROM`
  elements ring reduce-scatter inside the node, allreduce across nodes of each rank's block,
  ring allgather inside the node.  It needs the node layout (the node of every rank,
  ``topology.canonical_layout``); with one node there is no inter-node phase, with one rank per node it is
  the flat inner algorithm.  Steps carry no owned marker: AVG divides at the end.
  Where the nodes have shared-memory segments its inside-a-node phases run over them instead:
  :func:`hierarchical_shm` lists those phases (``hierarchical_p2p`` names this schedule always).

Every block's final value is computed by exactly one rank or identically by both partners (the
ops are commutative element-wise, so ``a op b`` equals ``b op a`` bit for bit); all ranks end with
bit-identical results.

``ring`` and ``rabenseifner`` mark the step after which a rank holds its own final block of the
reduce-scatter (``Step.owned``; with p >= 2 every rank has exactly one, possibly empty: a rank
folded out of ``rabenseifner`` gets an empty marker, since its result arrives averaged).  AVG
divides that block there, before the allgather sends it on, so each element is divided once by
its owner instead of the whole result by every rank: a pass over n/p elements, not n, with the
block still in cache.  ``recursive_doubling`` has no owner; AVG divides at the end.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from . import _core
from .topology import canonical_layout

# the codes the native interpreter reads (ext/core/types.pxi), from the extension itself
FROM_SEND, FROM_RECV = _core.STEP_SOURCES["send"], _core.STEP_SOURCES["recv"]
RECV_NONE, RECV_INTO, RECV_TMP_REDUCE, RECV_INTO_REDUCE = (
    _core.RECV_MODES[m] for m in ("none", "into", "tmp_reduce", "into_reduce"))

ALGORITHMS = ("recursive_doubling", "rabenseifner", "ring", "hierarchical", "hierarchical_p2p")

# hierarchical: the leaders' allreduce is ring from this many elements (64 KiB of float32),
# recursive doubling below: latency decides small messages, bandwidth large ones
HIER_RING_FROM = 16384
# hierarchical: from this many elements (64 KiB of float32) the node reduces by reduce-scatter
# and allgather (every rank of a node carries a share across nodes), below by a binomial tree
HIER_SPLIT_FROM = 16384


@dataclass(frozen=True)
class Step:
    send_peer: int = -1
    send_src: int = FROM_SEND
    send_off: int = 0
    send_cnt: int = 0
    recv_peer: int = -1
    recv_mode: int = RECV_NONE
    reduce_src: int = FROM_RECV
    recv_off: int = 0
    recv_cnt: int = 0
    copy_off: int = 0
    copy_cnt: int = 0
    owned: int = 0      # 1: after this step, recv_off/recv_cnt hold this rank's final block



def block_bounds(count: int, nblocks: int) -> list[int]:
    """Offsets of `nblocks` near-equal blocks covering `count` elements (length nblocks + 1)."""
    q, r = divmod(count, nblocks)
    bounds = [0]
    for i in range(nblocks):
        bounds.append(bounds[-1] + q + (1 if i < r else 0))
    return bounds


class _Builder:
    """Accumulates steps for one rank, tracking which blocks of recvbuf hold partial results."""

    def __init__(self, count: int, bounds: list[int], inplace: bool):
        self.count = count
        self.bounds = bounds
        self.inplace = inplace
        self.valid = [inplace] * (len(bounds) - 1)
        self.steps: list[Step] = []
        self.tmp = 0

    def _range(self, lo: int, hi: int) -> tuple[int, int]:
        return self.bounds[lo], self.bounds[hi] - self.bounds[lo]

    def _src(self, lo: int, hi: int) -> int:
        vals = set(self.valid[lo:hi])
        assert len(vals) <= 1, "mixed validity inside one transfer"
        return FROM_RECV if vals == {True} else FROM_SEND

    def step(self, send_peer=-1, send=None, recv_peer=-1, recv=None, reduce=False, owned=False):
        """One exchange: send blocks send=(lo, hi) to send_peer, receive blocks recv=(lo, hi).
        ``owned``: the receive completes this rank's final block (kept even when empty, so
        the schedule says that every block is finished by exactly one owner)."""
        kw = {"owned": 1} if owned else {}
        if send is not None and send_peer >= 0:
            off, cnt = self._range(*send)
            if cnt > 0:
                kw.update(send_peer=send_peer, send_src=self._src(*send), send_off=off, send_cnt=cnt)
        if recv is not None and recv_peer >= 0:
            off, cnt = self._range(*recv)
            if cnt > 0:
                if not reduce:
                    mode, rsrc = RECV_INTO, FROM_RECV
                elif self._src(*recv) == FROM_RECV:
                    mode, rsrc = RECV_TMP_REDUCE, FROM_RECV
                elif send is not None and kw.get("send_src") == FROM_RECV and _overlap(
                        (kw["send_off"], kw["send_cnt"]), (off, cnt)):
                    mode, rsrc = RECV_TMP_REDUCE, FROM_SEND   # cannot land where we send from
                else:
                    mode, rsrc = RECV_INTO_REDUCE, FROM_SEND
                if mode == RECV_TMP_REDUCE:
                    self.tmp = max(self.tmp, cnt)
                kw.update(recv_peer=recv_peer, recv_mode=mode, reduce_src=rsrc, recv_off=off,
                          recv_cnt=cnt)
            for b in range(*recv):
                self.valid[b] = True
        if kw:
            self.steps.append(Step(**kw))

    def finish(self, has_result: bool = True) -> tuple[list[Step], int]:
        """Copy blocks never touched (out of place) so recvbuf holds the whole result."""
        if has_result and not self.inplace:
            b = 0
            nb = len(self.valid)
            while b < nb:
                if self.valid[b]:
                    b += 1
                    continue
                e = b
                while e < nb and not self.valid[e]:
                    e += 1
                off, cnt = self._range(b, e)
                if cnt > 0:
                    self.steps.append(Step(copy_off=off, copy_cnt=cnt))
                b = e
        return self.steps, self.tmp


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


def _fold(p: int, rank: int):
    """Fold to a power of two: (p2, r, newrank or -1, partner rank in the pair or -1)."""
    p2 = 1 << (p.bit_length() - 1)
    r = p - p2
    if rank < 2 * r:
        if rank % 2 == 0:
            return p2, r, -1, rank + 1
        return p2, r, rank // 2, rank - 1
    return p2, r, rank - r, -1


def _real(newrank: int, r: int) -> int:
    return newrank * 2 + 1 if newrank < r else newrank + r


def _fold_in(b: _Builder, rank: int, newrank: int, pair: int, nblocks: int):
    if pair < 0:
        return
    if newrank < 0:          # even rank of a folded pair: hand over its data
        b.step(send_peer=pair, send=(0, nblocks))
    else:                    # odd rank: absorb the partner's data
        b.step(recv_peer=pair, recv=(0, nblocks), reduce=True)


def _fold_out(b: _Builder, newrank: int, pair: int, nblocks: int):
    if pair < 0:
        return
    if newrank < 0:
        b.step(recv_peer=pair, recv=(0, nblocks))
    else:
        b.step(send_peer=pair, send=(0, nblocks))


def recursive_doubling(p: int, rank: int, count: int, inplace: bool):
    b = _Builder(count, [0, count], inplace)
    p2, r, nr, pair = _fold(p, rank)
    _fold_in(b, rank, nr, pair, 1)
    if nr >= 0:
        mask = 1
        while mask < p2:
            peer = _real(nr ^ mask, r)
            b.step(send_peer=peer, send=(0, 1), recv_peer=peer, recv=(0, 1), reduce=True)
            mask <<= 1
    _fold_out(b, nr, pair, 1)
    return b.finish()


def rabenseifner(p: int, rank: int, count: int, inplace: bool):
    p2, r, nr, pair = _fold(p, rank)
    b = _Builder(count, block_bounds(count, p2), inplace)
    _fold_in(b, rank, nr, pair, p2)
    if nr < 0:      # folded out: owns no block, and its result arrives already averaged
        b.step(owned=True)
    if nr >= 0:
        lo, hi = 0, p2
        mask = p2 >> 1
        while mask >= 1:                      # reduce-scatter by recursive halving
            peer = _real(nr ^ mask, r)
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if nr & mask else ((lo, mid), (mid, hi))
            b.step(send_peer=peer, send=give, recv_peer=peer, recv=keep, reduce=True,
                   owned=mask == 1)
            lo, hi = keep
            mask >>= 1
        mask = 1
        while mask < p2:                      # allgather by recursive doubling
            peer = _real(nr ^ mask, r)
            other = (lo - mask, lo) if nr & mask else (hi, hi + mask)
            b.step(send_peer=peer, send=(lo, hi), recv_peer=peer, recv=other)
            lo, hi = min(lo, other[0]), max(hi, other[1])
            mask <<= 1
    _fold_out(b, nr, pair, p2)
    return b.finish()


def ring(p: int, rank: int, count: int, inplace: bool):
    b = _Builder(count, block_bounds(count, p), inplace)
    right, left = (rank + 1) % p, (rank - 1) % p
    for s in range(p - 1):                    # reduce-scatter
        sb, rb = (rank - s) % p, (rank - s - 1) % p
        b.step(send_peer=right, send=(sb, sb + 1), recv_peer=left, recv=(rb, rb + 1), reduce=True,
               owned=s == p - 2)
    for s in range(p - 1):                    # allgather
        sb, rb = (rank + 1 - s) % p, (rank - s) % p
        b.step(send_peer=right, send=(sb, sb + 1), recv_peer=left, recv=(rb, rb + 1))
    return b.finish()


def _tree_reduce(b: _Builder, members: list[int], i: int):
    """Binomial-tree reduce of the whole vector to members[0] (i: this rank's index)."""
    mask = 1
    while mask < len(members):
        if i & mask:
            b.step(send_peer=members[i - mask], send=(0, 1))
            return
        if i + mask < len(members):
            b.step(recv_peer=members[i + mask], recv=(0, 1), reduce=True)
        mask <<= 1


def _tree_bcast(b: _Builder, members: list[int], i: int):
    """Binomial-tree broadcast of the whole vector from members[0] (the reverse of the reduce)."""
    k = len(members)
    mask = 1
    while mask < k and not i & mask:
        mask <<= 1
    if i:
        b.step(recv_peer=members[i - mask], recv=(0, 1))
    mask >>= 1
    while mask >= 1:
        if i + mask < k:
            b.step(send_peer=members[i + mask], send=(0, 1))
        mask >>= 1


def _flat(b: _Builder, group: list[int], rank: int, lo: int, cnt: int, valid: bool):
    """Append a flat allreduce of elements [lo, lo + cnt) among the ranks `group` (recursive
    doubling below HIER_RING_FROM elements, ring from there).  `valid`: this rank's recvbuf
    already holds its partial result there."""
    inner = ring if cnt >= HIER_RING_FROM else recursive_doubling
    steps, tmp = inner(len(group), group.index(rank), cnt, b.inplace or valid)
    b.tmp = max(b.tmp, tmp)
    for st in steps:
        b.steps.append(replace(
            st, owned=0, send_off=st.send_off + lo, recv_off=st.recv_off + lo,
            copy_off=st.copy_off + lo,
            send_peer=group[st.send_peer] if st.send_peer >= 0 else -1,
            recv_peer=group[st.recv_peer] if st.recv_peer >= 0 else -1))


def _nodes(p: int, layout) -> list[list[int]]:
    """The ranks of each node (numbered by first appearance), in rank order; None: one node."""
    layout = canonical_layout(layout if layout is not None else [0] * p)
    if len(layout) != p:
        raise ValueError(f"layout: {len(layout)} entries for {p} ranks")
    return [[r for r in range(p) if layout[r] == n] for n in range(max(layout) + 1)]


def hierarchical(p: int, rank: int, count: int, inplace: bool, layout=None):
    nodes = _nodes(p, layout)
    members = next(m for m in nodes if rank in m)
    i = members.index(rank)
    if count >= HIER_SPLIT_FROM and p > len(nodes):       # the same form on every rank
        return _hierarchical_split(nodes, members, i, rank, count, inplace)
    b = _Builder(count, [0, count], inplace)
    _tree_reduce(b, members, i)
    if i == 0 and len(nodes) > 1:
        # after the reduce the leader's recvbuf holds the node's partial sum (if it received)
        _flat(b, [n[0] for n in nodes], rank, 0, count, b.valid[0])
        b.valid[0] = True
    _tree_bcast(b, members, i)
    return b.finish()


def _hierarchical_split(nodes, members, i, rank, count, inplace):
    """The large-message form: ring reduce-scatter inside the node (member i then holds the
    node's sum of block (i+1) % k of its node's k blocks), an allreduce across nodes of each
    piece of that block, ring allgather inside the node.  Nodes of different sizes cut the
    vector differently: the pieces are the segments between every node's block bounds, each
    inside one block per node, so each has one owner per node; every rank does its pieces in
    increasing order (no cycle: the lowest unfinished piece has all its owners on it)."""
    k = len(members)
    b = _Builder(count, block_bounds(count, k), inplace)
    right, left = members[(i + 1) % k], members[(i - 1) % k]
    for s in range(k - 1):                    # reduce-scatter inside the node
        sb, rb = (i - s) % k, (i - s - 1) % k
        b.step(send_peer=right, send=(sb, sb + 1), recv_peer=left, recv=(rb, rb + 1), reduce=True)
    mine = (i + 1) % k
    if len(nodes) > 1:
        bounds = {n[0]: block_bounds(count, len(n)) for n in nodes}
        cuts = sorted({c for bb in bounds.values() for c in bb})
        lo_mine, hi_mine = b.bounds[mine], b.bounds[mine + 1]
        for lo, hi in zip(cuts, cuts[1:]):
            if not lo_mine <= lo < hi_mine:
                continue
            owners = []
            for n in nodes:                   # in each node, the owner of the block holding lo
                bb = bounds[n[0]]
                blk = max(j for j in range(len(n)) if bb[j] <= lo)
                owners.append(n[(blk - 1) % len(n)])
            _flat(b, owners, rank, lo, hi - lo, b.valid[mine])
    b.valid[mine] = True
    for s in range(k - 1):                    # allgather inside the node
        sb, rb = (i + 1 - s) % k, (i - s) % k
        b.step(send_peer=right, send=(sb, sb + 1), recv_peer=left, recv=(rb, rb + 1))
    return b.finish()


# hierarchical over the nodes' shared-memory segments: the reduce-scatter form from this many
# elements (64 KiB of float32) when every node has the same number of ranks, the reduce ->
# leaders' allreduce -> bcast form below it (and at every size on nodes of different sizes)
HIER_SHM_SPLIT_FROM = 16384


@dataclass(frozen=True)
class NodePhase:
    """A collective of the node's ranks over its shared-memory segment (the "shm" protocols,
    ``ext/al_shm.h``; every rank of a node has the same node phases in the same order).
    Buffers: ``"send"`` (recvbuf in place), ``"recv"``, ``"tmp"`` (the op's scratch)."""
    coll: str           # "allreduce", "reduce_scatter", "allgather", "bcast"
    src: str
    src_off: int        # elements
    dst: str
    dst_off: int
    count: int          # allreduce, bcast: elements; reduce_scatter, allgather: per node rank
    root: int = 0       # bcast: the node rank that sends


@dataclass(frozen=True)
class NetPhase:
    """The allreduce between nodes: steps on the communicator, in place on recvbuf."""
    steps: tuple
    tmp: int


@dataclass(frozen=True)
class LocalPhase:
    """``"copy_tmp"``: tmp[:cnt] -> recvbuf[off:]; ``"divide"``: recvbuf[off:off+cnt] /= p
    (AVG only; left out for the other ops)."""
    what: str
    off: int
    cnt: int


@lru_cache(maxsize=512)
def hierarchical_shm(p: int, rank: int, count: int, inplace: bool, layout=None,
                     split_from: int | None = None):
    """The phases of one rank's hierarchical allreduce over its node's segment: (phases, scratch
    elements).  Two forms, the same on every rank for a given count and layout:

    * below :data:`HIER_SHM_SPLIT_FROM` elements, or on nodes of different sizes: an shm
      allreduce inside the node (every node rank gets the node's sum), the node leaders'
      allreduce (recursive doubling or ring, as :func:`hierarchical`), an shm bcast from the
      leader;
    * from it, on nodes of k ranks each (n = count // k, t = count % k): the tail of t elements
      allreduced over shm, an shm reduce-scatter (node rank i gets the node's sum of block i, n
      elements), the allreduce between nodes of block i (and of the tail) among the ranks of
      node rank i, one per node, an shm allgather of the blocks.  In place, the reduce-scatter
      lands in scratch and is copied to block i (the shm reduction may not write the input of
      another block's rank order in place).

    AVG: the leader (first form) or each rank for its block and the tail (second form) divides
    after the allreduce between nodes, so the shm phases move final values.  count == 0: no
    phases.  `split_from` (None: :data:`HIER_SHM_SPLIT_FROM`) is where the second form starts
    (``bench/hierarchical_forms.py`` times each form at every size).
    """
    if split_from is None:
        split_from = HIER_SHM_SPLIT_FROM
    nodes = _nodes(p, layout)
    members = next(m for m in nodes if rank in m)
    i, k = members.index(rank), len(members)
    if count == 0:
        return (), 0
    src = "recv" if inplace else "send"
    b = _Builder(count, [0, count], True)          # a container for the steps between nodes
    if count >= split_from and k > 1 and len({len(m) for m in nodes}) == 1:
        n, t = divmod(count, k)
        group = [m[i] for m in nodes]
        phases = [NodePhase("allreduce", src, k * n, "recv", k * n, t)] if t else []
        phases.append(NodePhase("reduce_scatter", src, 0, "tmp" if inplace else "recv",
                                0 if inplace else i * n, n))
        if inplace:
            phases.append(LocalPhase("copy_tmp", i * n, n))
        _flat(b, group, rank, i * n, n, True)
        if t:
            _flat(b, group, rank, k * n, t, True)
        phases += [NetPhase(tuple(b.steps), b.tmp), LocalPhase("divide", i * n, n)]
        if t:
            phases.append(LocalPhase("divide", k * n, t))
        phases.append(NodePhase("allgather", "recv", i * n, "recv", 0, n))
        return tuple(phases), (n if inplace else 0)
    phases = [NodePhase("allreduce", src, 0, "recv", 0, count)]
    if i == 0:
        _flat(b, [m[0] for m in nodes], rank, 0, count, True)
        phases += [NetPhase(tuple(b.steps), b.tmp), LocalPhase("divide", 0, count)]
    phases.append(NodePhase("bcast", "recv", 0, "recv", 0, count, root=0))
    return tuple(phases), 0


def simulate_hierarchical_shm(inputs: list[np.ndarray], reduce, inplace: bool = False,
                              layout=None, divide=None):
    """Execute :func:`hierarchical_shm`'s phases of all ranks in numpy (for tests): returns each
    rank's result.  The node phases run as the shm protocols define them (reductions in node
    rank order); the steps between nodes through :func:`_run_steps` (deadlock and mismatch
    checked); ``divide(a)``, if given, is AVG's division.  Checks that the ranks of a node list
    the same node phases and that every rank's phases come in the same order of kinds."""
    p = len(inputs)
    count = inputs[0].size
    layout = None if layout is None else tuple(layout)
    nodes = _nodes(p, layout)
    plans = [hierarchical_shm(p, r, count, inplace, layout) for r in range(p)]
    bufs = []
    for r, x in enumerate(inputs):
        recv = x.copy() if inplace else np.zeros_like(x)
        bufs.append({"send": recv if inplace else x.copy(), "recv": recv,
                     "tmp": np.zeros(plans[r][1], x.dtype)})
    for node in nodes:                   # the node phases of a node's ranks must agree
        ref = [ph for ph in plans[node[0]][0] if isinstance(ph, NodePhase)]
        for r in node:
            got = [ph for ph in plans[r][0] if isinstance(ph, NodePhase)]
            if [(g.coll, g.count, g.root) for g in got] != [(f.coll, f.count, f.root) for f in ref]:
                raise AssertionError(f"rank {r}: node phases {got} differ from rank {node[0]}'s")
    # phase by phase, every rank at once: the node phases are collective in the node and the
    # steps between nodes pair ranks that have the same phases before them
    pos = [0] * p
    while any(pos[r] < len(plans[r][0]) for r in range(p)):
        for r in range(p):               # local phases need no peer
            while pos[r] < len(plans[r][0]) and isinstance(plans[r][0][pos[r]], LocalPhase):
                ph = plans[r][0][pos[r]]
                sl = slice(ph.off, ph.off + ph.cnt)
                if ph.what == "copy_tmp":
                    bufs[r]["recv"][sl] = bufs[r]["tmp"][:ph.cnt]
                elif divide is not None:
                    bufs[r]["recv"][sl] = divide(bufs[r]["recv"][sl])
                pos[r] += 1
        moved = False
        for node in nodes:               # node phases whose ranks are all there
            at = [plans[r][0][pos[r]] if pos[r] < len(plans[r][0]) else None for r in node]
            if any(not isinstance(ph, NodePhase) for ph in at):
                continue
            _node_collective(at, [bufs[r] for r in node], reduce)
            for r in node:
                pos[r] += 1
            moved = True
        if moved:
            continue
        # then the ranks at a step phase, together (their peers must all be there too)
        net = [r for r in range(p) if pos[r] < len(plans[r][0])
               and isinstance(plans[r][0][pos[r]], NetPhase)]
        if not net and any(pos[r] < len(plans[r][0]) for r in range(p)):
            raise AssertionError(f"hierarchical_shm: phases stuck at {pos}")
        sched = [plans[r][0][pos[r]].steps if r in net else () for r in range(p)]
        _run_steps("hierarchical_shm", sched, [b["recv"] for b in bufs],
                   [b["recv"] for b in bufs], reduce)
        for r in net:
            pos[r] += 1
    return [b["recv"] for b in bufs]


def _node_collective(phases, bufs, reduce):
    """One node phase on the node's ranks' buffers (numpy), reading everything before writing."""
    def acc(parts):
        out = parts[0].copy()
        for x in parts[1:]:
            out = reduce(out, x)
        return out

    ph0, k = phases[0], len(phases)
    ins = [b[ph.src][ph.src_off:ph.src_off + (ph.count * k if ph.coll == "reduce_scatter"
                                               else ph.count)].copy()
           for ph, b in zip(phases, bufs)]
    for i, (ph, b) in enumerate(zip(phases, bufs)):
        n = ph.count
        if ph.coll == "allreduce":
            out = acc(ins) if k > 1 else ins[0]
        elif ph.coll == "reduce_scatter":
            out = acc([x[i * n:(i + 1) * n] for x in ins]) if k > 1 else ins[0]
        elif ph.coll == "allgather":
            out = np.concatenate(ins)
        elif ph.coll == "bcast":
            out = ins[ph0.root]
        else:
            raise AssertionError(f"unknown node phase {ph.coll}")
        b[ph.dst][ph.dst_off:ph.dst_off + out.size] = out


# "hierarchical_p2p" is the point-to-point form by name; "hierarchical" runs it too where the
# nodes have no shared-memory segments (else hierarchical_shm's phases, below)
BUILDERS = {"recursive_doubling": recursive_doubling, "rabenseifner": rabenseifner, "ring": ring,
            "hierarchical": hierarchical, "hierarchical_p2p": hierarchical}
NEEDS_LAYOUT = ("hierarchical", "hierarchical_p2p")


@lru_cache(maxsize=512)
def build(algorithm: str, p: int, rank: int, count: int, inplace: bool, layout=None):
    """(steps, scratch elements) for one rank; cached.  ``layout`` (a tuple: per rank, its
    node) is used by the algorithms in :data:`NEEDS_LAYOUT` (None: one node)."""
    if algorithm in NEEDS_LAYOUT:
        steps, tmp = BUILDERS[algorithm](p, rank, count, inplace, layout)
    else:
        steps, tmp = BUILDERS[algorithm](p, rank, count, inplace)
    return tuple(steps), tmp


def simulate(algorithm: str, inputs: list[np.ndarray], reduce, inplace: bool = False,
             owned=None, layout=None):
    """Execute the schedules of all ranks in one process (for tests): returns each rank's result.

    ``reduce(a, b)`` is the element-wise op; ``owned(a)``, if given, is applied to a rank's
    owned block after its owned step (AVG's division).  Messages are matched per (source,
    dest) in order, as MPI does with one tag.  Raises if the schedules deadlock or mismatch.
    ``layout``: per rank, its node (for :data:`NEEDS_LAYOUT` algorithms).
    """
    p = len(inputs)
    count = inputs[0].size
    layout = None if layout is None else tuple(layout)
    sched = [build(algorithm, p, r, count, inplace, layout)[0] for r in range(p)]
    send = [x.copy() for x in inputs]
    recv = [x.copy() if inplace else np.full_like(x, 0) for x in inputs]
    if inplace:
        send = recv
    _run_steps(algorithm, sched, send, recv, reduce, owned)
    return recv


def _run_steps(algorithm, sched, send, recv, reduce, owned=None):
    """Execute every rank's step list `sched[r]` on its arrays send[r] and recv[r] (in place:
    the same array); raises if the schedules deadlock or mismatch."""
    p = len(sched)
    pos = [0] * p
    posted: dict[tuple[int, int], list[np.ndarray]] = {}
    phase = [0] * p  # 0: not yet sent this step, 1: sent, waiting for receive
    while any(pos[r] < len(sched[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if pos[r] >= len(sched[r]):
                continue
            st = sched[r][pos[r]]
            if phase[r] == 0:
                if st.copy_cnt:
                    sl = slice(st.copy_off, st.copy_off + st.copy_cnt)
                    recv[r][sl] = send[r][sl]
                if st.send_peer >= 0:
                    src = send[r] if st.send_src == FROM_SEND else recv[r]
                    data = src[st.send_off:st.send_off + st.send_cnt].copy()
                    posted.setdefault((r, st.send_peer), []).append(data)
                phase[r] = 1
                moved = True
            if st.recv_peer >= 0:
                q = posted.get((st.recv_peer, r))
                if not q:
                    continue
                data = q.pop(0)
                if data.size != st.recv_cnt:
                    raise AssertionError(f"rank {r} step {pos[r]}: got {data.size}, wants {st.recv_cnt}")
                sl = slice(st.recv_off, st.recv_off + st.recv_cnt)
                if st.recv_mode == RECV_INTO:
                    recv[r][sl] = data
                elif st.recv_mode == RECV_TMP_REDUCE:
                    src = send[r] if st.reduce_src == FROM_SEND else recv[r]
                    recv[r][sl] = reduce(src[sl], data)
                else:
                    recv[r][sl] = reduce(send[r][sl], data)
            if st.owned and owned is not None:
                sl = slice(st.recv_off, st.recv_off + st.recv_cnt)
                recv[r][sl] = owned(recv[r][sl])
            pos[r] += 1
            phase[r] = 0
            moved = True
        if not moved:
            raise AssertionError(f"{algorithm}: schedules deadlock at steps {pos}")
    if any(posted.values()):
        raise AssertionError(f"{algorithm}: unreceived messages {posted}")
