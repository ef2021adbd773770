/* The small device interface the host-transfer state machine is written against, with two
 * implementations: CPU (streams are worker threads executing queued commands in order; used to
 * test the state machine's ordering under real MPI ranks without a GPU) and CUDA (the driver
 * API through dlopen).  All functions are callable without the GIL.
 *
 * Semantics (as CUDA's). Every int-returning function returns 0 on success, else an error code
 * (CUDA: the CUresult; CPU: -1) that `describe` turns into text.
 *   memcpy_async   enqueue a copy on the stream
 *   event_record   enqueue "mark the event complete"; event_query returns 1 once it ran
 *                  (0 pending, < 0: minus the error code)
 *   wait_value32   the stream stops until *addr >= value (cuStreamWaitValue32_v2, GEQ)
 *   write_value32  enqueue *addr = value
 *   host_alloc     pinned host memory. CUDA (and the strict CPU device): implicitly
 *   host_free      synchronizing, they wait until every stream of the device is idle. So they
 *                  are never called on the progress engine's thread (a stream may be blocked on
 *                  a flag only that thread writes): the engine only takes buffers from and
 *                  returns them to the pinned pool below.
 *   synchronize    wait until every stream of the device is idle (cuCtxSynchronize)
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

/* Pinned staging buffers are cached per power-of-two size class (like PyTorch's
 * CachingHostAllocator): a host-transfer op takes one when it is called and the engine returns
 * it once the op's copy back to the device has completed. Free buffers keep their class in a
 * header in front of the block; the list link is stored in the block itself. */
#define AL_PINNED_MIN_SHIFT 12
#define AL_PINNED_CLASSES 40
#define AL_PINNED_HEADER 64

typedef struct al_device {
  void *ctx;
  int (*memcpy_async)(void *ctx, void *dst, const void *src, size_t n, void *stream);
  int (*event_create)(void *ctx, void **ev);
  int (*event_record)(void *ctx, void *ev, void *stream);
  int (*event_query)(void *ctx, void *ev);          /* 1 complete, 0 pending, < 0 -error */
  int (*event_destroy)(void *ctx, void *ev);
  int (*wait_value32)(void *ctx, void *stream, volatile uint32_t *addr, uint32_t value);
  int (*write_value32)(void *ctx, void *stream, volatile uint32_t *addr, uint32_t value);
  int (*host_alloc)(void *ctx, size_t n, void **p);
  int (*host_free)(void *ctx, void *p);
  int (*synchronize)(void *ctx);
  int (*stream_create)(void *ctx, void **stream);
  int (*stream_destroy)(void *ctx, void *stream);
  int (*stream_wait_event)(void *ctx, void *stream, void *ev);
  void (*describe)(void *ctx, int code, char *buf, size_t n);   /* error code -> text */
  /* the pinned pool (al_pinned_*) */
  pthread_mutex_t pool_lock;
  void *pool[AL_PINNED_CLASSES];
  size_t pool_cached;          /* bytes in the free lists */
  long pool_allocs, pool_reuses, pool_out;   /* from host_alloc; from the lists; taken, not returned */
} al_device;

/* Fill every entry of an al_device from the implementation's functions PREFIX##name, so that
 * each implementation provides the whole interface and a new entry is added in one place. */
#define AL_DEVICE_FILL(d, PREFIX) do {                                                   \
    (d)->memcpy_async = PREFIX##memcpy_async; (d)->event_create = PREFIX##event_create;     \
    (d)->event_record = PREFIX##event_record; (d)->event_query = PREFIX##event_query;       \
    (d)->event_destroy = PREFIX##event_destroy; (d)->wait_value32 = PREFIX##wait_value32;   \
    (d)->write_value32 = PREFIX##write_value32; (d)->host_alloc = PREFIX##host_alloc;       \
    (d)->host_free = PREFIX##host_free; (d)->synchronize = PREFIX##synchronize;             \
    (d)->stream_create = PREFIX##stream_create;                                             \
    (d)->stream_destroy = PREFIX##stream_destroy;                                           \
    (d)->stream_wait_event = PREFIX##stream_wait_event; (d)->describe = PREFIX##describe;   \
    pthread_mutex_init(&(d)->pool_lock, NULL);                                              \
  } while (0)

/* ------------------------------------------------------------------ the pinned pool */
static int al_pinned_class(size_t n) {
  int c = 0;
  while (c < AL_PINNED_CLASSES - 1 && ((size_t)1 << (c + AL_PINNED_MIN_SHIFT)) < n) c++;
  return c;
}

/* A pinned buffer of at least n bytes: a cached one of its class, else a new one from
 * host_alloc (implicitly synchronizing: call it on the caller's thread, without the GIL,
 * never on the engine's). Returns 0 with *p set, or host_alloc's error code. */
