# One entry per host collective and point-to-point call (mpi4py's wrappers): every entry has the
# same shape:
#   1. what needs no buffer: the op code, the root, the algorithm's ready check ("shm": the
#      communicator usable and a segment, before the buffers, as always);
#   2. the message: one parser of msgbuffer.pxi;
#   3. the op kind from the algorithm: "mpi" the MPI library's own call (passthrough.pxi),
#      "shm" the shared-memory transport (shm.pxi), for allreduce also the schedules and
#      "auto" (Launcher.choose_for);
#   4. launch: Launcher.launch (blocking: run in the caller; else a Request), or run_shm.
# The HostBackend binds these methods as its own (backends/host.py), and the Communicator calls
# them directly for numpy arrays: no Python runs between a Communicator method and here.

import numpy as _np

cdef class HostCollectives:
    """The host-buffer calls of one communicator, over its Launcher.  Arguments as the
    HostBackend's (backends/base.py); `blocking` False returns a Request."""
    cdef readonly Launcher launcher
    cdef CommState state
    cdef public object timeout      # seconds a call waits (Communicator.timeout); None: below
    cdef dict auto_shm              # v-collective -> "auto" runs "shm" (shm_preferred)

    def __cinit__(self, Launcher launcher):
        self.launcher = launcher
        self.state = launcher.state
        self.timeout = None
        self.auto_shm = {}

    cpdef double wait_limit(self):
        """How long this communicator's calls wait, in seconds (-1.0: forever): its
        ``timeout``, else AL_HANG_TIMEOUT read at every call (config._hang_timeout; tests
        change it)."""
        t = self.timeout if self.timeout is not None else _config._hang_timeout
        return -1.0 if t is None else <double>t

    cdef bint shm(self, algorithm, str what, str shm_name) except -1:
        """Whether `what` runs over the segment: False for "mpi", True for "shm" where it has
        an shm form (`shm_name`, else None), after shm_ready (raises where there is no
        segment); the errors of other names."""
        if algorithm == "mpi":
            return False
        if shm_name is not None and algorithm == "shm":
            self.launcher.shm_ready(shm_name)
            return True
        _hooks.bad_collective_algorithm(what, algorithm)                 # raises
        return False

    cdef NativeOp new_op(self, int kind, str name, al_msg* m, int rop, int root):
        """The op `kind` of the message `m` (in place: no send buffer, MPI_IN_PLACE)."""
        cdef NativeOp o = NativeOp.__new__(NativeOp)
        init_op(o.op, self.state.c, kind, NULL if m.inplace else m.sp, m.rp, m.count, m.code,
                m.esize, rop)
        o.op.mpi.root = root
        o.name = name
        o.keep = (self.state, None, (msg_obj(m.s), msg_obj(m.r)))
        return o

    cdef object mpi_op(self, int kind, str name, al_msg* m, int rop, int root, bint blocking):
        """Launch the MPI pass-through op `kind` of the message `m`."""
        return self.launcher.launch(self.new_op(kind, name, m, rop, root), blocking,
                                    self.wait_limit(), "mpi")

    # ---------------------------------------------------------------- reductions
    def allreduce(self, sendbuf, recvbuf, op, str algorithm, bint blocking, min_ctas=None,
                  max_ctas=None):
        cdef al_msg m
        cdef Launcher L = self.launcher
        cdef int opcode = op_code(op)
        cdef str alg
        if min_ctas is not None or max_ctas is not None:
            _hooks.no_ctas()                                             # raises
        hold = parse_reduce(&m, sendbuf, recvbuf, opcode, 1, "one element per sendbuf element",
                            "sendbuf")
        alg = L.choose_for(algorithm, m.count * m.esize, m.esize)
        return self.run_allreduce(&m, opcode, alg, blocking)

    cdef object run_allreduce(self, al_msg* m, int opcode, str alg, bint blocking):
        """Launch the allreduce of the message `m` with the host algorithm `alg`."""
        cdef Launcher L = self.launcher
        cdef NativeOp o
        cdef char* sp = m.rp if m.inplace else m.sp
        if alg == "shm":
            o = build_allreduce(L, <intptr_t>sp, <intptr_t>m.rp, m.count, m.code, m.esize,
                                opcode, alg, m.inplace, None)
            return L.run_shm(o, blocking, self.wait_limit(), msg_obj(m.s), msg_obj(m.r))
        o = build_allreduce(L, <intptr_t>sp, <intptr_t>m.rp, m.count, m.code, m.esize, opcode,
                            alg, m.inplace, (msg_obj(m.s), msg_obj(m.r)))
        return L.launch(o, blocking, self.wait_limit(), alg)

    def reduce(self, sendbuf, recvbuf, op, root, bint blocking, algorithm="mpi"):
        """recvbuf matters at root only (None there: in place in sendbuf)."""
        cdef al_msg m
        cdef int r = parse_rank(self.state, root, "root"), opcode = op_code(op)
        cdef bint at_root = self.state.c.rank == r
        cdef NativeOp o
        self.shm(algorithm, "reduce", None)
        if at_root:
            hold = parse_reduce(&m, sendbuf, recvbuf, opcode, 1,
                                "one element per sendbuf element", "sendbuf")
        else:
            hold = parse_one(&m, sendbuf, "sendbuf", False, False, "sendbuf")
            check_op_for(opcode, m.code, <cnp.ndarray><object>m.s)
        o = self.new_op(K_REDUCE, "reduce", &m, opcode, r)
        result_avg(o, m.rp, m.count, opcode, at_root, self.state.c.size)
        return self.launcher.launch(o, blocking, self.wait_limit(), "mpi")

    def reduce_scatter(self, sendbuf, recvbuf, op, bint blocking, algorithm="mpi"):
        """Block reduce-scatter: rank i gets block i; recvbuf None: in place, the result in
        sendbuf[:len // size]."""
        cdef al_msg m
        cdef int opcode = op_code(op), p = self.state.c.size
        cdef NativeOp o
        cdef bint shm = self.shm(algorithm, "reduce_scatter", "reduce_scatter/shm")
        hold = parse_reduce(&m, sendbuf, recvbuf, opcode, p, "len(sendbuf) // size", "recvbuf")
        if shm:
            o = self.launcher.shm_op(K_SHM_REDUCE_SCATTER, "reduce_scatter/shm", m.sp, m.rp,
                                     m.count, m.code, m.esize, opcode, 0)
            result_avg(o, m.rp, m.count, opcode, True, p)
            return self.launcher.run_shm(o, blocking, self.wait_limit(), msg_obj(m.s),
                                         msg_obj(m.r))
        o = self.new_op(K_REDUCE_SCATTER, "reduce_scatter", &m, opcode, 0)
        result_avg(o, m.rp, m.count, opcode, True, p)
        return self.launcher.launch(o, blocking, self.wait_limit(), "mpi")

    # ---------------------------------------------------------------- scans
    def scan(self, sendbuf, recvbuf, op, bint blocking, algorithm="auto"):
        """MPI_Iscan: rank r gets the reduction of ranks 0..r's sendbufs (recvbuf None: in
        place in sendbuf).  AVG: that sum divided by r + 1."""
        return self.run_scan(K_SCAN, "scan", sendbuf, recvbuf, op, blocking, algorithm,
                             self.state.c.rank + 1)

    def exscan(self, sendbuf, recvbuf, op, bint blocking, algorithm="auto"):
        """MPI_Iexscan: rank r > 0 gets the reduction of ranks 0..r-1's sendbufs; rank 0's
        recvbuf (in place: sendbuf) is left untouched.  AVG: that sum divided by r."""
        return self.run_scan(K_EXSCAN, "exscan", sendbuf, recvbuf, op, blocking, algorithm,
                             self.state.c.rank)

    cdef object run_scan(self, int kind, str name, sendbuf, recvbuf, op, bint blocking,
                         algorithm, int ranks):
        """A scan whose result here reduces `ranks` ranks' inputs (AVG's divisor).  With none
        (exscan's rank 0) MPI's result is undefined and may be written: it goes to scratch, so
        the user's recvbuf stays untouched.  With one, MPI copies the input there without a
        reduction, so LAND/LOR/LXOR results are made 0/1 (`logical01`)."""
        cdef al_msg m
        cdef int opcode = op_code(op)
        cdef NativeOp o
        cdef char* sp
        cdef char* rp
        cdef cnp.ndarray scratch = None
        if algorithm != "auto" and algorithm != "mpi":
            _hooks.mpi_only(name, algorithm)                             # raises
        hold = parse_reduce(&m, sendbuf, recvbuf, opcode, 1, "one element per sendbuf element",
                            "sendbuf")
        sp = NULL if m.inplace else m.sp
        rp = m.rp
        if ranks == 0:
            scratch = _np.empty_like(msg_obj(m.s))
            sp, rp = m.sp, <char*>cnp.PyArray_DATA(scratch)
        o = NativeOp.__new__(NativeOp)
        init_op(o.op, self.state.c, kind, sp, rp, m.count, m.code, m.esize, opcode)
        o.op.result.logical01 = ranks == 1
        if ranks:
            o.op.result.buf = rp
            o.op.result.count = m.count
            if opcode == AL_AVG and ranks > 1:
                o.op.result.avg_div = <double>ranks
        o.name = name
        o.keep = (self.state, None, (msg_obj(m.s), msg_obj(m.r), scratch))
        return self.launcher.launch(o, blocking, self.wait_limit(), "mpi")

    # ---------------------------------------------------------------- data movement
    def allgather(self, sendbuf, recvbuf, bint blocking, algorithm="mpi"):
        """Every rank's sendbuf, in rank order; recvbuf None: in place (sendbuf holds size
        blocks, this rank's at block `rank`)."""
        cdef al_msg m
        cdef int p = self.state.c.size
        cdef NativeOp o
        cdef bint shm = self.shm(algorithm, "allgather", "allgather/shm")
        hold = parse_blocks(&m, sendbuf, recvbuf, p, p, "size * len(sendbuf)")
        if not shm:
            return self.mpi_op(K_ALLGATHER, "allgather", &m, 0, 0, blocking)
        if m.inplace:                           # the shm op reads this rank's own block
            m.sp = m.rp + self.state.c.rank * m.count * m.esize
        o = self.launcher.shm_op(K_SHM_ALLGATHER, "allgather/shm", m.sp, m.rp, m.count, m.code,
                                 m.esize, 0, 0)
        return self.launcher.run_shm(o, blocking, self.wait_limit(), msg_obj(m.s), msg_obj(m.r))

    def alltoall(self, sendbuf, recvbuf, bint blocking, algorithm="mpi"):
        """Block j of sendbuf goes to rank j; recvbuf None: in place.  "auto": "shm" where the
        communicator has a segment and algorithms.shm_preferred says so for this size (the
        same on every rank: every rank's blocks have one size), else "mpi"."""
        cdef al_msg m
        cdef int p = self.state.c.size
        cdef bint shm
        if algorithm == "auto":
            hold = parse_blocks(&m, sendbuf, recvbuf, p, 1, "len(sendbuf)")
            shm = ((self.state.c.shm != NULL or p == 1)
                   and _hooks.shm_preferred("alltoall", m.count * m.esize * p, p))
        else:
            shm = self.shm(algorithm, "alltoall", "alltoall/shm")
            hold = parse_blocks(&m, sendbuf, recvbuf, p, 1, "len(sendbuf)")
        if not shm:
            return self.mpi_op(K_ALLTOALL, "alltoall", &m, 0, 0, blocking)
        self.launcher.shm_ready("alltoall/shm")
        return run_shm_alltoall(self.launcher, &m, blocking, self.wait_limit())

    # ---------------------------------------------------------------- v-collectives
    cdef bint vshm(self, str what, algorithm) except -1:
        """Whether the v-collective `what` (allgatherv, alltoallv) runs over the segment:
        "mpi" no, "shm" yes (after shm_ready: raises where there is no segment), "auto" where
        the communicator has a segment (or one rank) and algorithms.shm_preferred says so (it
        ignores the counts: the same on every rank); the errors of other names."""
        cdef int p = self.state.c.size
        if algorithm == "mpi":
            return False
        if algorithm == "auto":
            if self.state.c.shm == NULL and p != 1:
                return False
            if what not in self.auto_shm:
                self.auto_shm[what] = bool(_hooks.shm_preferred(what, 0, p))
            if not self.auto_shm[what]:
                return False
        elif algorithm != "shm":
            _hooks.v_algorithm(what, algorithm)                         # raises
        self.launcher.shm_ready(what + "/shm")
        return True

    def allgatherv(self, sendbuf, recvbuf, counts, displs, bint blocking, algorithm="auto"):
        """Every rank's sendbuf into every rank's recvbuf, rank j's block (counts[j] elements)
        at displs[j] (None: packed); sendbuf None: in place, this rank's block already there.
        Counts and displacements as the user gives them (lists, arrays: parse_vlayout)."""
        cdef al_msg m
        cdef Launcher L = self.launcher
        cdef int p = self.state.c.size
        cdef NativeOp o
        cdef bint shm = self.vshm("allgatherv", algorithm)
        rc, rd, hold = parse_vgather(&m, sendbuf, recvbuf, counts, displs, p, self.state.c.rank,
                                     "Allgatherv")
        if shm:
            return run_shm_allgatherv(L, &m, rc, rd, blocking, self.wait_limit())
        if L.checker is not None:               # AL_CHECK: what it sends and expects per rank
            L.checker.expect_v(K_ALLGATHERV, _np.full(p, m.count, dtype=_np.int64), rc)
        o = vop(L, K_ALLGATHERV, "allgatherv", None if m.inplace else msg_obj(m.s),
                msg_obj(m.r), m.count, None, None, rc, rd, 0, 0)
        return L.launch(o, blocking, self.wait_limit(), "mpi")

    def gatherv(self, sendbuf, recvbuf, counts, displs, root, bint blocking,
                algorithm="auto"):
        """Every rank's sendbuf into root's recvbuf, rank j's block (counts[j] elements) at
        displs[j] (None: packed); recvbuf and the layout matter at the root only, where sendbuf
        None is in place (the root's block already there).  The MPI library's call."""
        cdef al_msg m
        cdef Launcher L = self.launcher
        cdef int p = self.state.c.size, me = self.state.c.rank
        cdef cnp.ndarray s
        cdef int64_t n
        cdef int at = parse_rank(self.state, root, "root")
        if algorithm != "mpi" and algorithm != "auto":
            _hooks.v_algorithm("gatherv", algorithm)                    # raises
        if me != at:
            if sendbuf is None:
                _hooks.required_off_root("sendbuf")                     # raises
            s = as_array(sendbuf, "sendbuf", False)
            n = cnp.PyArray_SIZE(s)
            check_count(n, "sendbuf")
            if L.checker is not None:       # AL_CHECK: what it sends and expects per rank
                L.checker.expect_v(K_GATHERV, vrow(p, at, n), vrow(p, at, -1))
            o = vop(L, K_GATHERV, "gatherv", s, None, n, None, None, None, None, at, 0)
            return L.launch(o, blocking, self.wait_limit(), "mpi")
        rc, rd, hold = parse_vgather(&m, sendbuf, recvbuf, counts, displs, p, me,
                                     "Gatherv at the root")
        if L.checker is not None:
            L.checker.expect_v(K_GATHERV, vrow(p, at, m.count), rc)
        o = vop(L, K_GATHERV, "gatherv", None if m.inplace else msg_obj(m.s), msg_obj(m.r),
                m.count, None, None, rc, rd, at, 0)
        return L.launch(o, blocking, self.wait_limit(), "mpi")

    def scatterv(self, sendbuf, recvbuf, counts, displs, root, bint blocking,
                 algorithm="auto"):
        """Block i of root's sendbuf (counts[i] elements at displs[i]; None: packed) into rank
        i's recvbuf, whose length is the count off the root; sendbuf and the layout matter at
        the root only, where recvbuf None is in place (the root's block stays in sendbuf).
        The MPI library's call."""
        cdef Launcher L = self.launcher
        cdef int p = self.state.c.size, me = self.state.c.rank
        cdef cnp.ndarray s, r = None
        cdef int64_t n
        cdef int at = parse_rank(self.state, root, "root")
        if algorithm != "mpi" and algorithm != "auto":
            _hooks.v_algorithm("scatterv", algorithm)                   # raises
        if me != at:
            if recvbuf is None:
                _hooks.required_off_root("recvbuf")                     # raises
            r = as_array(recvbuf, "recvbuf", True)
            n = cnp.PyArray_SIZE(r)
            check_count(n, "recvbuf")
            if L.checker is not None:
                L.checker.expect_v(K_SCATTERV, vrow(p, at, -1), vrow(p, at, n))
            o = vop(L, K_SCATTERV, "scatterv", None, r, n, None, None, None, None, at, 0)
            return L.launch(o, blocking, self.wait_limit(), "mpi")
        s = as_array(sendbuf, "sendbuf", False)
        dtype_code_of(s, "sendbuf")
        if recvbuf is not None:
            r = as_array(recvbuf, "recvbuf", True)
            same_dtype_of(s, r, "sendbuf", "recvbuf")
        sc, sd = parse_vlayout(counts, displs, p, "sendbuf", cnp.PyArray_SIZE(s), False)
        n = vints_data(sc)[at]
        if r is not None:
            if cnp.PyArray_SIZE(r) < n:
                _hooks.at_least(r, n, "recvbuf", f"sendcounts[{at}] (the root's block)")
            if overlap(s, r):
                _hooks.no_overlap(s, r, "sendbuf", "recvbuf", "pass recvbuf=None (or "
                                  "MPI.IN_PLACE) at the root for an in-place Scatterv")
        if L.checker is not None:
            L.checker.expect_v(K_SCATTERV, sc, vrow(p, at, n))
        o = vop(L, K_SCATTERV, "scatterv", s, r, n, sc, sd, None, None, at, 0)
        return L.launch(o, blocking, self.wait_limit(), "mpi")

    def reduce_scatterv(self, sendbuf, recvbuf, counts, op, bint blocking, algorithm="auto"):
        """Reduce_scatter with per-rank counts: sendbuf holds sum(counts) elements (exactly, as
        mpi4py requires), rank i gets counts[i] of the reduction.  In place: sendbuf None (the
        data in recvbuf, mpi4py's MPI.IN_PLACE form), recvbuf None or a recvbuf at sendbuf's
        address (the data in sendbuf); the result lands at the start of the data's buffer.
        The MPI library's call."""
        cdef Launcher L = self.launcher
        cdef int p = self.state.c.size, me = self.state.c.rank
        cdef cnp.ndarray s = None, r, data
        cdef str name = "sendbuf"
        cdef int opcode
        cdef int64_t n
        if algorithm != "mpi" and algorithm != "auto":
            _hooks.v_algorithm("reduce_scatter with recvcounts", algorithm)    # raises
        if sendbuf is None or recvbuf is None:
            if sendbuf is None and recvbuf is None:
                _hooks.in_place_without_data()                          # raises
            name = "recvbuf" if sendbuf is None else "sendbuf"
            r = data = as_array(recvbuf if sendbuf is None else sendbuf, name, True)
        else:
            s = data = as_array(sendbuf, "sendbuf", False)
            r = as_array(recvbuf, "recvbuf", True)
            same_dtype_of(s, r, "sendbuf", "recvbuf")
        opcode = op_code(op)
        check_op_for(opcode, dtype_code_of(data, name), data)
        rc, _ = parse_vlayout(counts, None, p, "recvbuf", MAX_COUNT, False)
        n = vtotal_of(rc)
        if cnp.PyArray_SIZE(data) != n:
            _hooks.vsame_count(data, n, name, "sum(recvcounts)")        # raises
        n = vints_data(rc)[me]
        if s is not None:
            if cnp.PyArray_SIZE(r) < n:
                _hooks.at_least(r, n, "recvbuf", f"recvcounts[{me}]")   # raises
            if overlap(s, r) and _hooks.no_partial_overlap(s, r, "sendbuf", "recvbuf"):
                s, r = None, s               # the same start: in place, as the block form
        if L.checker is not None:            # AL_CHECK: what it sends and expects per rank
            L.checker.expect_v(K_REDUCE_SCATTERV, rc.astype(_np.int64),
                               _np.full(p, n, dtype=_np.int64))
        return launch_reduce_scatterv(L, s, r, rc, opcode, blocking, self.wait_limit())

    def alltoallv_msg(self, sendbuf, recvbuf, scounts, sdispls, rcounts, rdispls,
                      bint blocking, algorithm):
        """Communicator.Alltoallv's arguments as the caller gave them (MPI.IN_PLACE, the
        list forms, the keywords), split here (vsplit) and run as alltoallv; NotImplemented,
        having done nothing, where a form or a buffer is not the usual numpy one (the
        Communicator then splits it in Python and picks the backend)."""
        cdef tuple s, r
        if sendbuf is _IN_PLACE:
            sendbuf = None
        s = vsplit(sendbuf, scounts, sdispls)
        r = vsplit(recvbuf, rcounts, rdispls)
        if s is None or r is None or type(r[0]) is not cnp.ndarray or (
                s[0] is not None and type(s[0]) is not cnp.ndarray):
            return NotImplemented
        return self.run_alltoallv(s[0], s[1], s[2], r[0], r[1], r[2], blocking, algorithm)

    def alltoallv(self, sendbuf, scounts, sdispls, recvbuf, rcounts, rdispls, bint blocking,
                  algorithm="auto"):
        """Block j of sendbuf (scounts[j] elements at sdispls[j]) to rank j, block i of recvbuf
        (rcounts[i] at rdispls[i]) from rank i; sendbuf None: in place (recvbuf's layout for
        both sides, no send layout)."""
        return self.run_alltoallv(sendbuf, scounts, sdispls, recvbuf, rcounts, rdispls, blocking,
                                  algorithm)

    cdef object run_alltoallv(self, sendbuf, scounts, sdispls, recvbuf, rcounts, rdispls,
                              bint blocking, algorithm):
        cdef al_msg m
        cdef Launcher L = self.launcher
        cdef NativeOp o
        cdef bint shm = self.vshm("alltoallv", algorithm)
        sc, sd, rc, rd, hold = parse_alltoallv(&m, sendbuf, scounts, sdispls, recvbuf, rcounts,
                                               rdispls, self.state.c.size, self.state.c.rank)
        if shm:
            return run_shm_alltoallv(L, &m, sc, sd, rc, rd, blocking, self.wait_limit())
        if L.checker is not None:
            L.checker.expect_v(K_ALLTOALLV, rc if sc is None else sc, rc)
        o = vop(L, K_ALLTOALLV, "alltoallv", None if m.inplace else msg_obj(m.s), msg_obj(m.r),
                m.count, sc, sd, rc, rd, 0, 0)
        return L.launch(o, blocking, self.wait_limit(), "mpi")

    def bcast(self, buf, root, bint blocking, algorithm="mpi"):
        cdef al_msg m
        cdef int r = parse_rank(self.state, root, "root")
        cdef NativeOp o
        cdef bint shm = self.shm(algorithm, "bcast", "bcast/shm")
        hold = parse_one(&m, buf, "buf", self.state.c.rank != r, True, "buf")
        if not shm:
            return self.mpi_op(K_BCAST, "bcast", &m, 0, r, blocking)
        o = self.launcher.shm_op(K_SHM_BCAST, "bcast/shm", m.rp, m.rp, m.count, m.code, m.esize,
                                 0, r)
        return self.launcher.run_shm(o, blocking, self.wait_limit(), msg_obj(m.r), None)

    def gather(self, sendbuf, recvbuf, root, bint blocking, algorithm="mpi"):
        """Every rank's sendbuf at root, in rank order; recvbuf matters at root only (None
        there: in place, sendbuf holds size blocks, root's own at block `root`)."""
        cdef al_msg m
        cdef int r = parse_rank(self.state, root, "root")
        self.shm(algorithm, "gather", None)
        if self.state.c.rank == r:
            hold = parse_blocks(&m, sendbuf, recvbuf, self.state.c.size, self.state.c.size,
                                "size * len(sendbuf)")
        else:
            hold = parse_one(&m, sendbuf, "sendbuf", False, False, "count")
        return self.mpi_op(K_GATHER, "gather", &m, 0, r, blocking)

    def scatter(self, sendbuf, recvbuf, root, bint blocking, algorithm="mpi"):
        """Block i of root's sendbuf to rank i's recvbuf (its length sets the count off root);
        at root recvbuf None: in place, root's block stays in sendbuf."""
        cdef al_msg m
        cdef int r = parse_rank(self.state, root, "root")
        self.shm(algorithm, "scatter", None)
        if self.state.c.rank == r:
            hold = parse_scatter(&m, sendbuf, recvbuf, self.state.c.size)
            m.inplace = False                   # MPI_IN_PLACE is the receive side's here
        else:
            if recvbuf is None:
                _hooks.required("recvbuf", "on non-root ranks")          # raises
            hold = parse_one(&m, recvbuf, "recvbuf", True, True, "count")
            m.sp = m.rp                         # not read off root
        return self.mpi_op(K_SCATTER, "scatter", &m, 0, r, blocking)

    def barrier(self, bint blocking, algorithm="mpi"):
        cdef NativeOp o
        if self.shm(algorithm, "barrier", "barrier/shm"):
            o = self.launcher.shm_op(K_SHM_BARRIER, "barrier/shm", NULL, NULL, 0, 0, 1, 0, 0)
            return self.launcher.run_shm(o, blocking, self.wait_limit(), None, None)
        o = NativeOp.__new__(NativeOp)
        init_op(o.op, self.state.c, K_BARRIER, NULL, NULL, 0, 0, 1, 0)
        o.name = "barrier"
        o.keep = (self.state, None, None)
        return self.launcher.launch(o, blocking, self.wait_limit(), "mpi")

    # ---------------------------------------------------------------- point to point
    def send(self, buf, dest, tag, bint blocking):
        cdef al_msg m
        cdef int d = parse_rank(self.state, dest, "dest")
        hold = parse_one(&m, buf, "buf", False, False, "buf")
        return self.p2p_op(K_SEND, "send", &m, d, 0, 0, parse_tag(tag, False), 0, blocking)

    def recv(self, buf, source, tag, bint blocking):
        """Blocking: the receive's aluminum_py.Status; else a Request (its Wait and Test fill
        one)."""
        cdef al_msg m
        cdef int s = parse_source(self.state, source)
        hold = parse_one(&m, buf, "buf", True, True, "buf")
        t = parse_tag(tag, True)
        return self.p2p_op(K_RECV, "recv", &m, s, 0, 0, t, t, blocking)

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag, bint blocking, recvtag=None,
                 sendtag=None):
        """`tag` is the send's tag and the receive's, unless `sendtag` / `recvtag` (ANY_TAG
        allowed) are given. Returns as recv."""
        cdef al_msg m
        cdef int d = parse_rank(self.state, dest, "dest"), s = parse_source(self.state, source)
        cdef int stag, rtag
        hold = parse_pair(&m, sendbuf, recvbuf, "Sendrecv needs separate send and receive buffers")
        stag = parse_tag(tag, False) if sendtag is None else parse_tag(sendtag, False, "sendtag")
        rtag = (parse_tag(tag, sendtag is not None) if recvtag is None
                else parse_tag(recvtag, True, "recvtag"))
        return self.p2p_op(K_SENDRECV, "sendrecv", &m, d, s,
                           cnp.PyArray_SIZE(<cnp.ndarray><object>m.r), stag, rtag, blocking)

    cdef object p2p_op(self, int kind, str name, al_msg* m, int peer, int peer2, int64_t count2,
                       int tag, int tag2, bint blocking):
        """Launch the point-to-point op `kind` of `m` with `peer` (a sendrecv: and `peer2`,
        receiving `count2` elements with `tag2`); a blocking receive returns its Status."""
        cdef NativeOp o = self.new_op(kind, name, m, 0, peer)
        o.op.mpi.peer2 = peer2
        o.op.mpi.count2 = count2
        o.op.tag = tag
        o.op.mpi.tag2 = tag2
        done = self.launcher.launch(o, blocking, self.wait_limit(), "mpi")
        if blocking and kind != K_SEND:
            return _hooks.status_of(o)
        return done


