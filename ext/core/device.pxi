cdef class Device:
    """A device behind the al_device interface (ext/al_device.h): streams and events are
    handles (ints). Failures raise aluminum_py.Error naming the call and the device's error
    (CUDA: the CUresult's name, number and text)."""
    cdef al_device* dev
    cdef readonly str kind

    cdef int fail(self, str call, int code) except -1:
        cdef char buf[256]
        buf[0] = 0
        self.dev.describe(self.dev.ctx, code, buf, sizeof(buf))
        where = "" if self.kind == "cuda" else f" ({self.kind} device)"
        _hooks.fail(f"{call} failed{where}: {(<bytes>buf).decode('utf-8', 'replace')}")
        return -1

    def stream_create(self):
        """A new stream (CUDA: non-blocking) as a handle."""
        cdef void* st = NULL
        cdef int rc
        with nogil:                     # as every device call (below)
            rc = self.dev.stream_create(self.dev.ctx, &st)
        if rc != 0:
            self.fail("cuStreamCreate", rc)
        return <uintptr_t>st

    def stream_destroy(self, uintptr_t stream):
        """Release `stream` once the work queued on it has run (CUDA: cuStreamDestroy returns
        at once; CPU: joins the worker thread). The handle is invalid afterwards."""
        cdef int rc
        with nogil:
            rc = self.dev.stream_destroy(self.dev.ctx, <void*>stream)
        if rc != 0:
            self.fail("cuStreamDestroy", rc)

    # Every device call releases the GIL: it may wait inside the driver (another thread in a
    # synchronizing call), and the thread that would unblock it may need the GIL.
    def event_create(self):
        cdef void* ev = NULL
        cdef int rc
        with nogil:
            rc = self.dev.event_create(self.dev.ctx, &ev)
        if rc != 0:
            self.fail("cuEventCreate", rc)
        return <uintptr_t>ev

    def event_record(self, uintptr_t ev, uintptr_t stream):
        cdef int rc
        with nogil:
            rc = self.dev.event_record(self.dev.ctx, <void*>ev, <void*>stream)
        if rc != 0:
            self.fail("cuEventRecord", rc)

    def event_query(self, uintptr_t ev):
        """True once the event's latest record has run."""
        cdef int q
        with nogil:
            q = self.dev.event_query(self.dev.ctx, <void*>ev)
        if q < 0:
            self.fail("cuEventQuery", -q)
        return q == 1

    def event_destroy(self, uintptr_t ev):
        with nogil:
            self.dev.event_destroy(self.dev.ctx, <void*>ev)

    def memcpy(self, uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream):
        """Enqueue a copy (device or pinned addresses) on `stream`."""
        cdef int rc
        with nogil:
            rc = self.dev.memcpy_async(self.dev.ctx, <void*>dst, <const void*>src, nbytes, <void*>stream)
        if rc != 0:
            self.fail("cuMemcpyAsync", rc)

    def alloc_async(self, size_t nbytes, uintptr_t stream):
        """Device memory of `nbytes` for the work queued on `stream` from now on
        (cuMemAllocAsync; returned by free_async on the same stream). Does not synchronize."""
        cdef void* p = NULL
        cdef int rc
        with nogil:
            rc = self.dev.mem_alloc_async(self.dev.ctx, nbytes, <void*>stream, &p)
        if rc != 0:
            self.fail("cuMemAllocAsync", rc)
        return <uintptr_t>p

    def free_async(self, uintptr_t ptr, uintptr_t stream):
        """Return memory from alloc_async once the work queued on `stream` so far has run
        (cuMemFreeAsync)."""
        cdef int rc
        with nogil:
            rc = self.dev.mem_free_async(self.dev.ctx, <void*>ptr, <void*>stream)
        if rc != 0:
            self.fail("cuMemFreeAsync", rc)

    def stream_wait_event(self, uintptr_t stream, uintptr_t ev):
        """Work queued on `stream` later waits for the event's latest record so far."""
        cdef int rc
        with nogil:
            rc = self.dev.stream_wait_event(self.dev.ctx, <void*>stream, <void*>ev)
        if rc != 0:
            self.fail("cuStreamWaitEvent", rc)

    def synchronize(self):
        """Wait (without the GIL) until every stream of the device is idle (cuCtxSynchronize)."""
        cdef int rc
        with nogil:
            rc = self.dev.synchronize(self.dev.ctx)
        if rc != 0:
            self.fail("cuCtxSynchronize", rc)

    def pinned_stats(self):
        """The pinned staging-buffer pool of host-transfer ops: {"allocs": buffers obtained
        from the driver, "reuses": buffers taken from the pool, "taken": buffers in use by ops,
        "cached_bytes": bytes in the pool}."""
        return {"allocs": self.dev.pool_allocs, "reuses": self.dev.pool_reuses,
                "taken": self.dev.pool_out, "cached_bytes": self.dev.pool_cached}

    def release_pinned(self):
        """Synchronize the device, then free the pool's cached pinned buffers (buffers taken by
        ops in flight stay theirs). Called by Communicator.Free when no host-transfer op is in
        flight on the device, and at exit; never on the progress engine's thread."""
        cdef int rc
        with nogil:
            rc = al_pinned_release(self.dev)
        if rc != 0:
            self.fail("releasing pinned memory (cuMemFreeHost)", rc)

    cdef int take_pinned(self, size_t nbytes, char** out) except -1:
        """A pinned buffer of at least nbytes from the pool; a new one is allocated (an
        implicitly synchronizing call) without the GIL, on this (the caller's) thread."""
        cdef void* p = NULL
        cdef int rc
        with nogil:
            rc = al_pinned_get(self.dev, nbytes, &p)
        if rc != 0:
            self.fail(f"allocating {nbytes} bytes of pinned memory (cuMemHostAlloc)", rc)
        out[0] = <char*>p
        return 0