static int al_pinned_get(al_device *d, size_t n, void **p) {
  int c = al_pinned_class(n + AL_PINNED_HEADER), rc;
  size_t bytes = (size_t)1 << (c + AL_PINNED_MIN_SHIFT);
  char *b;
  pthread_mutex_lock(&d->pool_lock);
  b = (char *)d->pool[c];
  if (b) {
    d->pool[c] = *(void **)(b + AL_PINNED_HEADER);
    d->pool_cached -= bytes;
    d->pool_reuses++;
    d->pool_out++;
  }
  pthread_mutex_unlock(&d->pool_lock);
  if (!b) {
    void *raw = NULL;
    if ((rc = d->host_alloc(d->ctx, bytes, &raw)) != 0) return rc;
    b = (char *)raw;
    *(int *)b = c;
    pthread_mutex_lock(&d->pool_lock);
    d->pool_allocs++;
    d->pool_out++;
    pthread_mutex_unlock(&d->pool_lock);
  }
  *p = b + AL_PINNED_HEADER;
  return 0;
}

/* Return a buffer from al_pinned_get to the pool (no device call: safe on the engine thread,
 * once the device no longer uses the buffer). */
static void al_pinned_put(al_device *d, void *p) {
  char *b = (char *)p - AL_PINNED_HEADER;
  int c = *(int *)b;
  pthread_mutex_lock(&d->pool_lock);
  *(void **)p = d->pool[c];
  d->pool[c] = b;
  d->pool_cached += (size_t)1 << (c + AL_PINNED_MIN_SHIFT);
  d->pool_out--;
  pthread_mutex_unlock(&d->pool_lock);
}

/* Free the cached buffers after a device synchronize (Communicator.Free, exit). Buffers still
 * taken are left alone. Returns 0 or the first error code. */
static int al_pinned_release(al_device *d) {
  void *lists[AL_PINNED_CLASSES];
  int c, rc = 0, r;
  pthread_mutex_lock(&d->pool_lock);
  memcpy(lists, d->pool, sizeof(lists));
  memset(d->pool, 0, sizeof(d->pool));
  d->pool_cached = 0;
  pthread_mutex_unlock(&d->pool_lock);
  for (c = 0; c < AL_PINNED_CLASSES; c++) if (lists[c]) break;
  if (c == AL_PINNED_CLASSES) return 0;
  if ((r = d->synchronize(d->ctx)) != 0) rc = r;
  for (c = 0; c < AL_PINNED_CLASSES; c++) {
    char *b = (char *)lists[c];
    while (b) {
      char *next = (char *)*(void **)(b + AL_PINNED_HEADER);
      if ((r = d->host_free(d->ctx, b)) != 0 && rc == 0) rc = r;
      b = next;
    }
  }
  return rc;
}

/* ------------------------------------------------------------------ CPU implementation
 * Plain: streams are worker threads; pinned memory is malloc'ed.
 * Strict (al_cpu_device_new_strict): also what CUDA does that can deadlock or serialize a
 * careless caller: host_alloc, host_free and synchronize wait until every stream of the device
 * has run what was queued on it (CUDA's implicit synchronization of page-locked allocations);
 * freeing a pointer host_alloc did not return is an error; with `queues` > 0, streams share
 * that many hardware queues (stream i on queue i % queues, CUDA_DEVICE_MAX_CONNECTIONS): the
 * commands of a queue run one at a time in the order they were enqueued, whatever their
 * stream, so a stream blocked in wait_value32 stalls every command enqueued after it on its
 * queue (event waits cannot deadlock this way: the record was enqueued first). A thread
 * inside a synchronizing call holds the device's driver lock while it waits, and every other
 * call (copies, events, value waits and writes) takes that lock: as in CUDA, where a thread
 * blocked in the driver (a pageable cudaMemcpy, cuMemFreeHost, a synchronize) can hold locks
 * another thread's cuEventQuery needs, so code that must keep running while a stream waits
 * on it (the progress engine) may make no device call. */
enum { AL_CMD_MEMCPY = 1, AL_CMD_RECORD, AL_CMD_WAIT, AL_CMD_WRITE, AL_CMD_HOSTFN, AL_CMD_STOP,
       AL_CMD_WAIT_EVENT, AL_CMD_DELAY };
enum { AL_TRACE_FREE = 100, AL_TRACE_ALLOC = 101, AL_TRACE_SYNC = 102 };

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
  unsigned long ticket;           /* strict with queues: position in the hardware queue */
  struct al_cmd *next;
} al_cmd;

/* A hardware queue shared by streams (strict device): one FIFO of commands in the order they
 * were enqueued, whichever stream they belong to; a command runs only when it is at the head. */
typedef struct al_cpu_queue {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  unsigned long next_ticket, serving;
} al_cpu_queue;

struct al_cpu_ctx;
typedef struct al_cpu_stream {
  pthread_t thread;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  al_cmd *head, *tail;
  int busy;                       /* a command is executing */
  long executed, enqueued;
  struct al_cpu_ctx *ctx;
  al_cpu_queue *queue;            /* strict with queues: the hardware queue it shares */
  struct al_cpu_stream *next_live;
} al_cpu_stream;

typedef struct al_cpu_trace { int kind; double t; const void *p; } al_cpu_trace;

