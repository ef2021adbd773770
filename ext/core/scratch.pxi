# Scratch buffers: a cache of freed buffers per power-of-two size class, so that a steady
# stream of ops (dozens in flight at once, e.g. one allreduce per gradient) reuses memory
# instead of faulting in fresh pages for every op.  Freed buffers form an intrusive list per
# class (the link is stored in the buffer); up to g_scratch_cap bytes stay cached.

DEF SCRATCH_MIN_SHIFT = 12          # smallest class: 4 KiB
DEF SCRATCH_SLACK_FROM = 16384      # classes from this size carry SCRATCH_SLACK bytes beyond
DEF SCRATCH_SLACK = 4096            # their size: a user may start up to a page into them
                                    # (sched_scratch places its scratch at a page offset)
DEF SCRATCH_CLASSES = 52            # up to 2**63 bytes
cdef void* g_scratch_free[SCRATCH_CLASSES]
cdef size_t g_scratch_cached = 0    # bytes held in the lists
cdef size_t g_scratch_cap = 256 << 20
cdef long g_scratch_allocs = 0      # buffers obtained from malloc
cdef long g_scratch_reuses = 0      # buffers taken from the cache
cdef pthread_mutex_t g_pool_lock
pthread_mutex_init(&g_pool_lock, NULL)
memset(g_scratch_free, 0, sizeof(g_scratch_free))

cdef inline int scratch_class(size_t nbytes) noexcept nogil:
    cdef int c = 0
    cdef size_t cap = (<size_t>1) << SCRATCH_MIN_SHIFT
    while cap < nbytes and c < SCRATCH_CLASSES - 1:
        cap <<= 1
        c += 1
    return c

cdef char* scratch_get(size_t nbytes, size_t* got) noexcept nogil:
    """A buffer of at least `nbytes` (its class size goes to *got; from SCRATCH_SLACK_FROM
    bytes SCRATCH_SLACK more can be used); NULL if out of memory."""
    global g_scratch_cached, g_scratch_allocs, g_scratch_reuses
    cdef int c = scratch_class(nbytes)
    cdef size_t size = (<size_t>1) << (c + SCRATCH_MIN_SHIFT)
    cdef void* p
    pthread_mutex_lock(&g_pool_lock)
    p = g_scratch_free[c]
    if p != NULL:
        g_scratch_free[c] = (<void**>p)[0]
        g_scratch_cached -= size
        g_scratch_reuses += 1
    else:
        g_scratch_allocs += 1
    pthread_mutex_unlock(&g_pool_lock)
    if p == NULL:
        p = malloc(size + (SCRATCH_SLACK if size >= SCRATCH_SLACK_FROM else 0))
    got[0] = size
    return <char*>p

cdef void scratch_put(char* p, size_t nbytes) noexcept nogil:
    """Return a buffer from scratch_get (`nbytes` = its *got): cached, or freed over the cap."""
    global g_scratch_cached
    cdef int c = scratch_class(nbytes)
    if p == NULL:
        return
    pthread_mutex_lock(&g_pool_lock)
    if g_scratch_cached + nbytes <= g_scratch_cap:
        (<void**>p)[0] = g_scratch_free[c]
        g_scratch_free[c] = <void*>p
        g_scratch_cached += nbytes
        p = NULL
    pthread_mutex_unlock(&g_pool_lock)
    free(p)

def set_scratch_cache(size_t nbytes):
    """Bytes of freed scratch buffers kept for reuse (AL_SCRATCH_CACHE); what is cached above
    it now is freed."""
    global g_scratch_cap, g_scratch_cached
    cdef int c
    cdef void* p
    with nogil:
        pthread_mutex_lock(&g_pool_lock)
        g_scratch_cap = nbytes
        c = SCRATCH_CLASSES - 1
        while g_scratch_cached > g_scratch_cap and c >= 0:
            p = g_scratch_free[c]
            if p == NULL:
                c -= 1
                continue
            g_scratch_free[c] = (<void**>p)[0]
            g_scratch_cached -= (<size_t>1) << (c + SCRATCH_MIN_SHIFT)
            free(p)
        pthread_mutex_unlock(&g_pool_lock)

def _scratch_roundtrip(sizes):
    """Test hook: take a scratch buffer of each size (bytes) at once, then return them all."""
    cdef list held = []
    cdef size_t got
    cdef char* p
    for n in sizes:
        p = scratch_get(<size_t>n, &got)
        if p == NULL:
            raise MemoryError()
        held.append((<uintptr_t>p, got))
    for addr, got in held:
        scratch_put(<char*><uintptr_t>addr, got)

def scratch_stats():
    """{'allocs': buffers malloc'd, 'reuses': taken from the cache, 'cached': bytes held}."""
    return {"allocs": g_scratch_allocs, "reuses": g_scratch_reuses, "cached": g_scratch_cached}
