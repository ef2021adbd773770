/* The CUDA implementation of the device interface (device/interface.h). */
#ifndef AL_DEVICE_CUDA_H
#define AL_DEVICE_CUDA_H
#include "interface.h"

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
  al_CUresult (*cuMemAllocAsync)(uintptr_t *, size_t, void *);
  al_CUresult (*cuMemFreeAsync)(uintptr_t, void *);
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
static int al_cuda_mem_alloc_async(void *ctx, size_t n, void *stream, void **p) {
  AL_CU_CALL(ctx, AL_CU(ctx)->cuMemAllocAsync((uintptr_t *)p, n ? n : 1, stream));
}
static int al_cuda_mem_free_async(void *ctx, void *p, void *stream) {
  AL_CU_CALL(ctx, AL_CU(ctx)->cuMemFreeAsync((uintptr_t)p, stream));
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
  AL_CU_SYM(cuMemAllocAsync); AL_CU_SYM(cuMemFreeAsync);
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

#endif  /* AL_DEVICE_CUDA_H */