typedef struct al_pinned_rec { void *p; struct al_pinned_rec *next; } al_pinned_rec;

#define AL_CPU_MAX_QUEUES 64
typedef struct al_cpu_ctx {
  pthread_mutex_t lock;
  al_cpu_trace *trace; long ntrace, cap;   /* executed commands, allocations, frees, in order */
  int strict, queues, nstreams;
  al_cpu_stream *live;                     /* strict: every stream not destroyed */
  al_pinned_rec *pinned;                   /* strict: live host_alloc pointers */
  long pinned_live, sync_waits;            /* strict: counters */
  pthread_mutex_t driver;                  /* strict: the driver lock (recursive) */
  al_cpu_queue hw[AL_CPU_MAX_QUEUES];
} al_cpu_ctx;

/* Strict device: a device call holds the driver lock for its duration. */
static void al_cpu_enter(void *ctx) {
  al_cpu_ctx *c = (al_cpu_ctx *)ctx;
  if (c->strict) pthread_mutex_lock(&c->driver);
}
static int al_cpu_leave(void *ctx, int rc) {
  al_cpu_ctx *c = (al_cpu_ctx *)ctx;
  if (c->strict) pthread_mutex_unlock(&c->driver);
  return rc;
}

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

static void al_cpu_event_unref(al_cpu_event *ev) {
  if (__atomic_sub_fetch(&ev->refs, 1, __ATOMIC_ACQ_REL) == 0) free(ev);
}

static void al_cpu_sleep(double secs) {
  struct timespec ts; ts.tv_sec = (time_t)secs; ts.tv_nsec = (long)((secs - (double)ts.tv_sec) * 1e9);
  nanosleep(&ts, NULL);
}