cdef class CpuDevice(Device):
    """The CPU implementation of the device interface: streams are worker threads that run
    queued copies, event records and value waits/writes in order; "device memory" is host
    memory. It lets the host-transfer state machine run under real MPI ranks without a GPU.
    A device lives until the process exits; a stream until it is destroyed.

    ``strict=True`` adds what CUDA does that a careless caller can deadlock on or be serialized
    by: allocating and freeing pinned memory, and ``synchronize``, wait until every stream of
    the device has run what was queued on it; freeing a pointer that was not allocated as
    pinned memory fails; ``queues=k`` (> 0) makes the streams share k hardware queues (stream i
    on queue i % k, as CUDA_DEVICE_MAX_CONNECTIONS): a stream blocked on a flag stalls every
    stream on its queue."""
    cdef readonly bint strict
    cdef readonly int queues

    def __cinit__(self, bint strict=False, int queues=0):
        if queues < 0 or queues > 64:
            raise ValueError(f"queues: expected 0..64, got {queues}")
        if queues and not strict:
            raise ValueError("queues: hardware queues are modelled by the strict device only "
                             "(CpuDevice(strict=True, queues=k))")
        self.dev = al_cpu_device_new_strict(1 if strict else 0, queues)
        if self.dev == NULL:
            raise MemoryError()
        self.kind = "cpu"
        self.strict = strict
        self.queues = queues

    def stream(self):
        """A new stream as a CpuStream object (its `handle` is what stream_create returns)."""
        cdef CpuStream st = CpuStream.__new__(CpuStream)
        st.s = <al_cpu_stream*><uintptr_t>self.stream_create()
        st.device = self
        return st

    def trace(self):
        """Executed commands in order: (kind, time, address). Kinds: 'copy', 'record', 'wait',
        'write', 'wait_event', 'delay', 'free' / 'alloc' (a pinned buffer released /
        allocated), 'sync' (an implicit or explicit device synchronization finished)."""
        cdef al_cpu_ctx* c = <al_cpu_ctx*>self.dev.ctx
        names = {1: "copy", 2: "record", 3: "wait", 4: "write", 5: "hostfn", 7: "wait_event",
                 8: "delay", 100: "free", 101: "alloc", 102: "sync"}
        return [(names.get(c.trace[i].kind, str(c.trace[i].kind)), c.trace[i].t,
                 <uintptr_t>c.trace[i].p) for i in range(c.ntrace)]

    def strict_stats(self):
        """Device counters: {"streams": streams created so far, "pinned_live" (strict): pinned
        buffers allocated and not freed, "sync_waits" (strict): synchronizations (implicit ones
        included) that found a stream busy}."""
        cdef al_cpu_ctx* c = <al_cpu_ctx*>self.dev.ctx
        return {"streams": c.nstreams, "pinned_live": c.pinned_live, "sync_waits": c.sync_waits}


