/* The small device interface the host-transfer state machine is written against, and its CPU
 * implementation (streams are worker threads executing queued commands in order), used to test
 * the state machine's ordering under real MPI ranks without a GPU.  A CUDA implementation
 * (driver API) provides the same functions.  All functions are callable without the GIL.
 *
 * Semantics (as CUDA's):
 *   memcpy_async   enqueue a copy on the stream
 *   event_record   enqueue "mark the event complete"; event_query returns 1 once it ran
 *   wait_value32   the stream stops until *addr >= value (cuStreamWaitValue32, GEQ)
 *   write_value32  enqueue *addr = value
 *   host_alloc     pinned host memory (here: malloc)
 *   stream_create  a new stream (CUDA: non-blocking); stream_destroy releases it once the work
 *                  queued on it has run (CUDA: cuStreamDestroy returns at once; CPU: joins)
 *   stream_wait_event  the stream waits for the event's latest record at the time of the call
 *                  (the event may be destroyed right after, as in CUDA)
 */
#ifndef AL_DEVICE_H
#define AL_DEVICE_H
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <dlfcn.h>
#include <stdio.h>

typedef struct al_device {
  void *ctx;
  int (*memcpy_async)(void *ctx, void *dst, const void *src, size_t n, void *stream);
  int (*event_create)(void *ctx, void **ev);
  int (*event_record)(void *ctx, void *ev, void *stream);
  int (*event_query)(void *ctx, void *ev);          /* 1 complete, 0 pending, < 0 error */
  int (*event_destroy)(void *ctx, void *ev);
  int (*wait_value32)(void *ctx, void *stream, volatile uint32_t *addr, uint32_t value);
  int (*write_value32)(void *ctx, void *stream, volatile uint32_t *addr, uint32_t value);
  void *(*host_alloc)(void *ctx, size_t n);
  void (*host_free)(void *ctx, void *p);
  int (*stream_create)(void *ctx, void **stream);
  int (*stream_destroy)(void *ctx, void *stream);
  int (*stream_wait_event)(void *ctx, void *stream, void *ev);
} al_device;

/* Fill every entry of an al_device from the implementation's functions PREFIX##name, so that
 * each implementation provides the whole interface and a new entry is added in one place. */
#define AL_DEVICE_FILL(d, PREFIX) do {                                                   \
    (d)->memcpy_async = PREFIX##memcpy_async; (d)->event_create = PREFIX##event_create;     \
    (d)->event_record = PREFIX##event_record; (d)->event_query = PREFIX##event_query;       \
    (d)->event_destroy = PREFIX##event_destroy; (d)->wait_value32 = PREFIX##wait_value32;   \
    (d)->write_value32 = PREFIX##write_value32; (d)->host_alloc = PREFIX##host_alloc;       \
    (d)->host_free = PREFIX##host_free; (d)->stream_create = PREFIX##stream_create;         \
    (d)->stream_destroy = PREFIX##stream_destroy;                                           \
    (d)->stream_wait_event = PREFIX##stream_wait_event;                                     \
  } while (0)

/* ------------------------------------------------------------------ CPU implementation */
enum { AL_CMD_MEMCPY = 1, AL_CMD_RECORD, AL_CMD_WAIT, AL_CMD_WRITE, AL_CMD_HOSTFN, AL_CMD_STOP,
       AL_CMD_WAIT_EVENT, AL_CMD_DELAY };

/* An event: `recorded` counts the records enqueued, `completed` is the number of the last one
 * executed; complete when they are equal (an event never recorded is complete, as in CUDA).
 * `refs`: the owner's reference plus one per queued command that uses the event, so that
 * destroying it with a record or wait still queued is safe (CUDA frees it once they ran). */
typedef struct al_cpu_event { unsigned long recorded, completed; int refs; double t_done; } al_cpu_event;

typedef struct al_cmd {
  int kind;
  void *dst; const void *src; size_t n;
  al_cpu_event *ev; unsigned long gen;
  volatile uint32_t *addr; uint32_t value;
  double secs;
  void (*fn)(void *); void *arg;
  struct al_cmd *next;
} al_cmd;

typedef struct al_cpu_stream {
  pthread_t thread;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  al_cmd *head, *tail;
  int busy;                       /* a command is executing */
  long executed;
} al_cpu_stream;

typedef struct al_cpu_trace { int kind; double t; const void *p; } al_cpu_trace;

