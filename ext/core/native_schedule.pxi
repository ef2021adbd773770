cdef class Schedule:
    """A native step array built from the pure-Python schedule (aluminum_py.schedules)."""
    cdef al_step* steps
    cdef readonly int nsteps
    cdef readonly int64_t tmp_elems
    cdef readonly bint owned         # some step marks this rank's owned block (see schedules)

    def __cinit__(self, steps, int64_t tmp_elems):
        cdef int i
        cdef al_step* s
        self.nsteps = len(steps)
        self.tmp_elems = tmp_elems
        self.owned = False
        self.steps = <al_step*>calloc(max(self.nsteps, 1), sizeof(al_step))
        if self.steps == NULL:
            raise MemoryError()
        for i, st in enumerate(steps):
            s = &self.steps[i]
            s.send_peer = st.send_peer
            s.send_src = st.send_src
            s.send_off = st.send_off
            s.send_cnt = st.send_cnt
            s.recv_peer = st.recv_peer
            s.recv_mode = st.recv_mode
            s.reduce_src = st.reduce_src
            s.recv_off = st.recv_off
            s.recv_cnt = st.recv_cnt
            s.copy_off = st.copy_off
            s.copy_cnt = st.copy_cnt
            s.owned = st.owned
            self.owned = self.owned or st.owned

    def __dealloc__(self):
        free(self.steps)
