# C declarations of the native core (cimported by _core.pyx, as mpi4py's MPI.pyx cimports
# libmpi.pxd): our C headers (al_reduce.h, al_device.h) and the system calls the engine uses.
# Declarations only: no code lives here.

from libc.stdint cimport int64_t, uint32_t, uint64_t
from posix.time cimport timespec

cdef extern from "al_reduce.h" nogil:
    # Codes shared with Python: _core exports them (core/constants.pxi) and aluminum_py.ops
    # reads them from there. Anonymous, as in core/types.pxi: they index C arrays.
    enum:                   # enum al_dtype
        AL_INT8, AL_INT16, AL_INT32, AL_INT64
        AL_UINT8, AL_UINT16, AL_UINT32, AL_UINT64
        AL_FLOAT16, AL_BFLOAT16, AL_FLOAT32, AL_FLOAT64
        AL_COMPLEX64, AL_COMPLEX128, AL_NDTYPES
    enum:                   # enum al_redop
        AL_SUM, AL_PROD, AL_MIN, AL_MAX, AL_LAND, AL_LOR, AL_LXOR
        AL_BAND, AL_BOR, AL_BXOR, AL_AVG, AL_NOPS
    int al_reduce(int dtype, int op, void* out, const void* a, const void* b, size_t n)
    int al_scale_div(int dtype, void* buf, size_t n, double divisor)
    int al_reduce_div(int dtype, void* out, const void* a, const void* b, size_t n, double divisor)
    int al_load_acquire(const int* p)
    void al_store_release(int* p, int v)
    int al_fetch_add(int* p, int v)
    int al_load_seqcst(const int* p)
    void al_store_seqcst(int* p, int v)
    double al_now()

cdef extern from "al_shm.h" nogil:
    # the shared-memory transport (ext/al_shm.h; its protocol is described there)
    enum:
        AL_SHM_PUT, AL_SHM_WAIT_IN, AL_SHM_WAIT_OUT, AL_SHM_END, AL_SHM_MAX_RANKS
        AL_SHM_ALLGATHER, AL_SHM_BCAST, AL_SHM_REDUCE_SCATTER, AL_SHM_BARRIER
        AL_SHM_MISMATCH, AL_SHM_ABANDONED, AL_SHM_REFUSED, AL_SHM_MISMATCHED
        AL_SHM_ALLGATHERV, AL_SHM_ALLTOALL, AL_SHM_ALLTOALLV, AL_SHM_COUNTS_DIFFER
        AL_SHM_COUNTS_EXPECTED, AL_SHM_COUNTS_ELSEWHERE, AL_SHM_DIED
    ctypedef struct al_shm_seg:
        char* base
        size_t len
        int rank, size
        size_t slot, small
        uint64_t seq, round, ops
        size_t chunk, chunk_upto
        uint64_t pidns
    ctypedef struct al_shm_op:
        int phase, split, stream
        int64_t off, chunk
        uint64_t want
        int waiting
        long polls
        uint64_t fp, theirs
        int64_t end
        int nt
    ctypedef struct al_shm_args:
        int dtype, rop, esize
        const char* sbuf
        char* rbuf
        int64_t count
        double avg_div
        int coll, root
        const int* scounts
        const int* sdispls
        const int* rcounts
        const int* rdispls
    size_t al_shm_bytes(int size, size_t slot)
    int al_shm_header_check(const char* p, size_t len, int size, size_t slot, uint64_t nonce,
                            const char* what, char* err, size_t errlen)
    void al_shm_header_write(char* p, int size, size_t slot, uint64_t nonce)
    size_t al_shm_stream_bytes
    size_t al_shm_cache_bytes
    size_t AL_SHM_STREAM_BY_CACHE
    size_t al_shm_stream_from(int size) nogil
    int al_shm_slot_stores
    size_t AL_SHM_STREAM_SLOTS_FROM
    char* al_shm_create(const char* name, size_t len, int size, size_t slot, uint64_t nonce,
                        char* err, size_t errlen)
    char* al_shm_open(const char* name, size_t len, int size, size_t slot, uint64_t nonce,
                      char* err, size_t errlen)
    char* al_shm_create_memfd(const char* label, size_t len, int size, size_t slot,
                              uint64_t nonce, int* fd, int* unsupported, char* err, size_t errlen)
    char* al_shm_open_memfd(long pid, int fd, size_t len, int size, size_t slot, uint64_t nonce,
                            int* named_instead, char* err, size_t errlen)
    void al_shm_init(al_shm_seg*, char* base, size_t len, int rank, int size, size_t slot, size_t small)
    void al_shm_ident_write(char* base, int rank, uint64_t* pidns)
    int al_shm_dead_peer(al_shm_seg* s, const al_shm_op* o)
    void al_shm_mark_dead(al_shm_seg* s, int r)
    void al_shm_allreduce_begin(al_shm_seg*, al_shm_op*, const al_shm_args*)
    int al_shm_allreduce_advance(al_shm_seg*, al_shm_op*, const al_shm_args*)
    void al_shm_coll_begin(al_shm_seg*, al_shm_op*, const al_shm_args*)
    int al_shm_coll_advance(al_shm_seg*, al_shm_op*, const al_shm_args*)
    void al_shm_v_begin(al_shm_seg*, al_shm_op*, const al_shm_args*)
    int al_shm_allgatherv_advance(al_shm_seg*, al_shm_op*, const al_shm_args*)
    int al_shm_alltoall_advance(al_shm_seg*, al_shm_op*, const al_shm_args*)
    int64_t al_shm_a2a_cap(const al_shm_seg*, int esize, int v)
    size_t al_shm_vheader(int p)
    void al_shm_mark_broken(al_shm_seg*)
    void al_shm_mark_broken_why(al_shm_seg*, int why)
    int al_shm_broken_by(const al_shm_seg*)
    int al_shm_broken_why(const al_shm_seg*)
    void al_shm_fp_unpack(uint64_t fp, int* coll, int* dtype, int* rop, int* root,
                          int64_t* count, long* number)
    int shm_unlink(const char* name)
    int close(int fd)
    int munmap(void* addr, size_t len)

cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    int pthread_create(pthread_t*, void*, void* (*)(void*) noexcept nogil, void*)
    int pthread_join(pthread_t, void**)
    int pthread_mutex_init(pthread_mutex_t*, void*)
    int pthread_mutex_lock(pthread_mutex_t*)
    int pthread_mutex_unlock(pthread_mutex_t*)
    int pthread_cond_init(pthread_cond_t*, void*)
    int pthread_cond_signal(pthread_cond_t*)
    int pthread_cond_broadcast(pthread_cond_t*)
    int pthread_cond_wait(pthread_cond_t*, pthread_mutex_t*)
    int pthread_cond_timedwait(pthread_cond_t*, pthread_mutex_t*, const timespec*)

cdef extern from "al_device.h" nogil:
    ctypedef struct al_device:
        void* ctx
        int (*memcpy_async)(void*, void*, const void*, size_t, void*) noexcept nogil
        int (*event_create)(void*, void**) noexcept nogil
        int (*event_record)(void*, void*, void*) noexcept nogil
        int (*event_query)(void*, void*) noexcept nogil
        int (*event_destroy)(void*, void*) noexcept nogil
        int (*wait_value32)(void*, void*, uint32_t*, uint32_t) noexcept nogil
        int (*write_value32)(void*, void*, uint32_t*, uint32_t) noexcept nogil
        int (*host_alloc)(void*, size_t, void**) noexcept nogil
        int (*host_free)(void*, void*) noexcept nogil
        int (*synchronize)(void*) noexcept nogil
        int (*mem_alloc_async)(void*, size_t, void*, void**) noexcept nogil
        int (*mem_free_async)(void*, void*, void*) noexcept nogil
        int (*stream_create)(void*, void**) noexcept nogil
        int (*stream_destroy)(void*, void*) noexcept nogil
        int (*stream_wait_event)(void*, void*, void*) noexcept nogil
        void (*describe)(void*, int, char*, size_t) noexcept nogil
        size_t pool_cached
        long pool_allocs, pool_reuses, pool_out
    ctypedef struct al_cpu_trace:
        int kind
        double t
        const void* p
    ctypedef struct al_cpu_ctx:
        al_cpu_trace* trace
        long ntrace
        int strict, queues, nstreams
        long pinned_live, sync_waits
    ctypedef struct al_cpu_stream:
        long executed
    int al_pinned_get(al_device*, size_t, void**)
    void al_pinned_put(al_device*, void*)
    int al_pinned_release(al_device*)
    al_device* al_cpu_device_new_strict(int strict, int queues)
    al_device* al_cuda_device_new(const char* path, int ordinal, char* err, size_t errlen)
    int al_cuda_current_device(const char* path, int* ordinal, char* err, size_t errlen)
    int al_cuda_device_count(const char* path, int* count, char* err, size_t errlen)
    void al_cuda_mark_engine_thread()
    int al_cpu_stream_sync(al_cpu_stream*, double)
    int al_cpu_memcpy_async(void*, void*, const void*, size_t, void*)
    int al_cpu_delay(void*, double)

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "<stdio.h>" nogil:
    int snprintf(char*, size_t, const char*, ...)