static void *al_cpu_worker(void *arg) {
  al_cpu_stream *s = (al_cpu_stream *)arg; al_cpu_ctx *c = s->ctx;
  for (;;) {
    pthread_mutex_lock(&s->lock);
    while (!s->head) pthread_cond_wait(&s->cond, &s->lock);
    al_cmd *cmd = s->head;
    s->busy = 1;
    pthread_mutex_unlock(&s->lock);
    if (s->queue) {                     /* wait for the command's turn in its hardware queue */
      pthread_mutex_lock(&s->queue->lock);
      while (s->queue->serving != cmd->ticket) pthread_cond_wait(&s->queue->cond, &s->queue->lock);
      pthread_mutex_unlock(&s->queue->lock);
    }
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
    if (s->queue) {
      pthread_mutex_lock(&s->queue->lock);
      s->queue->serving++;
      pthread_cond_broadcast(&s->queue->cond);
      pthread_mutex_unlock(&s->queue->lock);
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
  if (s->queue) pthread_mutex_lock(&s->queue->lock);     /* tickets in enqueue order */
  pthread_mutex_lock(&s->lock);
  if (s->queue) cmd->ticket = s->queue->next_ticket++;
  if (s->tail) s->tail->next = cmd; else s->head = cmd;
  s->tail = cmd;
  s->enqueued++;
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
  if (s->queue) pthread_mutex_unlock(&s->queue->lock);
  return 0;
}

static al_cmd *al_cpu_cmd(int kind) { al_cmd *c = (al_cmd *)calloc(1, sizeof(al_cmd)); if (c) c->kind = kind; return c; }

static int al_cpu_memcpy_async(void *ctx, void *dst, const void *src, size_t n, void *stream) {
  al_cmd *c = al_cpu_cmd(AL_CMD_MEMCPY); if (!c) return -1;
  c->dst = dst; c->src = src; c->n = n;
  al_cpu_enter(ctx); return al_cpu_leave(ctx, al_cpu_push((al_cpu_stream *)stream, c));
}
static int al_cpu_event_create(void *ctx, void **ev) {
  al_cpu_event *e = (al_cpu_event *)calloc(1, sizeof(al_cpu_event));
  if (!e) return -1;
  e->refs = 1; *ev = e; return 0;
}
static int al_cpu_event_record(void *ctx, void *ev, void *stream) {
  al_cpu_event *e = (al_cpu_event *)ev;
  al_cmd *c = al_cpu_cmd(AL_CMD_RECORD); if (!c) return -1;
  al_cpu_enter(ctx);
  c->ev = e; c->gen = __atomic_add_fetch(&e->recorded, 1, __ATOMIC_ACQ_REL);
  __atomic_add_fetch(&e->refs, 1, __ATOMIC_ACQ_REL);
  return al_cpu_leave(ctx, al_cpu_push((al_cpu_stream *)stream, c));
}
static int al_cpu_event_query(void *ctx, void *ev) {
  al_cpu_event *e = (al_cpu_event *)ev;
  al_cpu_enter(ctx);
  return al_cpu_leave(ctx, __atomic_load_n(&e->completed, __ATOMIC_ACQUIRE) >=
                               __atomic_load_n(&e->recorded, __ATOMIC_ACQUIRE));
}
static int al_cpu_event_destroy(void *ctx, void *ev) {
  al_cpu_enter(ctx); al_cpu_event_unref((al_cpu_event *)ev); return al_cpu_leave(ctx, 0);
}
static int al_cpu_stream_wait_event(void *ctx, void *stream, void *ev) {
  al_cpu_event *e = (al_cpu_event *)ev;
  al_cmd *c = al_cpu_cmd(AL_CMD_WAIT_EVENT); if (!c) return -1;
  al_cpu_enter(ctx);
  c->ev = e; c->gen = __atomic_load_n(&e->recorded, __ATOMIC_ACQUIRE);
  __atomic_add_fetch(&e->refs, 1, __ATOMIC_ACQ_REL);
  return al_cpu_leave(ctx, al_cpu_push((al_cpu_stream *)stream, c));
}
/* A command that keeps the stream busy for `secs` (stands in for a long kernel in tests). */
static int al_cpu_delay(void *stream, double secs) {
  al_cmd *c = al_cpu_cmd(AL_CMD_DELAY); if (!c) return -1;
  c->secs = secs; return al_cpu_push((al_cpu_stream *)stream, c);
}
static int al_cpu_wait_value32(void *ctx, void *stream, volatile uint32_t *addr, uint32_t value) {
  al_cmd *c = al_cpu_cmd(AL_CMD_WAIT); if (!c) return -1;
  c->addr = addr; c->value = value;
  al_cpu_enter(ctx); return al_cpu_leave(ctx, al_cpu_push((al_cpu_stream *)stream, c));
}
static int al_cpu_write_value32(void *ctx, void *stream, volatile uint32_t *addr, uint32_t value) {
  al_cmd *c = al_cpu_cmd(AL_CMD_WRITE); if (!c) return -1;
  c->addr = addr; c->value = value;
  al_cpu_enter(ctx); return al_cpu_leave(ctx, al_cpu_push((al_cpu_stream *)stream, c));
}

/* Wait until `s` has executed `target` commands; timeout in seconds (< 0: forever).
 * Returns 0, or 1 on timeout. */
static int al_cpu_stream_wait_executed(al_cpu_stream *s, long target, double timeout) {
  double deadline = al_dev_now() + timeout;
  pthread_mutex_lock(&s->lock);
  while (s->executed < target) {
    if (timeout >= 0 && al_dev_now() > deadline) { pthread_mutex_unlock(&s->lock); return 1; }
    struct timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 1000000; if (ts.tv_nsec >= 1000000000) { ts.tv_sec++; ts.tv_nsec -= 1000000000; }
    pthread_cond_timedwait(&s->cond, &s->lock, &ts);
  }
  pthread_mutex_unlock(&s->lock);
  return 0;
}

/* Block until every command queued so far on `s` has executed (timeout as above). */
static int al_cpu_stream_sync(al_cpu_stream *s, double timeout) {
  long target;
  pthread_mutex_lock(&s->lock);
  target = s->enqueued;
  pthread_mutex_unlock(&s->lock);
  return al_cpu_stream_wait_executed(s, target, timeout);
}

/* Strict device: wait until every live stream has run what was queued on it before this call
 * (the implicit synchronization of CUDA's page-locked allocations and cuCtxSynchronize). */
static int al_cpu_synchronize(void *ctx_) {
  al_cpu_ctx *c = (al_cpu_ctx *)ctx_;
  al_cpu_stream **streams; long *targets; al_cpu_stream *s;
  int n = 0, i, waited = 0;
  if (!c->strict) return 0;
  pthread_mutex_lock(&c->lock);
  for (s = c->live; s; s = s->next_live) n++;
  streams = (al_cpu_stream **)malloc((size_t)(n ? n : 1) * sizeof(*streams));
  targets = (long *)malloc((size_t)(n ? n : 1) * sizeof(*targets));
  if (!streams || !targets) { pthread_mutex_unlock(&c->lock); free(streams); free(targets); return -1; }
  for (s = c->live, i = 0; s; s = s->next_live, i++) {
    pthread_mutex_lock(&s->lock);
    streams[i] = s; targets[i] = s->enqueued;
    if (s->executed < s->enqueued) waited = 1;
    pthread_mutex_unlock(&s->lock);
  }
  if (waited) c->sync_waits++;
  pthread_mutex_unlock(&c->lock);
  al_cpu_enter(c);                         /* held while waiting: see the section comment */
  for (i = 0; i < n; i++) al_cpu_stream_wait_executed(streams[i], targets[i], -1.0);
  al_cpu_leave(c, 0);
  free(streams); free(targets);
  al_cpu_log(c, AL_TRACE_SYNC, NULL);
  return 0;
}

static int al_cpu_host_alloc(void *ctx_, size_t n, void **p) {
  al_cpu_ctx *c = (al_cpu_ctx *)ctx_;
  if (c->strict) {
    al_pinned_rec *r = (al_pinned_rec *)malloc(sizeof(*r));
    if (!r || al_cpu_synchronize(c) != 0) { free(r); return -1; }
    r->p = malloc(n ? n : 1);
    if (!r->p) { free(r); return -1; }
    pthread_mutex_lock(&c->lock);
    r->next = c->pinned; c->pinned = r; c->pinned_live++;
    pthread_mutex_unlock(&c->lock);
    *p = r->p;
  } else {
    *p = malloc(n ? n : 1);
    if (!*p) return -1;
  }
  al_cpu_log(c, AL_TRACE_ALLOC, *p);
  return 0;
}

static int al_cpu_host_free(void *ctx_, void *p) {
  al_cpu_ctx *c = (al_cpu_ctx *)ctx_;
  if (c->strict) {
    al_pinned_rec **r, *found = NULL;
    if (al_cpu_synchronize(c) != 0) return -1;
    pthread_mutex_lock(&c->lock);
    for (r = &c->pinned; *r; r = &(*r)->next)
      if ((*r)->p == p) { found = *r; *r = found->next; c->pinned_live--; break; }
    pthread_mutex_unlock(&c->lock);
    if (!found) return -2;               /* not pinned memory of this device */
    free(found);
  }
  al_cpu_log(c, AL_TRACE_FREE, p);
  free(p);
  return 0;
}

static void al_cpu_describe(void *ctx, int code, char *buf, size_t n) {
  snprintf(buf, n, code == -2 ? "not a pointer returned by host_alloc (CPU device)"
                              : "CPU device error %d (out of memory?)", code);
}

static al_cpu_stream *al_cpu_stream_new(al_cpu_ctx *ctx) {
  al_cpu_stream *s = (al_cpu_stream *)calloc(1, sizeof(al_cpu_stream));
  if (!s) return NULL;
  pthread_mutex_init(&s->lock, NULL);
  pthread_cond_init(&s->cond, NULL);
  s->ctx = ctx;
  pthread_mutex_lock(&ctx->lock);
  if (ctx->strict && ctx->queues > 0) s->queue = &ctx->hw[ctx->nstreams % ctx->queues];
  ctx->nstreams++;
  if (ctx->strict) { s->next_live = ctx->live; ctx->live = s; }
  pthread_mutex_unlock(&ctx->lock);
  if (pthread_create(&s->thread, NULL, al_cpu_worker, s) != 0) {
    pthread_mutex_lock(&ctx->lock);
    if (ctx->strict) ctx->live = s->next_live;
    pthread_mutex_unlock(&ctx->lock);
    free(s); return NULL;
  }
  return s;
}

static int al_cpu_stream_create(void *ctx, void **stream) {
  *stream = al_cpu_stream_new((al_cpu_ctx *)ctx); return *stream ? 0 : -1;
}
/* Stop the worker after the commands queued so far, join it and free the stream. */
static int al_cpu_stream_destroy(void *ctx_, void *stream) {
  al_cpu_stream *s = (al_cpu_stream *)stream, **p;
  al_cpu_ctx *c = s->ctx;
  al_cmd *cmd = al_cpu_cmd(AL_CMD_STOP); if (!cmd) return -1;
  al_cpu_push(s, cmd);
  if (pthread_join(s->thread, NULL) != 0) return -1;
  pthread_mutex_lock(&c->lock);
  for (p = &c->live; *p; p = &(*p)->next_live) if (*p == s) { *p = s->next_live; break; }
  pthread_mutex_unlock(&c->lock);
  pthread_mutex_destroy(&s->lock); pthread_cond_destroy(&s->cond);
  free(s);
  return 0;
}

/* strict: see the section comment; queues: 0 (a queue per stream) .. AL_CPU_MAX_QUEUES */
static al_device *al_cpu_device_new_strict(int strict, int queues) {
  al_device *d = (al_device *)calloc(1, sizeof(al_device));
  al_cpu_ctx *c = (al_cpu_ctx *)calloc(1, sizeof(al_cpu_ctx));
  int i;
  if (!d || !c || queues < 0 || queues > AL_CPU_MAX_QUEUES) { free(d); free(c); return NULL; }
  pthread_mutex_init(&c->lock, NULL);
  {
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);   /* host_alloc -> synchronize */
    pthread_mutex_init(&c->driver, &a);
    pthread_mutexattr_destroy(&a);
  }
  for (i = 0; i < AL_CPU_MAX_QUEUES; i++) {
    pthread_mutex_init(&c->hw[i].lock, NULL); pthread_cond_init(&c->hw[i].cond, NULL);
  }
  c->strict = strict; c->queues = strict ? queues : 0;
  d->ctx = c;
  AL_DEVICE_FILL(d, al_cpu_);
  return d;
}
static al_device *al_cpu_device_new(void) { return al_cpu_device_new_strict(0, 0); }

/* ------------------------------------------------------------------ CUDA implementation
 * The driver API through dlopen: no link-time CUDA dependency. The library's path is an argument
 * of the three entry points below (aluminum_py.config.cuda_driver(): AL_CUDA_LIBRARY when set,
 * e.g. the driver stand-in of aluminum_py.testing.cuda_standin, else libcuda.so.1); nothing
 * here reads the environment.
 * Device pointers and host-mapped pinned memory share one address space (UVA), so
 * cuMemcpyAsync copies in either direction and the flag's host address is its device address.
 *
 * Contexts: every call runs in the device's primary context. On a caller's thread it is pushed
 * and popped around the call (cuCtxPushCurrent/cuCtxPopCurrent), so the caller's current
 * context is what it was; only the progress engine's thread (al_cuda_mark_engine_thread) makes
 * it current for good. Errors are the CUresult codes; `describe` gives cuGetErrorName/String. */
typedef int al_CUresult;
typedef struct {
  void *lib;
  void *cuctx;
  int ordinal;
  al_CUresult (*cuInit)(unsigned int);
  al_CUresult (*cuDeviceGet)(int *, int);
  al_CUresult (*cuDeviceGetCount)(int *);
  al_CUresult (*cuDevicePrimaryCtxRetain)(void **, int);
  al_CUresult (*cuCtxGetCurrent)(void **);
  al_CUresult (*cuCtxSetCurrent)(void *);
  al_CUresult (*cuCtxPushCurrent)(void *);          /* _v2 */
  al_CUresult (*cuCtxPopCurrent)(void **);          /* _v2 */
  al_CUresult (*cuCtxSynchronize)(void);
  al_CUresult (*cuMemcpyAsync)(uintptr_t, uintptr_t, size_t, void *);
  al_CUresult (*cuEventCreate)(void **, unsigned int);
  al_CUresult (*cuEventRecord)(void *, void *);
  al_CUresult (*cuEventQuery)(void *);
  al_CUresult (*cuEventDestroy)(void *);            /* _v2 */
  al_CUresult (*cuStreamWaitValue32)(void *, uintptr_t, uint32_t, unsigned int);   /* _v2 */
  al_CUresult (*cuStreamWriteValue32)(void *, uintptr_t, uint32_t, unsigned int);  /* _v2 */
  al_CUresult (*cuStreamWaitEvent)(void *, void *, unsigned int);
  al_CUresult (*cuStreamCreate)(void **, unsigned int);
  al_CUresult (*cuStreamDestroy)(void *);           /* _v2 */
  al_CUresult (*cuMemHostAlloc)(void **, size_t, unsigned int);
  al_CUresult (*cuMemFreeHost)(void *);
  al_CUresult (*cuGetErrorName)(al_CUresult, const char **);
  al_CUresult (*cuGetErrorString)(al_CUresult, const char **);
} al_cuda_ctx;

#define AL_CU_EVENT_DISABLE_TIMING 0x2
#define AL_CU_STREAM_NON_BLOCKING 0x1
#define AL_CU_MEMHOSTALLOC_PORTABLE 0x1
#define AL_CU_MEMHOSTALLOC_DEVICEMAP 0x2
#define AL_CU_ERROR_NOT_READY 600

static __thread int al_cuda_engine_thread = 0;

/* Called once by the progress engine's thread: it keeps the contexts it sets current. */
static void al_cuda_mark_engine_thread(void) { al_cuda_engine_thread = 1; }

/* Make the device's context current for one call: returns 0 with *pushed telling whether
 * al_cuda_leave must pop it, or the CUresult of the failed push. */
static al_CUresult al_cuda_enter(al_cuda_ctx *c, int *pushed) {
  void *cur = NULL;
  *pushed = 0;
  if (c->cuCtxGetCurrent(&cur) == 0 && cur == c->cuctx) return 0;
  if (al_cuda_engine_thread) return c->cuCtxSetCurrent(c->cuctx);
  al_CUresult r = c->cuCtxPushCurrent(c->cuctx);
  if (r == 0) *pushed = 1;
  return r;
}
static void al_cuda_leave(al_cuda_ctx *c, int pushed) {
  void *popped = NULL;
  if (pushed) c->cuCtxPopCurrent(&popped);
}
/* Run CALL (a CUresult expression) with the device's context current; the CUresult is returned. */
#define AL_CU_CALL(ctx, CALL) do {                                                       \
    al_cuda_ctx *c_ = (al_cuda_ctx *)(ctx); int pushed_; al_CUresult r_;                 \
    if ((r_ = al_cuda_enter(c_, &pushed_)) != 0) return r_;                              \
    r_ = (CALL);                                                                          \
    al_cuda_leave(c_, pushed_);                                                           \
    return r_;                                                                            \
  } while (0)
