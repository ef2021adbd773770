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
 *   mem_alloc_async  device memory ordered on the stream (cuMemAllocAsync): usable by work
 *   mem_free_async   queued on it after the call; the free returns it once the work queued
 *                  before the free has run (cuMemFreeAsync). Neither synchronizes.
 *   stream_create  a new stream (CUDA: non-blocking); stream_destroy releases it once the work
 *                  queued on it has run (CUDA: cuStreamDestroy returns at once; CPU: joins)
 *   stream_wait_event  the stream waits for the event's latest record at the time of the call
 *                  (the event may be destroyed right after, as in CUDA)
 */
#ifndef AL_DEVICE_INTERFACE_H
#define AL_DEVICE_INTERFACE_H
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
  int (*mem_alloc_async)(void *ctx, size_t n, void *stream, void **p);
  int (*mem_free_async)(void *ctx, void *p, void *stream);
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
    (d)->mem_alloc_async = PREFIX##mem_alloc_async;                                         \
    (d)->mem_free_async = PREFIX##mem_free_async;                                           \
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

#endif  /* AL_DEVICE_INTERFACE_H */