# The allreduce op of an algorithm: the allreduce entry's, and the inner op of a host-transfer
# allreduce (ht_op.pxi).
cdef NativeOp build_allreduce(Launcher L, intptr_t sp, intptr_t rp, Py_ssize_t count, int code,
                              int esize, int opcode, str alg, bint inplace, keep):
    """One allreduce op on checked buffers (addresses; sp == rp in place).  Its `keep` is
    set, except for "shm" (run_shm sets it when the op leaves the caller)."""
    cdef NativeOp o
    cdef Schedule sched
    if alg == "shm":
        L.shm_ready("allreduce/shm")
        o = L.shm_op(K_SHM_ALLREDUCE, "allreduce/shm", <char*>sp, <char*>rp, count, code,
                     esize, opcode, 0)
        o.op.result.buf = <char*>rp
        o.op.result.count = count
        if opcode == AL_AVG:
            o.op.result.avg_div = <double>L.state.c.size
        o.op.result.avg_in_steps = L.state.c.size > 1    # AVG fused in the last pass
        return o
    o = NativeOp.__new__(NativeOp)
    if unusual(L.state):                                 # before next_tag
        L.state.check_usable("allreduce/" + alg)
    init_op(o.op, L.state.c, K_SCHEDULE, <char*>sp, <char*>rp, count, code, esize, opcode)
    o.op.result.buf = <char*>rp
    o.op.result.count = count
    if opcode == AL_AVG:
        o.op.result.avg_div = <double>L.state.c.size
    if alg == "mpi":
        o.op.kind = K_ALLREDUCE
        o.op.sbuf = NULL if inplace else <char*>sp
        o.name = "allreduce/mpi"
        o.keep = (L.state, None, keep)
    elif alg == "hierarchical" and L.hierarchical is not None:
        return L.hierarchical(sp, rp, count, code, esize, opcode, inplace, keep)
    else:
        sched = L.schedule(alg, count, inplace)
        o.op.tag = L.state.next_tag()
        o.op.sched.steps = sched.steps
        o.op.sched.nsteps = sched.nsteps
        o.op.result.avg_in_steps = sched.owned
        o.op.sched.tmpbytes = <size_t>(sched.tmp_elems * esize)
        o.name = "allreduce/" + alg
        o.keep = (L.state, sched, keep)
    return o


cdef inline void result_avg(NativeOp o, char* rp, int64_t count, int opcode, bint here,
                            int size) noexcept:
    """Where a reduction's result lands (`count` elements at rp), and AVG's division by the
    size where it lands `here`."""
    o.op.result.buf = rp
    o.op.result.count = count
    if opcode == AL_AVG and here:
        o.op.result.avg_div = <double>size
