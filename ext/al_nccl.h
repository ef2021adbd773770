/* NCCL through dlopen: one table of function pointers, filled by al_nccl_load().
 * Types come from the wheel's nccl.h (AL_HAVE_NCCL_H, with stub CUDA headers) or from
 * nccl_fallback.h; nothing here links against CUDA or NCCL. */
#ifndef AL_NCCL_H
#define AL_NCCL_H
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#ifdef AL_HAVE_NCCL_H
#include <nccl.h>
#else
#include "nccl_fallback.h"
#endif

typedef struct {
  void *handle;
  ncclResult_t (*GetVersion)(int *);
  ncclResult_t (*GetUniqueId)(ncclUniqueId *);
  ncclResult_t (*CommInitRankConfig)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
  ncclResult_t (*CommSplit)(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *);
  ncclResult_t (*CommFinalize)(ncclComm_t);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*CommAbort)(ncclComm_t);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
  ncclResult_t (*CommCount)(const ncclComm_t, int *);
  ncclResult_t (*CommUserRank)(const ncclComm_t, int *);
  ncclResult_t (*CommCuDevice)(const ncclComm_t, int *);
  const char *(*GetErrorString)(ncclResult_t);
  const char *(*GetLastError)(ncclComm_t);           /* NULL before NCCL 2.13 */
  ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*Broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Reduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*AllGather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*ReduceScatter)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*Send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*GroupStart)(void);
  ncclResult_t (*GroupEnd)(void);
} al_nccl_api;

#define AL_NCCL_SYM(api, name, required)                                        \
  do {                                                                          \
    *(void **)(&(api)->name) = dlsym((api)->handle, "nccl" #name);              \
    if ((required) && !(api)->name) {                                           \
      snprintf(err, errlen, "%s has no symbol nccl" #name, path);               \
      dlclose((api)->handle); memset(api, 0, sizeof(*api)); return -1; }        \
  } while (0)

/* Returns 0, or -1 with a message in err. */
static int al_nccl_load(const char *path, al_nccl_api *api, char *err, size_t errlen) {
  memset(api, 0, sizeof(*api));
  api->handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!api->handle) { snprintf(err, errlen, "%s", dlerror()); return -1; }
  AL_NCCL_SYM(api, GetVersion, 1);
  AL_NCCL_SYM(api, GetUniqueId, 1);
  AL_NCCL_SYM(api, CommInitRankConfig, 1);
  AL_NCCL_SYM(api, CommSplit, 1);
  AL_NCCL_SYM(api, CommFinalize, 1);
  AL_NCCL_SYM(api, CommDestroy, 1);
  AL_NCCL_SYM(api, CommAbort, 1);
  AL_NCCL_SYM(api, CommGetAsyncError, 1);
  AL_NCCL_SYM(api, CommCount, 1);
  AL_NCCL_SYM(api, CommUserRank, 1);
  AL_NCCL_SYM(api, CommCuDevice, 1);
  AL_NCCL_SYM(api, GetErrorString, 1);
  AL_NCCL_SYM(api, GetLastError, 0);
  AL_NCCL_SYM(api, AllReduce, 1);
  AL_NCCL_SYM(api, Broadcast, 1);
  AL_NCCL_SYM(api, Reduce, 1);
  AL_NCCL_SYM(api, AllGather, 1);
  AL_NCCL_SYM(api, ReduceScatter, 1);
  AL_NCCL_SYM(api, Send, 1);
  AL_NCCL_SYM(api, Recv, 1);
  AL_NCCL_SYM(api, GroupStart, 1);
  AL_NCCL_SYM(api, GroupEnd, 1);
  return 0;
}

/* A nonblocking communicator's calls may return ncclInProgress; its state must then be polled
 * with ncclCommGetAsyncError until it is no longer ncclInProgress before the next NCCL call.
 * al_nccl_poll does that with `get` (ncclCommGetAsyncError, or a test double): returns the
 * query's own error, or ncclSuccess with *state the last state seen (ncclInProgress when
 * `timeout` seconds passed first; timeout < 0: no limit) and *polls the number of queries.
 * Sleeps between polls, from 1 us growing to 1 ms, so a long wait does not spin. */
typedef ncclResult_t (*al_nccl_get_t)(ncclComm_t, ncclResult_t *);

static double al_nccl_now(void) {
  struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static ncclResult_t al_nccl_poll(al_nccl_get_t get, ncclComm_t comm, double timeout,
                                 ncclResult_t *state, long *polls) {
  double deadline = al_nccl_now() + timeout;
  long pause_ns = 1000;
  ncclResult_t rc;
  *polls = 0;
  for (;;) {
    rc = get(comm, state);
    (*polls)++;
    if (rc != ncclSuccess) return rc;
    if (*state != ncclInProgress) return ncclSuccess;
    if (timeout >= 0 && al_nccl_now() >= deadline) return ncclSuccess;
    struct timespec ts = {0, pause_ns};
    nanosleep(&ts, NULL);
    if (pause_ns < 1000000) pause_ns *= 2;
  }
}

static ncclConfig_t al_nccl_config_init(void) {
  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
  return c;
}
/* The communicator NCCL's init thread stores into a split's slot (acquire: pairs with its
   release store). */
static inline ncclComm_t al_nccl_slot_load(ncclComm_t *slot) {
  return __atomic_load_n(slot, __ATOMIC_ACQUIRE);
}
#endif
