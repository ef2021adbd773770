/* cuda_standin.c: a stand-in for the CUDA driver (libcuda.so.1) in which "device memory" is
 * ordinary host memory. It exports the driver-API entry points aluminum_py uses, with CUDA's
 * documented semantics, so that the library's CUDA code path can run (and fail the way it would
 * on a GPU) on a machine without one: load it with AL_CUDA_LIBRARY=<path to the built .so>.
 * aluminum_py/testing/cuda_standin.py builds it; tests/test_cuda_standin.py tests it.
 *
 * Build: cc -shared -fPIC -O2 -pthread -o libcuda_standin.so cuda_standin.c
 *
 * Model (everything below is guarded by one mutex, g_mu, except the copies and value waits,
 * which the stream workers run without it):
 *   - A stream is a FIFO of commands run in order by its own worker thread; calls that enqueue
 *     return at once. Each stream counts commands `enqueued` and `done`, so "everything enqueued
 *     on S so far" is the pair (S, S->enqueued), a `dep`, satisfied once S->done reaches it.
 *   - A command may carry deps; the worker waits for them before running it. This gives the
 *     legacy default stream's ordering (stream 0 / CU_STREAM_LEGACY, a worker too): work on it
 *     waits for all work enqueued before on every blocking stream of the context, and work on a
 *     blocking stream waits for all work enqueued before on the legacy stream. cuStreamWaitEvent
 *     enqueues a no-op whose dep is the event's latest record.
 *   - An event is the position (stream, seq) of its latest cuEventRecord (a no-op marker).
 *   - One primary context per device (env AL_STANDIN_DEVICES, default 1), with a retain count;
 *     a context whose count is 0 is inactive. Each thread has its own context stack.
 *   - Pinned alloc/free and cuCtxSynchronize wait until every stream of the device has run all
 *     it had queued (implicit synchronization, as on a GPU), warning on stderr after
 *     AL_STANDIN_SYNC_WARN seconds (default 5) and naming a stream blocked in a value wait.
 *   - Optionally (AL_STANDIN_DRIVER_LOCK=1), a driver lock held by synchronizing calls while
 *     they wait, with calls that wait for it while holding Python's GIL reported (below).
 *   - Stream and event handles are unique, never reused numbers looked up in registries, so a
 *     destroyed or made-up handle is always CUDA_ERROR_INVALID_HANDLE. Stream structs are never
 *     freed (events and other streams' queued commands may still point at them); event structs
 *     are freed on destroy (nothing queued points at them).
 * NCCL: nccl_standin.c, built into the same library, runs its collectives as host commands on
 * these streams (standin_enqueue_host).
 *   - cuMemAllocAsync returns host memory at once (device memory is host memory); its
 *     cuMemFreeAsync queues the release on the stream, after the work queued there before.
 * Not modelled: kernels, device (non-host) memory pools, timing events, callbacks, graphs, the
 * per-thread default stream, and resetting a primary context's streams when its count hits 0. */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <dlfcn.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct ctx *CUcontext;
typedef void *CUstream;        /* a handle number (see above); 0 and 0x1 are the legacy stream */
typedef void *CUevent;

enum {
  CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3, CUDA_ERROR_NO_DEVICE = 100, CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201, CUDA_ERROR_INVALID_HANDLE = 400, CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_NOT_SUPPORTED = 801, CUDA_ERROR_UNKNOWN = 999
};
#define CU_STREAM_NON_BLOCKING 0x1u
#define CU_STREAM_LEGACY ((uintptr_t)0x1)
#define CU_EVENT_VALID_FLAGS 0x7u          /* BLOCKING_SYNC | DISABLE_TIMING | INTERPROCESS */
#define CU_MEMHOSTALLOC_VALID_FLAGS 0x7u   /* PORTABLE | DEVICEMAP | WRITECOMBINED */
#define CU_STREAM_WAIT_VALUE_FLUSH (1u << 30)
#define CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER 0x1u
enum { WAIT_GEQ = 0, WAIT_EQ = 1, WAIT_AND = 2, WAIT_NOR = 3 };

#define MAX_DEVICES 64
#define CTX_STACK_MAX 64
#define DRIVER_VERSION 12080

/* ------------------------------------------------------------------ call counters */
#define ENTRY_POINTS(X)                                                                      \
  X(cuInit) X(cuDriverGetVersion) X(cuDeviceGetCount) X(cuDeviceGet)                         \
  X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuDevicePrimaryCtxRelease_v2)   \
  X(cuCtxGetCurrent) X(cuCtxSetCurrent) X(cuCtxPushCurrent) X(cuCtxPushCurrent_v2)           \
  X(cuCtxPopCurrent) X(cuCtxPopCurrent_v2) X(cuCtxGetDevice) X(cuCtxGetDevice_v2)            \
  X(cuCtxSynchronize) X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamDestroy_v2)             \
  X(cuStreamSynchronize) X(cuStreamQuery) X(cuStreamWaitEvent) X(cuStreamWaitValue32)        \
  X(cuStreamWaitValue32_v2) X(cuStreamWriteValue32) X(cuStreamWriteValue32_v2)               \
  X(cuEventCreate) X(cuEventRecord) X(cuEventRecord_v2) X(cuEventQuery) X(cuEventSynchronize) \
  X(cuEventDestroy) X(cuEventDestroy_v2) X(cuMemcpyAsync) X(cuMemcpy) X(cuMemHostAlloc)      \
  X(cuMemAllocHost_v2) X(cuMemFreeHost) X(cuMemAllocAsync) X(cuMemFreeAsync) X(cuGetErrorName)  \
  X(cuGetErrorString)
#define AS_ENUM(name) E_##name,
#define AS_NAME(name) #name,
enum { ENTRY_POINTS(AS_ENUM) N_ENTRY_POINTS };
static const char *const entry_names[N_ENTRY_POINTS] = { ENTRY_POINTS(AS_NAME) };
static atomic_long entry_calls[N_ENTRY_POINTS];
static atomic_long g_sync_waits;          /* implicit synchronizations that had to wait */
static atomic_int g_initialized;

#define COUNT(name) atomic_fetch_add(&entry_calls[E_##name], 1)
/* Count the call; every entry point but cuInit/cuDriverGetVersion/cuGetError* needs cuInit. */
#define ENTER(name) do { COUNT(name);                                                     \
    if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED; } while (0)

/* ------------------------------------------------------------------ state */
struct stream;
struct dep { struct stream *s; uint64_t seq; };   /* met once s->done >= seq */