#define AL_CU(ctx) ((al_cuda_ctx *)(ctx))

static int al_cuda_memcpy_async(void *ctx, void *dst, const void *src, size_t n, void *stream) {
  AL_CU_CALL(ctx, AL_CU(ctx)->cuMemcpyAsync((uintptr_t)dst, (uintptr_t)src, n, stream));
}
static int al_cuda_event_create(void *ctx, void **ev) {
  AL_CU_CALL(ctx, AL_CU(ctx)->cuEventCreate(ev, AL_CU_EVENT_DISABLE_TIMING));
}
static int al_cuda_event_record(void *ctx, void *ev, void *stream) {
  AL_CU_CALL(ctx, AL_CU(ctx)->cuEventRecord(ev, stream));
}
static int al_cuda_event_query_raw(void *ctx, void *ev) {
  AL_CU_CALL(ctx, AL_CU(ctx)->cuEventQuery(ev));
}
static int al_cuda_event_query(void *ctx, void *ev) {
  al_CUresult r = al_cuda_event_query_raw(ctx, ev);
  return r == 0 ? 1 : (r == AL_CU_ERROR_NOT_READY ? 0 : -r);
}
static int al_cuda_event_destroy(void *ctx, void *ev) {
  AL_CU_CALL(ctx, AL_CU(ctx)->cuEventDestroy(ev));
}
static int al_cuda_wait_value32(void *ctx, void *stream, volatile uint32_t *addr, uint32_t value) {
  AL_CU_CALL(ctx, AL_CU(ctx)->cuStreamWaitValue32(stream, (uintptr_t)addr, value, 0 /* GEQ */));
}
static int al_cuda_write_value32(void *ctx, void *stream, volatile uint32_t *addr, uint32_t value) {
  AL_CU_CALL(ctx, AL_CU(ctx)->cuStreamWriteValue32(stream, (uintptr_t)addr, value, 0));
}
static int al_cuda_host_alloc(void *ctx, size_t n, void **p) {
  AL_CU_CALL(ctx, AL_CU(ctx)->cuMemHostAlloc(p, n ? n : 1,
                                             AL_CU_MEMHOSTALLOC_PORTABLE | AL_CU_MEMHOSTALLOC_DEVICEMAP));
}
static int al_cuda_host_free(void *ctx, void *p) {
  AL_CU_CALL(ctx, AL_CU(ctx)->cuMemFreeHost(p));
}
static int al_cuda_synchronize(void *ctx) {
  AL_CU_CALL(ctx, AL_CU(ctx)->cuCtxSynchronize());
}
static int al_cuda_stream_create(void *ctx, void **stream) {
  AL_CU_CALL(ctx, AL_CU(ctx)->cuStreamCreate(stream, AL_CU_STREAM_NON_BLOCKING));
}
/* cuStreamDestroy_v2 returns at once; the driver releases the stream when its work is done. */
static int al_cuda_stream_destroy(void *ctx, void *stream) {
  AL_CU_CALL(ctx, AL_CU(ctx)->cuStreamDestroy(stream));
}
static int al_cuda_stream_wait_event(void *ctx, void *stream, void *ev) {
  AL_CU_CALL(ctx, AL_CU(ctx)->cuStreamWaitEvent(stream, ev, 0));
}
static void al_cuda_describe(void *ctx, int code, char *buf, size_t n) {
  al_cuda_ctx *c = (al_cuda_ctx *)ctx;
  const char *name = NULL, *text = NULL;
  if (c->cuGetErrorName(code, &name) != 0 || !name) name = "unknown CUresult";
  if (c->cuGetErrorString(code, &text) != 0 || !text) text = "";
  snprintf(buf, n, "%s (CUresult %d)%s%s", name, code, *text ? ": " : "", text);
}