typedef struct al_cpu_ctx {
  pthread_mutex_t lock;
  al_cpu_trace *trace; long ntrace, cap;   /* executed commands and frees, in order */
} al_cpu_ctx;

static double al_dev_now(void) {
  struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void al_cpu_log(al_cpu_ctx *c, int kind, const void *p) {
  pthread_mutex_lock(&c->lock);
  if (c->ntrace == c->cap) {
    long cap = c->cap ? 2 * c->cap : 1024;
    al_cpu_trace *t = (al_cpu_trace *)realloc(c->trace, (size_t)cap * sizeof(*t));
    if (t) { c->trace = t; c->cap = cap; }
  }
  if (c->ntrace < c->cap) {
    c->trace[c->ntrace].kind = kind; c->trace[c->ntrace].t = al_dev_now(); c->trace[c->ntrace].p = p;
    c->ntrace++;
  }
  pthread_mutex_unlock(&c->lock);
}

typedef struct { al_cpu_ctx *ctx; al_cpu_stream *s; } al_cpu_worker_arg;

static void al_cpu_event_unref(al_cpu_event *ev) {
  if (__atomic_sub_fetch(&ev->refs, 1, __ATOMIC_ACQ_REL) == 0) free(ev);
}

static void al_cpu_sleep(double secs) {
  struct timespec ts; ts.tv_sec = (time_t)secs; ts.tv_nsec = (long)((secs - (double)ts.tv_sec) * 1e9);
  nanosleep(&ts, NULL);
}

static void *al_cpu_worker(void *arg_) {
  al_cpu_worker_arg *arg = (al_cpu_worker_arg *)arg_;
  al_cpu_stream *s = arg->s; al_cpu_ctx *c = arg->ctx;
  free(arg);
  for (;;) {
    pthread_mutex_lock(&s->lock);
    while (!s->head) pthread_cond_wait(&s->cond, &s->lock);
    al_cmd *cmd = s->head;
    s->busy = 1;
    pthread_mutex_unlock(&s->lock);
    switch (cmd->kind) {
    case AL_CMD_MEMCPY: memcpy(cmd->dst, cmd->src, cmd->n); al_cpu_log(c, AL_CMD_MEMCPY, cmd->dst); break;
    case AL_CMD_RECORD: cmd->ev->t_done = al_dev_now();
      __atomic_store_n(&cmd->ev->completed, cmd->gen, __ATOMIC_RELEASE);
      al_cpu_log(c, AL_CMD_RECORD, cmd->ev); al_cpu_event_unref(cmd->ev); break;
    case AL_CMD_WAIT:
      while (__atomic_load_n(cmd->addr, __ATOMIC_ACQUIRE) < cmd->value) al_cpu_sleep(20e-6);
      al_cpu_log(c, AL_CMD_WAIT, (const void *)cmd->addr); break;
    case AL_CMD_WAIT_EVENT:
      while (__atomic_load_n(&cmd->ev->completed, __ATOMIC_ACQUIRE) < cmd->gen) al_cpu_sleep(20e-6);
      al_cpu_log(c, AL_CMD_WAIT_EVENT, cmd->ev); al_cpu_event_unref(cmd->ev); break;
    case AL_CMD_DELAY: al_cpu_sleep(cmd->secs); al_cpu_log(c, AL_CMD_DELAY, NULL); break;
    case AL_CMD_WRITE: __atomic_store_n(cmd->addr, cmd->value, __ATOMIC_RELEASE);
      al_cpu_log(c, AL_CMD_WRITE, (const void *)cmd->addr); break;
    case AL_CMD_HOSTFN: cmd->fn(cmd->arg); al_cpu_log(c, AL_CMD_HOSTFN, cmd->arg); break;
    default: break;
    }
    int stop = cmd->kind == AL_CMD_STOP;
    pthread_mutex_lock(&s->lock);
    s->head = cmd->next;
    if (!s->head) s->tail = NULL;
    s->busy = 0;
    s->executed++;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
    free(cmd);
    if (stop) return NULL;
  }
}

static int al_cpu_push(al_cpu_stream *s, al_cmd *cmd) {
  cmd->next = NULL;
  pthread_mutex_lock(&s->lock);
  if (s->tail) s->tail->next = cmd; else s->head = cmd;
  s->tail = cmd;
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
  return 0;
}

static al_cmd *al_cpu_cmd(int kind) { al_cmd *c = (al_cmd *)calloc(1, sizeof(al_cmd)); if (c) c->kind = kind; return c; }

static int al_cpu_memcpy_async(void *ctx, void *dst, const void *src, size_t n, void *stream) {
  al_cmd *c = al_cpu_cmd(AL_CMD_MEMCPY); if (!c) return -1;
  c->dst = dst; c->src = src; c->n = n; return al_cpu_push((al_cpu_stream *)stream, c);
}
static int al_cpu_event_create(void *ctx, void **ev) {
  al_cpu_event *e = (al_cpu_event *)calloc(1, sizeof(al_cpu_event));
  if (!e) return -1;
  e->refs = 1; *ev = e; return 0;
}
static int al_cpu_event_record(void *ctx, void *ev, void *stream) {
  al_cpu_event *e = (al_cpu_event *)ev;
  al_cmd *c = al_cpu_cmd(AL_CMD_RECORD); if (!c) return -1;
  c->ev = e; c->gen = __atomic_add_fetch(&e->recorded, 1, __ATOMIC_ACQ_REL);
  __atomic_add_fetch(&e->refs, 1, __ATOMIC_ACQ_REL);
  return al_cpu_push((al_cpu_stream *)stream, c);
}
static int al_cpu_event_query(void *ctx, void *ev) {
  al_cpu_event *e = (al_cpu_event *)ev;
  return __atomic_load_n(&e->completed, __ATOMIC_ACQUIRE) >= __atomic_load_n(&e->recorded, __ATOMIC_ACQUIRE);
}
static int al_cpu_event_destroy(void *ctx, void *ev) { al_cpu_event_unref((al_cpu_event *)ev); return 0; }
static int al_cpu_stream_wait_event(void *ctx, void *stream, void *ev) {
  al_cpu_event *e = (al_cpu_event *)ev;
  al_cmd *c = al_cpu_cmd(AL_CMD_WAIT_EVENT); if (!c) return -1;
  c->ev = e; c->gen = __atomic_load_n(&e->recorded, __ATOMIC_ACQUIRE);
  __atomic_add_fetch(&e->refs, 1, __ATOMIC_ACQ_REL);
  return al_cpu_push((al_cpu_stream *)stream, c);
}
/* A command that keeps the stream busy for `secs` (stands in for a long kernel in tests). */
static int al_cpu_delay(void *stream, double secs) {
  al_cmd *c = al_cpu_cmd(AL_CMD_DELAY); if (!c) return -1;
  c->secs = secs; return al_cpu_push((al_cpu_stream *)stream, c);
}
static int al_cpu_wait_value32(void *ctx, void *stream, volatile uint32_t *addr, uint32_t value) {
  al_cmd *c = al_cpu_cmd(AL_CMD_WAIT); if (!c) return -1;
  c->addr = addr; c->value = value; return al_cpu_push((al_cpu_stream *)stream, c);
}
static int al_cpu_write_value32(void *ctx, void *stream, volatile uint32_t *addr, uint32_t value) {
  al_cmd *c = al_cpu_cmd(AL_CMD_WRITE); if (!c) return -1;
  c->addr = addr; c->value = value; return al_cpu_push((al_cpu_stream *)stream, c);
}
static void *al_cpu_host_alloc(void *ctx, size_t n) { return malloc(n ? n : 1); }
static void al_cpu_host_free(void *ctx, void *p) {
  al_cpu_log((al_cpu_ctx *)ctx, 100, p);   /* kind 100: pinned buffer freed */
  free(p);
}

static al_cpu_stream *al_cpu_stream_new(al_cpu_ctx *ctx) {
  al_cpu_stream *s = (al_cpu_stream *)calloc(1, sizeof(al_cpu_stream));
  al_cpu_worker_arg *arg = (al_cpu_worker_arg *)malloc(sizeof(*arg));
  if (!s || !arg) { free(s); free(arg); return NULL; }
  pthread_mutex_init(&s->lock, NULL);
  pthread_cond_init(&s->cond, NULL);
  arg->ctx = ctx; arg->s = s;
  if (pthread_create(&s->thread, NULL, al_cpu_worker, arg) != 0) { free(s); free(arg); return NULL; }
  return s;
}

static int al_cpu_stream_create(void *ctx, void **stream) {
  *stream = al_cpu_stream_new((al_cpu_ctx *)ctx); return *stream ? 0 : -1;
}
/* Stop the worker after the commands queued so far, join it and free the stream. */
static int al_cpu_stream_destroy(void *ctx, void *stream) {
  al_cpu_stream *s = (al_cpu_stream *)stream;
  al_cmd *c = al_cpu_cmd(AL_CMD_STOP); if (!c) return -1;
  al_cpu_push(s, c);
  if (pthread_join(s->thread, NULL) != 0) return -1;
  pthread_mutex_destroy(&s->lock); pthread_cond_destroy(&s->cond);
  free(s);
  return 0;
}

static al_device *al_cpu_device_new(void) {
  al_device *d = (al_device *)calloc(1, sizeof(al_device));
  al_cpu_ctx *c = (al_cpu_ctx *)calloc(1, sizeof(al_cpu_ctx));
  if (!d || !c) { free(d); free(c); return NULL; }
  pthread_mutex_init(&c->lock, NULL);
  d->ctx = c;
  AL_DEVICE_FILL(d, al_cpu_);
  return d;
}

/* Block until every command queued so far has executed; timeout in seconds (< 0: forever).
 * Returns 0, or 1 on timeout. */
static int al_cpu_stream_sync(al_cpu_stream *s, double timeout) {
  double deadline = al_dev_now() + timeout;
  pthread_mutex_lock(&s->lock);
  while (s->head || s->busy) {
    if (timeout >= 0 && al_dev_now() > deadline) { pthread_mutex_unlock(&s->lock); return 1; }
    struct timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 1000000; if (ts.tv_nsec >= 1000000000) { ts.tv_sec++; ts.tv_nsec -= 1000000000; }
    pthread_cond_timedwait(&s->cond, &s->lock, &ts);
  }
  pthread_mutex_unlock(&s->lock);
  return 0;
}
#endif

/* ------------------------------------------------------------------ CUDA implementation
 * The driver API through dlopen("libcuda.so.1"): no link-time CUDA dependency. Device
 * pointers and host-mapped pinned memory share one address space (UVA), so cuMemcpyAsync
 * copies in either direction and the flag's host address is its device address. Every call
 * makes the device's primary context current first (the engine thread calls in too). */
typedef int al_CUresult;
typedef struct {
  void *lib;
  void *cuctx;
  al_CUresult (*cuInit)(unsigned int);
  al_CUresult (*cuDeviceGet)(int *, int);
  al_CUresult (*cuDeviceGetCount)(int *);
  al_CUresult (*cuDevicePrimaryCtxRetain)(void **, int);
  al_CUresult (*cuCtxSetCurrent)(void *);
  al_CUresult (*cuMemcpyAsync)(uintptr_t, uintptr_t, size_t, void *);
  al_CUresult (*cuEventCreate)(void **, unsigned int);
  al_CUresult (*cuEventRecord)(void *, void *);
  al_CUresult (*cuEventQuery)(void *);
  al_CUresult (*cuEventDestroy)(void *);
  al_CUresult (*cuStreamWaitValue32)(void *, uintptr_t, uint32_t, unsigned int);
  al_CUresult (*cuStreamWriteValue32)(void *, uintptr_t, uint32_t, unsigned int);
  al_CUresult (*cuStreamWaitEvent)(void *, void *, unsigned int);
  al_CUresult (*cuStreamCreate)(void **, unsigned int);
  al_CUresult (*cuStreamDestroy)(void *);
  al_CUresult (*cuMemHostAlloc)(void **, size_t, unsigned int);
  al_CUresult (*cuMemFreeHost)(void *);
} al_cuda_ctx;

#define AL_CU_EVENT_DISABLE_TIMING 0x2
#define AL_CU_STREAM_NON_BLOCKING 0x1
#define AL_CU_MEMHOSTALLOC_PORTABLE 0x1
#define AL_CU_MEMHOSTALLOC_DEVICEMAP 0x2
#define AL_CU_ERROR_NOT_READY 600

static int al_cuda_memcpy_async(void *ctx, void *dst, const void *src, size_t n, void *stream) {
  al_cuda_ctx *c = (al_cuda_ctx *)ctx; c->cuCtxSetCurrent(c->cuctx);
  return c->cuMemcpyAsync((uintptr_t)dst, (uintptr_t)src, n, stream) ? -1 : 0;
}
static int al_cuda_event_create(void *ctx, void **ev) {
  al_cuda_ctx *c = (al_cuda_ctx *)ctx; c->cuCtxSetCurrent(c->cuctx);
  return c->cuEventCreate(ev, AL_CU_EVENT_DISABLE_TIMING) ? -1 : 0;
}
static int al_cuda_event_record(void *ctx, void *ev, void *stream) {
  al_cuda_ctx *c = (al_cuda_ctx *)ctx; c->cuCtxSetCurrent(c->cuctx);
  return c->cuEventRecord(ev, stream) ? -1 : 0;
}
static int al_cuda_event_query(void *ctx, void *ev) {
  al_cuda_ctx *c = (al_cuda_ctx *)ctx; c->cuCtxSetCurrent(c->cuctx);
  al_CUresult r = c->cuEventQuery(ev);
  return r == 0 ? 1 : (r == AL_CU_ERROR_NOT_READY ? 0 : -r);
}
static int al_cuda_event_destroy(void *ctx, void *ev) {
  al_cuda_ctx *c = (al_cuda_ctx *)ctx; c->cuCtxSetCurrent(c->cuctx);
  return c->cuEventDestroy(ev) ? -1 : 0;
}
static int al_cuda_wait_value32(void *ctx, void *stream, volatile uint32_t *addr, uint32_t value) {
  al_cuda_ctx *c = (al_cuda_ctx *)ctx; c->cuCtxSetCurrent(c->cuctx);
  return c->cuStreamWaitValue32(stream, (uintptr_t)addr, value, 0 /* GEQ */) ? -1 : 0;
}
static int al_cuda_write_value32(void *ctx, void *stream, volatile uint32_t *addr, uint32_t value) {
  al_cuda_ctx *c = (al_cuda_ctx *)ctx; c->cuCtxSetCurrent(c->cuctx);
  return c->cuStreamWriteValue32(stream, (uintptr_t)addr, value, 0) ? -1 : 0;
}
static void *al_cuda_host_alloc(void *ctx, size_t n) {
  al_cuda_ctx *c = (al_cuda_ctx *)ctx; void *p = NULL; c->cuCtxSetCurrent(c->cuctx);
  if (c->cuMemHostAlloc(&p, n ? n : 1, AL_CU_MEMHOSTALLOC_PORTABLE | AL_CU_MEMHOSTALLOC_DEVICEMAP)) return NULL;
  return p;
}
static void al_cuda_host_free(void *ctx, void *p) {
  al_cuda_ctx *c = (al_cuda_ctx *)ctx; c->cuCtxSetCurrent(c->cuctx);
  c->cuMemFreeHost(p);
}
static int al_cuda_stream_create(void *ctx, void **stream) {
  al_cuda_ctx *c = (al_cuda_ctx *)ctx; c->cuCtxSetCurrent(c->cuctx);
  return c->cuStreamCreate(stream, AL_CU_STREAM_NON_BLOCKING) ? -1 : 0;
}
/* cuStreamDestroy_v2 returns at once; the driver releases the stream when its work is done. */
static int al_cuda_stream_destroy(void *ctx, void *stream) {
  al_cuda_ctx *c = (al_cuda_ctx *)ctx; c->cuCtxSetCurrent(c->cuctx);
  return c->cuStreamDestroy(stream) ? -1 : 0;
}
static int al_cuda_stream_wait_event(void *ctx, void *stream, void *ev) {
  al_cuda_ctx *c = (al_cuda_ctx *)ctx; c->cuCtxSetCurrent(c->cuctx);
  return c->cuStreamWaitEvent(stream, ev, 0) ? -1 : 0;
}

/* prefer the _v2 entry points (cuStreamWaitValue32_v2, cuEventDestroy_v2, ...) */
#define AL_CU_SYM(name)                                                              \
  do { *(void **)(&c->name) = dlsym(c->lib, #name "_v2");                            \
       if (!c->name) *(void **)(&c->name) = dlsym(c->lib, #name);                    \
       if (!c->name) { snprintf(err, errlen, "libcuda.so.1 has no %s", #name); goto fail; } } while (0)

/* The CUDA device for device ordinal `ordinal`; NULL with a message in err when there is no
 * driver or no such device. */
static al_device *al_cuda_device_new(int ordinal, char *err, size_t errlen) {
  al_cuda_ctx *c = (al_cuda_ctx *)calloc(1, sizeof(al_cuda_ctx));
  al_device *d = (al_device *)calloc(1, sizeof(al_device));
  int n = 0, dev = 0;
  if (!c || !d) { snprintf(err, errlen, "out of memory"); goto fail; }
  c->lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!c->lib) { snprintf(err, errlen, "no CUDA driver (%s)", dlerror()); goto fail; }
  AL_CU_SYM(cuInit); AL_CU_SYM(cuDeviceGet); AL_CU_SYM(cuDeviceGetCount);
  AL_CU_SYM(cuDevicePrimaryCtxRetain); AL_CU_SYM(cuCtxSetCurrent); AL_CU_SYM(cuMemcpyAsync);
  AL_CU_SYM(cuEventCreate); AL_CU_SYM(cuEventRecord); AL_CU_SYM(cuEventQuery);
  AL_CU_SYM(cuEventDestroy); AL_CU_SYM(cuStreamWaitValue32); AL_CU_SYM(cuStreamWriteValue32);
  AL_CU_SYM(cuStreamWaitEvent); AL_CU_SYM(cuStreamCreate); AL_CU_SYM(cuStreamDestroy);
  AL_CU_SYM(cuMemHostAlloc);
  AL_CU_SYM(cuMemFreeHost);
  if (c->cuInit(0) || c->cuDeviceGetCount(&n) || n == 0) { snprintf(err, errlen, "no CUDA device is available"); goto fail; }
  if (ordinal < 0 || ordinal >= n || c->cuDeviceGet(&dev, ordinal) || c->cuDevicePrimaryCtxRetain(&c->cuctx, dev)) {
    snprintf(err, errlen, "CUDA device %d is not available (%d devices)", ordinal, n); goto fail; }
  d->ctx = c;
  AL_DEVICE_FILL(d, al_cuda_);
  return d;
fail:
  if (c && c->lib) dlclose(c->lib);
  free(c); free(d);
  return NULL;
}

/* The ordinal of the device of the calling thread's current context (what cudaSetDevice,
 * torch.cuda.set_device or cupy's Device.use() made current): 1 with *ordinal set, 0 when no
 * context is current, -1 with a message in err without a driver or when a call fails.
 * cuCtxGetDevice is resolved by its exact name: CUDA 13's cuCtxGetDevice_v2 takes a context. */
static int al_cuda_current_device(int *ordinal, char *err, size_t errlen) {
  al_CUresult (*cuInit)(unsigned int);
  al_CUresult (*cuCtxGetCurrent)(void **);
  al_CUresult (*cuCtxGetDevice)(int *);
  al_CUresult (*cuDeviceGetCount)(int *);
  al_CUresult (*cuDeviceGet)(int *, int);
  void *ctx = NULL; int dev = -1, n = 0, i, h, found = -1; al_CUresult r;
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) { snprintf(err, errlen, "no CUDA driver (%s)", dlerror()); return -1; }
  *(void **)(&cuInit) = dlsym(lib, "cuInit");
  *(void **)(&cuCtxGetCurrent) = dlsym(lib, "cuCtxGetCurrent");
  *(void **)(&cuCtxGetDevice) = dlsym(lib, "cuCtxGetDevice");
  *(void **)(&cuDeviceGetCount) = dlsym(lib, "cuDeviceGetCount");
  *(void **)(&cuDeviceGet) = dlsym(lib, "cuDeviceGet");
  if (!cuInit || !cuCtxGetCurrent || !cuCtxGetDevice || !cuDeviceGetCount || !cuDeviceGet) {
    snprintf(err, errlen, "libcuda.so.1 lacks cuCtxGetCurrent/cuCtxGetDevice"); dlclose(lib); return -1; }
  if ((r = cuInit(0)) != 0) { snprintf(err, errlen, "cuInit failed (CUresult %d)", r); dlclose(lib); return -1; }
  if ((r = cuCtxGetCurrent(&ctx)) != 0) { snprintf(err, errlen, "cuCtxGetCurrent failed (CUresult %d)", r); dlclose(lib); return -1; }
  if (ctx == NULL) { dlclose(lib); return 0; }
  if ((r = cuCtxGetDevice(&dev)) != 0) { snprintf(err, errlen, "cuCtxGetDevice failed (CUresult %d)", r); dlclose(lib); return -1; }
  /* CUdevice is a handle: find the ordinal whose handle it is */
  if (cuDeviceGetCount(&n) == 0)
    for (i = 0; i < n && found < 0; i++)
      if (cuDeviceGet(&h, i) == 0 && h == dev) found = i;
  dlclose(lib);
  if (found < 0) { snprintf(err, errlen, "the current context's device %d has no ordinal", dev); return -1; }
  *ordinal = found;
  return 1;
}