enum cmd_kind { CMD_NOP, CMD_COPY, CMD_WAIT_VALUE, CMD_WRITE_VALUE, CMD_HOST };
struct cmd {
  struct cmd *next;
  enum cmd_kind kind;
  void (*fn)(void *); void *arg;                       /* CMD_HOST: the NCCL stand-in's work */
  void *dst; const void *src; size_t n;               /* CMD_COPY */
  _Atomic uint32_t *addr; uint32_t value; unsigned cond; /* CMD_WAIT_VALUE / CMD_WRITE_VALUE */
  int ndeps;
  struct dep deps[];                                   /* run only once all are met */
};

struct stream {
  uintptr_t handle;           /* the CUstream the user holds (0 for the legacy stream) */
  struct ctx *ctx;
  int blocking;               /* orders with the legacy stream (no CU_STREAM_NON_BLOCKING) */
  int legacy;
  int destroyed;              /* the worker exits once its queue is drained */
  int in_value_wait;          /* running a cuStreamWaitValue32 whose condition does not hold */
  struct cmd *head, *tail;
  uint64_t enqueued, done;
  pthread_cond_t wake;        /* signalled when work is enqueued or the stream destroyed */
  struct stream *next;        /* in ctx->streams (the legacy stream too) until the worker exits */
};

struct ctx {
  int ordinal;
  int refcount;               /* primary-context retain count; 0 = inactive */
  struct stream *legacy;      /* created on first use */
  struct stream *streams;
};

struct event { uintptr_t handle; struct stream *s; uint64_t seq; };   /* s NULL: never recorded */

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_progress = PTHREAD_COND_INITIALIZER;   /* broadcast on each completion */
static int g_ndev;
static struct ctx g_ctx[MAX_DEVICES];
static uintptr_t g_next_handle = 0x5ee00000;
static int g_blocked;                      /* streams with in_value_wait set */

static _Thread_local struct ctx *t_stack[CTX_STACK_MAX];   /* this thread's context stack */
static _Thread_local int t_depth;

/* ------------------------------------------------------------------ registries
 * Open addressing with linear probing; keys are non-zero (0 marks an empty slot), values
 * non-NULL. Live streams and events (handle -> struct), pinned blocks and stream-ordered
 * device blocks (pointer -> ctx). */
struct slot { uintptr_t key; void *val; };
struct map { struct slot *slots; size_t cap, n; };
static struct map g_streams, g_events, g_pinned, g_device;

static size_t map_home(const struct map *m, uintptr_t key) {
  return (size_t)(((uint64_t)key * 0x9E3779B97F4A7C15ull) >> 29) & (m->cap - 1);
}
static size_t map_find(const struct map *m, uintptr_t key) {   /* slot index, or cap if absent */
  if (!m->cap) return 0;
  for (size_t i = map_home(m, key); m->slots[i].key; i = (i + 1) & (m->cap - 1))
    if (m->slots[i].key == key) return i;
  return m->cap;
}
static void *map_get(const struct map *m, uintptr_t key) {
  size_t i = map_find(m, key);
  return i < m->cap ? m->slots[i].val : NULL;
}
static void map_place(struct map *m, uintptr_t key, void *val) {   /* room guaranteed */
  size_t i = map_home(m, key);
  while (m->slots[i].key) i = (i + 1) & (m->cap - 1);
  m->slots[i].key = key; m->slots[i].val = val; m->n++;
}
static int map_put(struct map *m, uintptr_t key, void *val) {      /* 0, or -1 out of memory */
  if (2 * (m->n + 1) > m->cap) {                                      /* keep load <= 1/2 */
    struct map old = *m;
    size_t cap = m->cap ? 2 * m->cap : 64;
    struct slot *slots = calloc(cap, sizeof *slots);
    if (!slots) return -1;
    m->slots = slots; m->cap = cap; m->n = 0;
    for (size_t i = 0; i < old.cap; i++)
      if (old.slots[i].key) map_place(m, old.slots[i].key, old.slots[i].val);
    free(old.slots);
  }
  map_place(m, key, val);
  return 0;
}
static void *map_remove(struct map *m, uintptr_t key) {
  size_t i = map_find(m, key), mask = m->cap - 1;
  if (i >= m->cap) return NULL;
  void *val = m->slots[i].val;
  m->slots[i].key = 0; m->n--;
  /* re-place the rest of the probe run, so that lookups do not stop at the hole */
  for (size_t j = (i + 1) & mask; m->slots[j].key; j = (j + 1) & mask) {
    struct slot e = m->slots[j];
    m->slots[j].key = 0; m->n--;
    map_place(m, e.key, e.val);
  }
  return val;
}