/* Symbols are resolved by their exact names, except those whose current ABI is the _v2 entry
 * point (cuda.h maps the plain name to it); never "<name>_v2 if it exists": CUDA 13's
 * cuCtxGetDevice_v2 and the undocumented cuEventRecord_v2 have other meanings. */
#define AL_CU_SYM_AS(field, symbol)                                                  \
  do { *(void **)(&c->field) = dlsym(c->lib, symbol);                                \
       if (!c->field) { snprintf(err, errlen, "%s has no %s", path, symbol); goto fail; } } while (0)
#define AL_CU_SYM(name) AL_CU_SYM_AS(name, #name)
#define AL_CU_SYM_V2(name) AL_CU_SYM_AS(name, #name "_v2")

/* The number of CUDA devices (cuInit + cuDeviceGetCount: no context is created or retained).
 * The probes below keep the library loaded (libcuda must not be unloaded after cuInit).
 * Returns 0 with *count set, or -1 with a message in err (no driver, or cuInit failed). */
static int al_cuda_device_count(const char *path, int *count, char *err, size_t errlen) {
  al_CUresult (*init)(unsigned int);
  al_CUresult (*get_count)(int *);
  al_CUresult r;
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  *count = 0;
  if (!lib) { snprintf(err, errlen, "no CUDA driver (%s)", dlerror()); return -1; }
  *(void **)(&init) = dlsym(lib, "cuInit");
  *(void **)(&get_count) = dlsym(lib, "cuDeviceGetCount");
  if (!init || !get_count) { snprintf(err, errlen, "%s lacks cuInit/cuDeviceGetCount", path); return -1; }
  if ((r = init(0)) != 0) {
    /* CUDA_ERROR_NO_DEVICE (100): a driver without devices */
   
    if (r == 100) return 0;
    snprintf(err, errlen, "cuInit failed (CUresult %d)", r); return -1;
  }
  if ((r = get_count(count)) != 0) { snprintf(err, errlen, "cuDeviceGetCount failed (CUresult %d)", r); return -1; }
 
  return 0;
}

