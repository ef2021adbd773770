/* The CPU implementation of the device interface (device/interface.h). */
#ifndef AL_DEVICE_CPU_H
#define AL_DEVICE_CPU_H
#include "interface.h"

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

/* Device memory is host memory: allocated at once, freed by a command queued on the stream,
 * so after the work queued before the free (stream order, as cuMemFreeAsync). */
static int al_cpu_mem_alloc_async(void *ctx, size_t n, void *stream, void **p) {
  *p = malloc(n ? n : 1);
  return *p ? 0 : -1;
}
static int al_cpu_mem_free_async(void *ctx, void *p, void *stream) {
  al_cmd *c = al_cpu_cmd(AL_CMD_HOSTFN); if (!c) return -1;
  c->fn = free; c->arg = p;
  al_cpu_enter(ctx); return al_cpu_leave(ctx, al_cpu_push((al_cpu_stream *)stream, c));
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

#endif  /* AL_DEVICE_CPU_H */