/* ------------------------------------------------------------------ helpers */
static double seconds_since(const struct timespec *t0) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)(t.tv_sec - t0->tv_sec) + 1e-9 * (double)(t.tv_nsec - t0->tv_nsec);
}
static double env_seconds(const char *name, double dflt) {
  const char *v = getenv(name);
  char *end;
  double d = v ? strtod(v, &end) : dflt;
  return (v && (end == v || d < 0)) ? dflt : d;
}
static int all_met(const struct dep *d, int n) {
  for (int i = 0; i < n; i++)
    if (d[i].s->done < d[i].seq) return 0;
  return 1;
}
static int value_holds(uint32_t v, uint32_t ref, unsigned cond) {
  switch (cond) {
  case WAIT_GEQ: return (uint32_t)(v - ref) < 0x80000000u;  /* (int32_t)(v - ref) >= 0: cyclic */
  case WAIT_EQ:  return v == ref;
  case WAIT_AND: return (v & ref) != 0;
  default:       return ~(v | ref) != 0;                     /* WAIT_NOR */
  }
}
static struct ctx *ctx_of(CUcontext h) {     /* the context a handle names, or NULL */
  for (int i = 0; i < g_ndev; i++)
    if (h == &g_ctx[i]) return &g_ctx[i];
  return NULL;
}
/* The calling thread's current context, which must exist and be active (g_mu held). */
static CUresult current_ctx_locked(struct ctx **out) {
  struct ctx *c = t_depth ? t_stack[t_depth - 1] : NULL;
  if (!c || c->refcount == 0) return CUDA_ERROR_INVALID_CONTEXT;
  *out = c;
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ the driver lock
 * Optional (AL_STANDIN_DRIVER_LOCK=1 at cuInit, or standin_driver_lock(1)), as the strict CPU
 * device of al_device.h models it: a thread inside a synchronizing call (cuCtxSynchronize,
 * pinned alloc/free, the synchronous cuMemcpy) holds the driver lock while it waits for the
 * device, and every call that touches streams, events or memory takes it, so it waits until
 * that synchronization is over, as in CUDA, where such a thread can hold locks another
 * thread's driver call needs. The stream workers (the "device") never take it.
 * A call that has to wait for the lock while its thread holds Python's GIL breaks the rule of
 * ext/core/device.pxi (every device call releases the GIL: the stream the other thread waits
 * for may wait for a thread that needs the GIL, a deadlock): it is reported on stderr and
 * counted (standin_driver_lock_violations; the first message: standin_driver_lock_report),
 * then waits as CUDA would. */
static atomic_int g_lock_mode = -1;        /* -1: not read from the environment yet */
static pthread_mutex_t g_drv = PTHREAD_MUTEX_INITIALIZER;
static const char *_Atomic g_drv_holder;   /* the synchronizing call holding the lock */
static atomic_long g_violations;
static atomic_long g_lock_waits;           /* calls that found the lock held (standin_stream_hold) */
static char g_violation[320];
static int (*g_gil_check)(void);           /* PyGILState_Check when Python is in the process */

/* fork(): a thread of the parent (a stream worker, the progress engine in a driver call) may
 * hold g_mu at the moment another thread forks, and the child, which has only the forking
 * thread, would then wait for it forever at its first call (tests/standin/test_driver_rules.py's
 * forked child did: standin_reset_counters, once in a CI run).  So a fork waits until g_mu is
 * free and the child starts with both locks free (no other thread exists there to hold them). */
static void standin_prepare_fork(void) { pthread_mutex_lock(&g_mu); }
static void standin_after_fork_parent(void) { pthread_mutex_unlock(&g_mu); }
static void standin_after_fork_child(void) {
  pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
  g_mu = fresh;
  g_drv = fresh;
}
__attribute__((constructor)) static void standin_register_fork_handlers(void) {
  pthread_atfork(standin_prepare_fork, standin_after_fork_parent, standin_after_fork_child);
}

static int lock_mode(void) {
  int m = atomic_load(&g_lock_mode);
  if (m < 0) {
    const char *v = getenv("AL_STANDIN_DRIVER_LOCK");
    m = v && *v && strcmp(v, "0") != 0;
    *(void **)(&g_gil_check) = dlsym(RTLD_DEFAULT, "PyGILState_Check");
    int expect = -1;
    if (!atomic_compare_exchange_strong(&g_lock_mode, &expect, m)) m = atomic_load(&g_lock_mode);
  }
  return m;
}
/* A synchronizing call `who` takes the lock for its whole wait (released by drv_release). */
static int drv_hold(const char *who) {
  if (!lock_mode()) return 0;
  pthread_mutex_lock(&g_drv);
  atomic_store(&g_drv_holder, who);
  return 1;
}
static void drv_release(int held) {
  if (!held) return;
  atomic_store(&g_drv_holder, NULL);
  pthread_mutex_unlock(&g_drv);
}
/* Every other call `who` passes through the lock: at once when it is free, else after the
 * synchronization holding it, reporting a caller that holds the GIL meanwhile. */
static void drv_pass(const char *who) {
  if (!lock_mode()) return;
  if (pthread_mutex_trylock(&g_drv) != 0) {
    atomic_fetch_add(&g_lock_waits, 1);
    const char *holder = atomic_load(&g_drv_holder);
    if (g_gil_check && g_gil_check()) {
      long n = atomic_fetch_add(&g_violations, 1);
      char msg[sizeof g_violation];
      snprintf(msg, sizeof msg, "%s called while its thread holds the GIL and another thread "
               "waits in the driver (%s): a deadlock if that wait needs a thread that needs the "
               "GIL; release the GIL around device calls", who, holder ? holder : "?");
      if (n == 0) {
        pthread_mutex_lock(&g_mu);
        memcpy(g_violation, msg, sizeof msg);
        pthread_mutex_unlock(&g_mu);
      }
      fprintf(stderr, "cuda stand-in: driver lock: %s\n", msg);
      fflush(stderr);
    }
    pthread_mutex_lock(&g_drv);
  }
  pthread_mutex_unlock(&g_drv);
}
#define PASS(name) drv_pass(#name)

/* ------------------------------------------------------------------ stream workers */
static void run_command(struct stream *s, struct cmd *c) {
  switch (c->kind) {
  case CMD_COPY:
    if (c->n) memmove(c->dst, c->src, c->n);
    break;
  case CMD_WRITE_VALUE:
    atomic_store_explicit(c->addr, c->value, memory_order_release);
    break;
  case CMD_WAIT_VALUE:
    if (value_holds(atomic_load_explicit(c->addr, memory_order_acquire), c->value, c->cond)) break;
    pthread_mutex_lock(&g_mu);
    s->in_value_wait = 1; g_blocked++;
    pthread_mutex_unlock(&g_mu);
    while (!value_holds(atomic_load_explicit(c->addr, memory_order_acquire), c->value, c->cond)) {
      struct timespec ts = { 0, 20000 };                       /* poll every ~20 us */
      nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&g_mu);
    s->in_value_wait = 0; g_blocked--;
    pthread_mutex_unlock(&g_mu);
    break;
  case CMD_HOST:
    c->fn(c->arg);
    break;
  case CMD_NOP:
    break;
  }
}

static void *stream_worker(void *arg) {
  struct stream *s = arg;
  pthread_mutex_lock(&g_mu);
  for (;;) {
    while (!s->head && !s->destroyed) pthread_cond_wait(&s->wake, &g_mu);
    struct cmd *c = s->head;
    if (!c) break;                                   /* destroyed and drained */
    while (!all_met(c->deps, c->ndeps)) pthread_cond_wait(&g_progress, &g_mu);
    pthread_mutex_unlock(&g_mu);
    run_command(s, c);
    pthread_mutex_lock(&g_mu);
    s->head = c->next;
    if (!s->head) s->tail = NULL;
    s->done++;
    free(c);
    pthread_cond_broadcast(&g_progress);
  }
  for (struct stream **p = &s->ctx->streams; *p; p = &(*p)->next)   /* nothing left to wait for */
    if (*p == s) { *p = s->next; break; }
  pthread_mutex_unlock(&g_mu);
  return NULL;                                       /* the struct itself is never freed */
}

/* A new stream of c with its (detached) worker, which runs with every signal blocked so that
 * signals go to the application's threads. NULL when out of memory or threads (g_mu held). */
static struct stream *stream_new_locked(struct ctx *c, int blocking, int legacy) {
  struct stream *s = calloc(1, sizeof *s);
  pthread_attr_t attr;
  sigset_t all, old;
  pthread_t t;
  int rc;
  if (!s) return NULL;
  s->ctx = c; s->blocking = blocking; s->legacy = legacy;
  s->handle = legacy ? 0 : (g_next_handle += 0x10);
  pthread_cond_init(&s->wake, NULL);
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  rc = pthread_create(&t, &attr, stream_worker, s);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  pthread_attr_destroy(&attr);
  if (rc) { pthread_cond_destroy(&s->wake); free(s); return NULL; }
  s->next = c->streams;
  c->streams = s;
  return s;
}

/* The stream a handle names (g_mu held): 0 and CU_STREAM_LEGACY are the legacy default stream
 * of the calling thread's current context, created on first use. */
static CUresult stream_of_locked(CUstream h, struct stream **out) {
  if ((uintptr_t)h == 0 || (uintptr_t)h == CU_STREAM_LEGACY) {
    struct ctx *c;
    CUresult r = current_ctx_locked(&c);
    if (r) return r;
    if (!c->legacy && !(c->legacy = stream_new_locked(c, 1, 1))) return CUDA_ERROR_OUT_OF_MEMORY;
    *out = c->legacy;
    return CUDA_SUCCESS;
  }
  *out = map_get(&g_streams, (uintptr_t)h);
  return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* Append a copy of *proto to s (g_mu held), with `extra` (if any) and the legacy-stream ordering
 * as deps; *seq (if given) gets its position. */
static CUresult enqueue_locked(struct stream *s, const struct cmd *proto, const struct dep *extra,
                               uint64_t *seq) {
  struct ctx *c = s->ctx;
  int max = 1;
  for (struct stream *b = c->streams; b; b = b->next) max++;
  struct cmd *cmd = malloc(sizeof *cmd + (size_t)max * sizeof(struct dep));
  if (!cmd) return CUDA_ERROR_OUT_OF_MEMORY;
  *cmd = *proto;
  cmd->next = NULL;
  cmd->ndeps = 0;
  if (extra && extra->s && extra->s->done < extra->seq) cmd->deps[cmd->ndeps++] = *extra;
  if (s->legacy) {              /* after all earlier work of every blocking stream */
    for (struct stream *b = c->streams; b; b = b->next)
      if (!b->legacy && b->blocking && b->done < b->enqueued)
        cmd->deps[cmd->ndeps++] = (struct dep){ b, b->enqueued };
  } else if (s->blocking && c->legacy && c->legacy->done < c->legacy->enqueued) {
    cmd->deps[cmd->ndeps++] = (struct dep){ c->legacy, c->legacy->enqueued };  /* after legacy */
  }
  s->enqueued++;
  if (seq) *seq = s->enqueued;
  if (s->tail) s->tail->next = cmd; else s->head = cmd;
  s->tail = cmd;
  pthread_cond_signal(&s->wake);
  return CUDA_SUCCESS;
}

/* Resolve the stream and enqueue (the common body of the enqueuing entry points). */
static CUresult enqueue_on(CUstream h, const struct cmd *proto, const struct dep *extra,
                           struct stream **sp, uint64_t *seq) {
  struct stream *s;
  pthread_mutex_lock(&g_mu);
  CUresult r = stream_of_locked(h, &s);
  if (!r) r = enqueue_locked(s, proto, extra, seq);
  if (!r && sp) *sp = s;
  pthread_mutex_unlock(&g_mu);
  return r;
}

/* ------------------------------------------------------------------ implicit synchronization */
static void report_stall(const char *who, double waited, const struct dep *t, int n) {
  const struct stream *busy = NULL, *blocked = NULL;
  for (int i = 0; i < n; i++)
    if (t[i].s->done < t[i].seq) {
      if (!busy) busy = t[i].s;
      if (!blocked && t[i].s->in_value_wait) blocked = t[i].s;
    }
  const struct stream *s = blocked ? blocked : busy;
  if (!s) return;
  fprintf(stderr, "cuda stand-in: %s has waited %.1f s for the device to go idle; stream 0x%lx%s %s\n",
          who, waited, (unsigned long)s->handle, s->legacy ? " (the legacy default stream)" : "",
          blocked ? "is blocked in cuStreamWaitValue32 (a deadlock if the flag's writer is this thread)"
                  : "still has queued work (waiting on an event or another stream?)");
  fflush(stderr);
}

/* Wait until every stream of c has run all it had queued when called (g_mu held): what pinned
 * alloc/free and cuCtxSynchronize do on a GPU. Warns once past AL_STANDIN_SYNC_WARN seconds. */
static CUresult device_idle_locked(struct ctx *c, const char *who) {
  int n = 0, busy = 0, warned = 0;
  for (struct stream *s = c->streams; s; s = s->next) n++;
  if (!n) return CUDA_SUCCESS;
  struct dep *t = malloc((size_t)n * sizeof *t);
  if (!t) return CUDA_ERROR_OUT_OF_MEMORY;
  n = 0;
  for (struct stream *s = c->streams; s; s = s->next) {
    t[n++] = (struct dep){ s, s->enqueued };
    busy |= s->done < s->enqueued;
  }
  if (busy) {
    double warn = env_seconds("AL_STANDIN_SYNC_WARN", 5.0);
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    atomic_fetch_add(&g_sync_waits, 1);
    while (!all_met(t, n)) {
      double waited = seconds_since(&t0);
      if (!warned && waited >= warn) { warned = 1; report_stall(who, waited, t, n); }
      struct timespec dl;                      /* wake up now and then to check the clock */
      clock_gettime(CLOCK_REALTIME, &dl);
      dl.tv_nsec += 50 * 1000 * 1000;
      if (dl.tv_nsec >= 1000000000L) { dl.tv_sec++; dl.tv_nsec -= 1000000000L; }
      pthread_cond_timedwait(&g_progress, &g_mu, &dl);
    }
  }
  free(t);
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ init, devices, contexts */
CUresult cuInit(unsigned flags) {
  COUNT(cuInit);
  if (flags) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_mu);
  if (!atomic_load(&g_initialized)) {
    const char *v = getenv("AL_STANDIN_DEVICES");
    char *end;
    long n = v && *v ? strtol(v, &end, 10) : 1;
    if (v && *v && (*end || n < 0)) n = 1;
    g_ndev = n > MAX_DEVICES ? MAX_DEVICES : (int)n;
    for (int i = 0; i < g_ndev; i++) g_ctx[i].ordinal = i;
    if (g_ndev > 0) atomic_store(&g_initialized, 1);
  }
  pthread_mutex_unlock(&g_mu);
  return atomic_load(&g_initialized) ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
}

CUresult cuDriverGetVersion(int *version) {
  COUNT(cuDriverGetVersion);
  if (!version) return CUDA_ERROR_INVALID_VALUE;
  *version = DRIVER_VERSION;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
  ENTER(cuDeviceGetCount);
  if (!count) return CUDA_ERROR_INVALID_VALUE;
  *count = g_ndev;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal) {   /* a CUdevice is its ordinal here */
  ENTER(cuDeviceGet);
  if (!dev) return CUDA_ERROR_INVALID_VALUE;
  if (ordinal < 0 || ordinal >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  *dev = ordinal;
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  ENTER(cuDevicePrimaryCtxRetain);
  if (!pctx) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&g_mu);
  g_ctx[dev].refcount++;
  pthread_mutex_unlock(&g_mu);
  *pctx = &g_ctx[dev];
  return CUDA_SUCCESS;
}

static CUresult primary_release(CUdevice dev) {   /* never pops the context, as in CUDA */
  CUresult r = CUDA_SUCCESS;
  if (dev < 0 || dev >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&g_mu);
  if (g_ctx[dev].refcount == 0) r = CUDA_ERROR_INVALID_CONTEXT;   /* not retained */
  else g_ctx[dev].refcount--;
  pthread_mutex_unlock(&g_mu);
  return r;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) { ENTER(cuDevicePrimaryCtxRelease_v2); return primary_release(dev); }
CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { ENTER(cuDevicePrimaryCtxRelease); return primary_release(dev); }

CUresult cuCtxGetCurrent(CUcontext *pctx) {
  ENTER(cuCtxGetCurrent);
  if (!pctx) return CUDA_ERROR_INVALID_VALUE;
  *pctx = t_depth ? t_stack[t_depth - 1] : NULL;
  return CUDA_SUCCESS;
}

/* Replace the top of the calling thread's stack (push onto an empty one); NULL pops. */
CUresult cuCtxSetCurrent(CUcontext h) {
  ENTER(cuCtxSetCurrent);
  if (!h) { if (t_depth) t_depth--; return CUDA_SUCCESS; }
  struct ctx *c = ctx_of(h);
  if (!c) return CUDA_ERROR_INVALID_CONTEXT;
  if (t_depth == 0) t_depth = 1;
  t_stack[t_depth - 1] = c;
  return CUDA_SUCCESS;
}

static CUresult ctx_push(CUcontext h) {
  struct ctx *c = ctx_of(h);
  if (!c) return CUDA_ERROR_INVALID_CONTEXT;
  if (t_depth == CTX_STACK_MAX) return CUDA_ERROR_OUT_OF_MEMORY;
  t_stack[t_depth++] = c;
  return CUDA_SUCCESS;
}
static CUresult ctx_pop(CUcontext *pctx) {
  if (!t_depth) return CUDA_ERROR_INVALID_CONTEXT;
  struct ctx *c = t_stack[--t_depth];
  if (pctx) *pctx = c;
  return CUDA_SUCCESS;
}
CUresult cuCtxPushCurrent_v2(CUcontext h) { ENTER(cuCtxPushCurrent_v2); return ctx_push(h); }
CUresult cuCtxPushCurrent(CUcontext h) { ENTER(cuCtxPushCurrent); return ctx_push(h); }
CUresult cuCtxPopCurrent_v2(CUcontext *pctx) { ENTER(cuCtxPopCurrent_v2); return ctx_pop(pctx); }
CUresult cuCtxPopCurrent(CUcontext *pctx) { ENTER(cuCtxPopCurrent); return ctx_pop(pctx); }

/* The device of h (NULL: of the current context). */
static CUresult ctx_device(CUdevice *dev, CUcontext h) {
  struct ctx *c = NULL;
  CUresult r = CUDA_SUCCESS;
  if (!dev) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_mu);
  if (h) { if (!(c = ctx_of(h))) r = CUDA_ERROR_INVALID_CONTEXT; }
  else r = current_ctx_locked(&c);
  pthread_mutex_unlock(&g_mu);
  if (!r) *dev = c->ordinal;
  return r;
}
CUresult cuCtxGetDevice(CUdevice *dev) { ENTER(cuCtxGetDevice); return ctx_device(dev, NULL); }
/* CUDA 13's form, which takes the context (a different function, not an ABI revision). */
CUresult cuCtxGetDevice_v2(CUdevice *dev, CUcontext h) { ENTER(cuCtxGetDevice_v2); return ctx_device(dev, h); }

CUresult cuCtxSynchronize(void) {
  struct ctx *c;
  ENTER(cuCtxSynchronize);
  int held = drv_hold("cuCtxSynchronize");
  pthread_mutex_lock(&g_mu);
  CUresult r = current_ctx_locked(&c);
  if (!r) r = device_idle_locked(c, "cuCtxSynchronize");
  pthread_mutex_unlock(&g_mu);
  drv_release(held);
  return r;
}

/* ------------------------------------------------------------------ streams */
CUresult cuStreamCreate(CUstream *ph, unsigned flags) {
  struct ctx *c;
  struct stream *s = NULL;
  ENTER(cuStreamCreate);
  PASS(cuStreamCreate);
  pthread_mutex_lock(&g_mu);
  CUresult r = current_ctx_locked(&c);
  if (!r && (!ph || (flags & ~CU_STREAM_NON_BLOCKING))) r = CUDA_ERROR_INVALID_VALUE;
  if (!r && !(s = stream_new_locked(c, !(flags & CU_STREAM_NON_BLOCKING), 0))) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (!r && map_put(&g_streams, s->handle, s)) {
    s->destroyed = 1;                       /* let the worker exit */
    pthread_cond_signal(&s->wake);
    r = CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (!r) *ph = (CUstream)s->handle;
  pthread_mutex_unlock(&g_mu);
  return r;
}

/* Returns at once; the worker runs what is queued, then exits. */
static CUresult stream_destroy(CUstream h) {
  pthread_mutex_lock(&g_mu);
  struct stream *s = map_remove(&g_streams, (uintptr_t)h);   /* never the legacy stream */
  if (s) { s->destroyed = 1; pthread_cond_signal(&s->wake); }
  pthread_mutex_unlock(&g_mu);
  return s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}
CUresult cuStreamDestroy_v2(CUstream h) { ENTER(cuStreamDestroy_v2); PASS(cuStreamDestroy_v2); return stream_destroy(h); }
CUresult cuStreamDestroy(CUstream h) { ENTER(cuStreamDestroy); PASS(cuStreamDestroy); return stream_destroy(h); }

CUresult cuStreamSynchronize(CUstream h) {
  struct stream *s;
  ENTER(cuStreamSynchronize);
  PASS(cuStreamSynchronize);
  pthread_mutex_lock(&g_mu);
  CUresult r = stream_of_locked(h, &s);
  if (!r) {
    uint64_t target = s->enqueued;
    while (s->done < target) pthread_cond_wait(&g_progress, &g_mu);
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

CUresult cuStreamQuery(CUstream h) {
  struct stream *s;
  ENTER(cuStreamQuery);
  PASS(cuStreamQuery);
  pthread_mutex_lock(&g_mu);
  CUresult r = stream_of_locked(h, &s);
  if (!r && s->done < s->enqueued) r = CUDA_ERROR_NOT_READY;
  pthread_mutex_unlock(&g_mu);
  return r;
}

/* The stream waits for the event's latest record as of this call (a no-op with that dep). */
CUresult cuStreamWaitEvent(CUstream h, CUevent ev, unsigned flags) {
  struct stream *s;
  struct cmd nop = { .kind = CMD_NOP };
  ENTER(cuStreamWaitEvent);
  PASS(cuStreamWaitEvent);
  if (flags) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_mu);
  struct event *e = map_get(&g_events, (uintptr_t)ev);
  CUresult r = e ? stream_of_locked(h, &s) : CUDA_ERROR_INVALID_HANDLE;
  if (!r) {
    struct dep d = { e->s, e->seq };
    r = enqueue_locked(s, &nop, &d, NULL);
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

/* ------------------------------------------------------------------ stream memory operations */
CUresult cuStreamWaitValue32_v2(CUstream h, CUdeviceptr addr, uint32_t value, unsigned flags) {
  unsigned cond = flags & ~CU_STREAM_WAIT_VALUE_FLUSH;
  ENTER(cuStreamWaitValue32_v2);
  PASS(cuStreamWaitValue32_v2);
  if (!addr || (addr & 3) || cond > WAIT_NOR) return CUDA_ERROR_INVALID_VALUE;
  struct cmd c = { .kind = CMD_WAIT_VALUE, .addr = (_Atomic uint32_t *)(uintptr_t)addr,
                   .value = value, .cond = cond };
  return enqueue_on(h, &c, NULL, NULL, NULL);
}

CUresult cuStreamWriteValue32_v2(CUstream h, CUdeviceptr addr, uint32_t value, unsigned flags) {
  ENTER(cuStreamWriteValue32_v2);
  PASS(cuStreamWriteValue32_v2);
  if (!addr || (addr & 3) || (flags & ~CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER))
    return CUDA_ERROR_INVALID_VALUE;
  struct cmd c = { .kind = CMD_WRITE_VALUE, .addr = (_Atomic uint32_t *)(uintptr_t)addr, .value = value };
  return enqueue_on(h, &c, NULL, NULL, NULL);
}

/* The v1 memop entry points are disabled by default on real drivers. */
CUresult cuStreamWaitValue32(CUstream h, CUdeviceptr addr, uint32_t value, unsigned flags) {
  (void)h; (void)addr; (void)value; (void)flags;
  ENTER(cuStreamWaitValue32);
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuStreamWriteValue32(CUstream h, CUdeviceptr addr, uint32_t value, unsigned flags) {
  (void)h; (void)addr; (void)value; (void)flags;
  ENTER(cuStreamWriteValue32);
  return CUDA_ERROR_NOT_SUPPORTED;
}

/* ------------------------------------------------------------------ for nccl_standin.c
 * (the same library): run fn(arg) on stream h's worker when the stream reaches it, as a
 * kernel would run; and the device of the calling thread's current context (0 without one,
 * as cudaGetDevice answers before any cudaSetDevice). */
__attribute__((visibility("hidden")))
CUresult standin_enqueue_host(CUstream h, void (*fn)(void *), void *arg) {
  if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
  drv_pass("an NCCL launch");
  struct cmd c = { .kind = CMD_HOST, .fn = fn, .arg = arg };
  return enqueue_on(h, &c, NULL, NULL, NULL);
}
__attribute__((visibility("hidden")))
int standin_current_device(void) {
  pthread_mutex_lock(&g_mu);
  int d = t_depth ? t_stack[t_depth - 1]->ordinal : 0;
  pthread_mutex_unlock(&g_mu);
  return d;
}

/* ------------------------------------------------------------------ events */
CUresult cuEventCreate(CUevent *pev, unsigned flags) {
  struct ctx *c;
  ENTER(cuEventCreate);
  PASS(cuEventCreate);
  pthread_mutex_lock(&g_mu);
  CUresult r = current_ctx_locked(&c);
  struct event *e = NULL;
  if (!r && (!pev || (flags & ~CU_EVENT_VALID_FLAGS))) r = CUDA_ERROR_INVALID_VALUE;
  if (!r && !(e = calloc(1, sizeof *e))) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (!r) {
    e->handle = (g_next_handle += 0x10);
    if (map_put(&g_events, e->handle, e)) { free(e); r = CUDA_ERROR_OUT_OF_MEMORY; }
    else *pev = (CUevent)e->handle;
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

CUresult cuEventRecord(CUevent ev, CUstream h) {
  struct stream *s;
  struct cmd marker = { .kind = CMD_NOP };
  uint64_t seq;
  ENTER(cuEventRecord);
  PASS(cuEventRecord);
  pthread_mutex_lock(&g_mu);
  struct event *e = map_get(&g_events, (uintptr_t)ev);
  CUresult r = e ? stream_of_locked(h, &s) : CUDA_ERROR_INVALID_HANDLE;
  if (!r) r = enqueue_locked(s, &marker, NULL, &seq);
  if (!r) { e->s = s; e->seq = seq; }
  pthread_mutex_unlock(&g_mu);
  return r;
}

/* Not a documented entry point: a loader that prefers "<name>_v2" for everything fails here. */
CUresult cuEventRecord_v2(CUevent ev, CUstream h) {
  (void)ev; (void)h;
  ENTER(cuEventRecord_v2);
  return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult cuEventQuery(CUevent ev) {
  ENTER(cuEventQuery);
  PASS(cuEventQuery);
  pthread_mutex_lock(&g_mu);
  struct event *e = map_get(&g_events, (uintptr_t)ev);
  CUresult r = !e ? CUDA_ERROR_INVALID_HANDLE
             : (e->s && e->s->done < e->seq) ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
  pthread_mutex_unlock(&g_mu);
  return r;
}

CUresult cuEventSynchronize(CUevent ev) {
  ENTER(cuEventSynchronize);
  PASS(cuEventSynchronize);
  pthread_mutex_lock(&g_mu);
  struct event *e = map_get(&g_events, (uintptr_t)ev);
  if (e && e->s) {
    struct dep d = { e->s, e->seq };             /* e may be destroyed while we wait */
    while (d.s->done < d.seq) pthread_cond_wait(&g_progress, &g_mu);
  }
  pthread_mutex_unlock(&g_mu);
  return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* Legal with a record or wait still queued: nothing queued points at the event. */
static CUresult event_destroy(CUevent ev) {
  pthread_mutex_lock(&g_mu);
  struct event *e = map_remove(&g_events, (uintptr_t)ev);
  pthread_mutex_unlock(&g_mu);
  free(e);
  return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}
CUresult cuEventDestroy_v2(CUevent ev) { ENTER(cuEventDestroy_v2); PASS(cuEventDestroy_v2); return event_destroy(ev); }
CUresult cuEventDestroy(CUevent ev) { ENTER(cuEventDestroy); PASS(cuEventDestroy); return event_destroy(ev); }

/* ------------------------------------------------------------------ copies */
static CUresult check_copy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  struct ctx *c;
  pthread_mutex_lock(&g_mu);
  CUresult r = current_ctx_locked(&c);
  pthread_mutex_unlock(&g_mu);
  if (!r && n && (!dst || !src)) r = CUDA_ERROR_INVALID_VALUE;
  return r;
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) {
  ENTER(cuMemcpyAsync);
  PASS(cuMemcpyAsync);
  CUresult r = check_copy(dst, src, n);
  if (r) return r;
  struct cmd c = { .kind = CMD_COPY, .dst = (void *)(uintptr_t)dst,
                   .src = (const void *)(uintptr_t)src, .n = n };
  return enqueue_on(h, &c, NULL, NULL, NULL);
}

/* Synchronous: a copy on the legacy stream (so after earlier work of the blocking streams),
 * waited for. */
CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  struct stream *s;
  uint64_t seq;
  ENTER(cuMemcpy);
  CUresult r = check_copy(dst, src, n);
  if (r) return r;
  struct cmd c = { .kind = CMD_COPY, .dst = (void *)(uintptr_t)dst,
                   .src = (const void *)(uintptr_t)src, .n = n };
  int held = drv_hold("cuMemcpy");
  if ((r = enqueue_on(0, &c, NULL, &s, &seq))) { drv_release(held); return r; }
  pthread_mutex_lock(&g_mu);
  while (s->done < seq) pthread_cond_wait(&g_progress, &g_mu);
  pthread_mutex_unlock(&g_mu);
  drv_release(held);
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ pinned host memory */
static CUresult host_alloc(void **pp, size_t n, unsigned flags, const char *who) {
  struct ctx *c;
  void *p = NULL;
  int held = drv_hold(who);
  pthread_mutex_lock(&g_mu);
  CUresult r = current_ctx_locked(&c);
  if (!r && (!pp || !n || (flags & ~CU_MEMHOSTALLOC_VALID_FLAGS))) r = CUDA_ERROR_INVALID_VALUE;
  if (!r) r = device_idle_locked(c, who);                 /* implicitly synchronizing */
  if (!r && posix_memalign(&p, 4096, n)) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (!r && map_put(&g_pinned, (uintptr_t)p, c)) { free(p); r = CUDA_ERROR_OUT_OF_MEMORY; }
  pthread_mutex_unlock(&g_mu);
  drv_release(held);
  if (!r) *pp = p;
  return r;
}
CUresult cuMemHostAlloc(void **pp, size_t n, unsigned flags) {
  ENTER(cuMemHostAlloc);
  return host_alloc(pp, n, flags, "cuMemHostAlloc");
}
CUresult cuMemAllocHost_v2(void **pp, size_t n) {
  ENTER(cuMemAllocHost_v2);
  return host_alloc(pp, n, 0, "cuMemAllocHost");
}

/* Waits for the device of the context that allocated p, then frees. NULL is a no-op. */
CUresult cuMemFreeHost(void *p) {
  ENTER(cuMemFreeHost);
  if (!p) return CUDA_SUCCESS;
  int held = drv_hold("cuMemFreeHost");
  pthread_mutex_lock(&g_mu);
  struct ctx *c = map_remove(&g_pinned, (uintptr_t)p);
  CUresult r = c ? device_idle_locked(c, "cuMemFreeHost") : CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_unlock(&g_mu);
  drv_release(held);
  if (c) free(p);
  return r;
}

/* ------------------------------------------------------------------ stream-ordered memory */
static void release_block(void *p) { free(p); }

CUresult cuMemAllocAsync(CUdeviceptr *pp, size_t n, CUstream h) {
  struct ctx *c;
  struct stream *s;
  void *p = NULL;
  ENTER(cuMemAllocAsync);
  PASS(cuMemAllocAsync);
  pthread_mutex_lock(&g_mu);
  CUresult r = current_ctx_locked(&c);
  if (!r && (!pp || !n)) r = CUDA_ERROR_INVALID_VALUE;
  if (!r) r = stream_of_locked(h, &s);
  if (!r && posix_memalign(&p, 256, n)) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (!r && map_put(&g_device, (uintptr_t)p, c)) { free(p); r = CUDA_ERROR_OUT_OF_MEMORY; }
  pthread_mutex_unlock(&g_mu);
  if (!r) *pp = (CUdeviceptr)(uintptr_t)p;
  return r;
}

/* p must come from cuMemAllocAsync and not be freed yet (else CUDA_ERROR_INVALID_VALUE). */
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream h) {
  struct stream *s;
  ENTER(cuMemFreeAsync);
  PASS(cuMemFreeAsync);
  pthread_mutex_lock(&g_mu);
  CUresult r = stream_of_locked(h, &s);
  if (!r && (!p || !map_get(&g_device, (uintptr_t)p))) r = CUDA_ERROR_INVALID_VALUE;
  if (!r) {
    struct cmd c = { .kind = CMD_HOST, .fn = release_block, .arg = (void *)(uintptr_t)p };
    r = enqueue_locked(s, &c, NULL, NULL);
  }
  if (!r) map_remove(&g_device, (uintptr_t)p);
  pthread_mutex_unlock(&g_mu);
  return r;
}

/* ------------------------------------------------------------------ error strings */
static const struct { CUresult code; const char *name, *text; } errors[] = {
  { CUDA_SUCCESS, "CUDA_SUCCESS", "no error" },
  { CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument" },
  { CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory" },
  { CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error" },
  { CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected" },
  { CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal" },
  { CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context" },
  { CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle" },
  { CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready" },
  { CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported" },
  { CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error" },
};
static CUresult error_lookup(CUresult code, const char **out, int text) {
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
    if (errors[i].code == code) { *out = text ? errors[i].text : errors[i].name; return CUDA_SUCCESS; }
  *out = NULL;
  return CUDA_ERROR_INVALID_VALUE;
}
CUresult cuGetErrorName(CUresult code, const char **name) { COUNT(cuGetErrorName); return error_lookup(code, name, 0); }
CUresult cuGetErrorString(CUresult code, const char **text) { COUNT(cuGetErrorString); return error_lookup(code, text, 1); }

/* ------------------------------------------------------------------ introspection for tests */

/* The retain count of device `ordinal`'s primary context; -1 for no such device. */
int standin_primary_ctx_refcount(int ordinal) {
  pthread_mutex_lock(&g_mu);
  int n = ordinal >= 0 && ordinal < g_ndev ? g_ctx[ordinal].refcount : -1;
  pthread_mutex_unlock(&g_mu);
  return n;
}
/* The calling thread's current context (NULL if none). */
void *standin_current_ctx(void) { return t_depth ? t_stack[t_depth - 1] : NULL; }
/* Streams created and not destroyed (the legacy streams are not counted). */
int standin_live_streams(void) {
  pthread_mutex_lock(&g_mu);
  int n = (int)g_streams.n;
  pthread_mutex_unlock(&g_mu);
  return n;
}
/* Calls of the named entry point since load (or the last reset); -1 for a name not exported. */
long standin_calls(const char *name) {
  for (int i = 0; name && i < N_ENTRY_POINTS; i++)
    if (!strcmp(name, entry_names[i])) return atomic_load(&entry_calls[i]);
  return -1;
}
/* Pinned blocks allocated and not freed. */
long standin_pinned_live(void) {
  pthread_mutex_lock(&g_mu);
  long n = (long)g_pinned.n;
  pthread_mutex_unlock(&g_mu);
  return n;
}
/* Blocks from cuMemAllocAsync not passed to cuMemFreeAsync. */
long standin_device_live(void) {
  pthread_mutex_lock(&g_mu);
  long n = (long)g_device.n;
  pthread_mutex_unlock(&g_mu);
  return n;
}
/* Implicit synchronizations (pinned alloc/free, cuCtxSynchronize) that found a stream busy. */
long standin_sync_waits(void) { return atomic_load(&g_sync_waits); }
/* Streams now blocked in a cuStreamWaitValue32_v2 whose condition does not hold. */
int standin_blocked_streams(void) {
  pthread_mutex_lock(&g_mu);
  int n = g_blocked;
  pthread_mutex_unlock(&g_mu);
  return n;
}
/* Zero the call counters, the sync-wait counter and the driver-lock reports (not the state:
 * streams, pinned blocks). */
void standin_reset_counters(void) {
  for (int i = 0; i < N_ENTRY_POINTS; i++) atomic_store(&entry_calls[i], 0);
  atomic_store(&g_sync_waits, 0);
  atomic_store(&g_violations, 0);
  atomic_store(&g_lock_waits, 0);
  pthread_mutex_lock(&g_mu);
  g_violation[0] = 0;
  pthread_mutex_unlock(&g_mu);
}
/* The driver lock (above): on/off (standin_driver_lock), whether a synchronizing call holds
 * it now, the calls reported since load (or the last reset) and the first one's message. */
void standin_driver_lock(int on) { lock_mode(); atomic_store(&g_lock_mode, on ? 1 : 0); }
int standin_driver_lock_mode(void) { return lock_mode(); }
int standin_driver_lock_held(void) { return atomic_load(&g_drv_holder) != NULL; }
long standin_driver_lock_violations(void) { return atomic_load(&g_violations); }
/* The calls that found the lock held and waited for it, since load (or the last reset). */
long standin_driver_lock_waits(void) { return atomic_load(&g_lock_waits); }
void standin_driver_lock_report(char *buf, size_t n) {
  pthread_mutex_lock(&g_mu);
  snprintf(buf, n, "%s", g_violation);
  pthread_mutex_unlock(&g_mu);
}
/* A host command that keeps stream h busy until `waits` calls in all have waited for the
 * driver lock (standin_driver_lock_waits), or for `guard` seconds (a hang guard): a kernel
 * that a thread in a synchronizing call waits for until the calls a test makes meanwhile
 * have met the lock, whatever the machine's speed. */
struct hold { long waits; double guard; };
static void hold_cmd(void *arg) {
  struct hold h = *(struct hold *)arg;
  free(arg);
  struct timespec t0, now;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  while (atomic_load(&g_lock_waits) < h.waits) {
    clock_gettime(CLOCK_MONOTONIC, &now);
    if ((double)(now.tv_sec - t0.tv_sec) + 1e-9 * (double)(now.tv_nsec - t0.tv_nsec) > h.guard)
      break;
    struct timespec ts = { 0, 20000 };                       /* poll every ~20 us */
    nanosleep(&ts, NULL);
  }
}
CUresult standin_stream_hold(CUstream h, long waits, double guard) {
  if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED;
  struct hold *arg = malloc(sizeof *arg);
  if (!arg) return CUDA_ERROR_OUT_OF_MEMORY;
  arg->waits = waits;
  arg->guard = guard;
  struct cmd c = { .kind = CMD_HOST, .fn = hold_cmd, .arg = arg };
  CUresult r = enqueue_on(h, &c, NULL, NULL, NULL);
  if (r) free(arg);
  return r;
}