/* The CUDA device for device ordinal `ordinal` (its primary context is retained); NULL with a
 * message in err when there is no driver or no such device. */
static al_device *al_cuda_device_new(const char *path, int ordinal, char *err, size_t errlen) {
  al_cuda_ctx *c = (al_cuda_ctx *)calloc(1, sizeof(al_cuda_ctx));
  al_device *d = (al_device *)calloc(1, sizeof(al_device));
  int n = 0, dev = 0;
  al_CUresult r;
  if (!c || !d) { snprintf(err, errlen, "out of memory"); goto fail; }
  c->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!c->lib) { snprintf(err, errlen, "no CUDA driver (%s)", dlerror()); goto fail; }
  AL_CU_SYM(cuInit); AL_CU_SYM(cuDeviceGet); AL_CU_SYM(cuDeviceGetCount);
  AL_CU_SYM(cuDevicePrimaryCtxRetain); AL_CU_SYM(cuCtxGetCurrent); AL_CU_SYM(cuCtxSetCurrent);
  AL_CU_SYM_V2(cuCtxPushCurrent); AL_CU_SYM_V2(cuCtxPopCurrent); AL_CU_SYM(cuCtxSynchronize);
  AL_CU_SYM(cuMemcpyAsync); AL_CU_SYM(cuEventCreate); AL_CU_SYM(cuEventRecord);
  AL_CU_SYM(cuEventQuery); AL_CU_SYM_V2(cuEventDestroy); AL_CU_SYM_V2(cuStreamWaitValue32);
  AL_CU_SYM_V2(cuStreamWriteValue32); AL_CU_SYM(cuStreamWaitEvent); AL_CU_SYM(cuStreamCreate);
  AL_CU_SYM_V2(cuStreamDestroy); AL_CU_SYM(cuMemHostAlloc); AL_CU_SYM(cuMemFreeHost);
  AL_CU_SYM(cuGetErrorName); AL_CU_SYM(cuGetErrorString);
  if ((r = c->cuInit(0)) != 0 || (r = c->cuDeviceGetCount(&n)) != 0 || n == 0) {
    snprintf(err, errlen, "no CUDA device is available"); goto fail; }
  if (ordinal < 0 || ordinal >= n || c->cuDeviceGet(&dev, ordinal) || c->cuDevicePrimaryCtxRetain(&c->cuctx, dev)) {
    snprintf(err, errlen, "CUDA device %d is not available (%d devices)", ordinal, n); goto fail; }
  c->ordinal = ordinal;
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
static int al_cuda_current_device(const char *path, int *ordinal, char *err, size_t errlen) {
  al_CUresult (*cuInit)(unsigned int);
  al_CUresult (*cuCtxGetCurrent)(void **);
  al_CUresult (*cuCtxGetDevice)(int *);
  al_CUresult (*cuDeviceGetCount)(int *);
  al_CUresult (*cuDeviceGet)(int *, int);
  void *ctx = NULL; int dev = -1, n = 0, i, h, found = -1; al_CUresult r;
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) { snprintf(err, errlen, "no CUDA driver (%s)", dlerror()); return -1; }
  *(void **)(&cuInit) = dlsym(lib, "cuInit");
  *(void **)(&cuCtxGetCurrent) = dlsym(lib, "cuCtxGetCurrent");
  *(void **)(&cuCtxGetDevice) = dlsym(lib, "cuCtxGetDevice");
  *(void **)(&cuDeviceGetCount) = dlsym(lib, "cuDeviceGetCount");
  *(void **)(&cuDeviceGet) = dlsym(lib, "cuDeviceGet");
  if (!cuInit || !cuCtxGetCurrent || !cuCtxGetDevice || !cuDeviceGetCount || !cuDeviceGet) {
    snprintf(err, errlen, "%s lacks cuCtxGetCurrent/cuCtxGetDevice", path); return -1; }
  if ((r = cuInit(0)) != 0) { snprintf(err, errlen, "cuInit failed (CUresult %d)", r); return -1; }
  if ((r = cuCtxGetCurrent(&ctx)) != 0) { snprintf(err, errlen, "cuCtxGetCurrent failed (CUresult %d)", r); return -1; }
  if (ctx == NULL) { return 0; }
  if ((r = cuCtxGetDevice(&dev)) != 0) { snprintf(err, errlen, "cuCtxGetDevice failed (CUresult %d)", r); return -1; }
  /* CUdevice is a handle: find the ordinal whose handle it is */
  if (cuDeviceGetCount(&n) == 0)
    for (i = 0; i < n && found < 0; i++)
      if (cuDeviceGet(&h, i) == 0 && h == dev) found = i;
 
  if (found < 0) { snprintf(err, errlen, "the current context's device %d has no ordinal", dev); return -1; }
  *ordinal = found;
  return 1;
}
#endif