cdef class CudaDevice(Device):
    """The CUDA implementation of the device interface (driver API via dlopen of `library`:
    ``aluminum_py.config.cuda_driver()``, libcuda.so.1 or AL_CUDA_LIBRARY), for device
    `ordinal`; it retains the device's primary context. Raises UnavailableError without a
    driver or device."""
    cdef readonly int ordinal

    def __cinit__(self, int ordinal, str library):
        cdef char err[256]
        cdef bytes path = library.encode()
        err[0] = 0
        self.dev = al_cuda_device_new(path, ordinal, err, sizeof(err))
        if self.dev == NULL:
            _hooks.unavailable((<bytes>err).decode("utf-8", "replace"))
        self.kind = "cuda"
        self.ordinal = ordinal


def cuda_device_count(str library):
    """CUDA devices visible to this process, through the driver library `library`
    (``aluminum_py.config.cuda_driver()``): cuInit + cuDeviceGetCount only (no context is
    created or retained). 0 without a driver."""
    cdef char err[256]
    cdef int n = 0
    cdef bytes path = library.encode()
    err[0] = 0
    if al_cuda_device_count(path, &n, err, sizeof(err)) != 0:
        return 0
    return n


def cuda_current_device(str library):
    """The ordinal of the device of this thread's current CUDA context (cuCtxGetCurrent,
    cuCtxGetDevice; the driver library `library`: ``aluminum_py.config.cuda_driver()``), or
    None when no context is current. UnavailableError without a driver, aluminum_py.Error when
    a driver call fails."""
    cdef char err[256]
    cdef int ordinal = -1, rc
    cdef bytes path = library.encode()
    err[0] = 0
    rc = al_cuda_current_device(path, &ordinal, err, sizeof(err))
    if rc < 0:
        msg = (<bytes>err).decode("utf-8", "replace")
        if msg.startswith("no CUDA driver"):
            _hooks.unavailable(msg)
        _hooks.fail(msg)
    return ordinal if rc == 1 else None


cdef class CpuStream:
    """A CPU device stream (see CpuDevice)."""
    cdef al_cpu_stream* s
    cdef readonly CpuDevice device

    cdef al_cpu_stream* live(self) except NULL:
        if self.s == NULL:
            raise ValueError("the CPU stream has been destroyed")
        return self.s

    @property
    def handle(self):
        return <uintptr_t>self.live()

    def memcpy(self, uintptr_t dst, uintptr_t src, size_t nbytes):
        """Enqueue a copy (addresses) after everything already queued."""
        cdef al_cpu_stream* s = self.live()
        cdef int rc
        with nogil:
            rc = al_cpu_memcpy_async(self.device.dev.ctx, <void*>dst, <const void*>src, nbytes, s)
        if rc != 0:
            raise MemoryError()

    def wait_value32(self, uintptr_t addr, uint32_t value):
        """Enqueue a wait: the stream stops until the uint32 at `addr` is >= `value`."""
        cdef al_cpu_stream* s = self.live()
        cdef int rc
        with nogil:
            rc = self.device.dev.wait_value32(self.device.dev.ctx, s, <uint32_t*>addr, value)
        if rc != 0:
            raise MemoryError()

    def delay(self, double seconds):
        """Enqueue a command that keeps the stream busy for `seconds` (a long kernel)."""
        if al_cpu_delay(self.live(), seconds) != 0:
            raise MemoryError()

    def synchronize(self, double timeout=-1.0):
        """Wait until everything queued has run. Returns False on timeout."""
        cdef int rc
        cdef al_cpu_stream* s = self.live()
        with nogil:
            rc = al_cpu_stream_sync(s, timeout)
        return rc == 0

    def destroy(self):
        """Run what is queued, stop and join the worker thread, free the stream (idempotent)."""
        if self.s != NULL:
            h, self.s = <uintptr_t>self.s, NULL
            self.device.stream_destroy(h)

    @property
    def executed(self):
        return self.live().executed
