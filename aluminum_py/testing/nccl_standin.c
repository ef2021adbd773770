/* nccl_standin.c: a stand-in for NCCL (libnccl.so.2), built into the same library as the CUDA
 * driver stand-in (cuda_standin.c) so that both see the same streams. It exports the NCCL API
 * aluminum_py's binding uses, with NCCL's documented semantics, and carries the collectives out
 * over MPI: load it with AL_NCCL_LIBRARY (and AL_CUDA_LIBRARY) = the built library's path.
 * aluminum_py/testing/cuda_standin.py builds it (with mpicc); tests/standin tests it.
 *
 * Model:
 *   - ncclGetUniqueId: the id names its creator (rank in MPI_COMM_WORLD) and a per-process
 *     counter. ncclCommInitRankConfig: every member sends (its rank, its world rank) to the
 *     creator, which must be a member (as when rank 0 makes the id and broadcasts it), over
 *     MPI_COMM_WORLD with a tag from the counter; the creator answers with the ordered list,
 *     and the members build their MPI communicator with MPI_Comm_create_group (collective over
 *     the members only). One rank needs no MPI at all.
 *   - ncclCommSplit: MPI_Comm_split of the parent's communicator, in the parent's call order.
 *   - Configs are validated as NCCL 2.18+ does (magic, blocking 0/1, cgaClusterSize >= 0,
 *     minCTAs/maxCTAs >= 1 and minCTAs <= maxCTAs compared raw, so minCTAs with maxCTAs unset
 *     is ncclInvalidArgument).
 *   - Nonblocking communicators (blocking = 0): creation and splits run on a thread and the
 *     state is ncclInProgress until they are done; a collective leaves the state ncclInProgress
 *     for AL_NCCL_STANDIN_POLLS ncclCommGetAsyncError queries (default 3) and returns
 *     ncclInProgress. ncclCommSplit answers ncclSuccess even then and writes *newcomm later,
 *     from its thread, as NCCL 2.28 does. standin_nccl_stall(1) makes every state that would
 *     settle stay ncclInProgress (a peer that never joins).
 *   - A collective is enqueued on its stream as a host command (standin_enqueue_host): the
 *     stream's worker runs it when the stream reaches it, in the order the operations were
 *     issued on their communicator (a ticket per communicator), with blocking MPI calls on the
 *     communicator's MPI communicator (MPI_THREAD_MULTIPLE). Reductions are computed here in
 *     rank order in the element type (float16 and bfloat16 through float); ncclAvg divides
 *     the sum by the rank count. Groups (ncclGroupStart/End) enqueue their operations at the
 *     outermost ncclGroupEnd, one host command per communicator and stream: sends and receives
 *     are posted together (MPI_Isend/Irecv) so that a group's exchanges cannot deadlock.
 *   - Every launch is recorded (collective, count, datatype, op, root or peer, the
 *     communicator's minCTAs/maxCTAs as configured, its rank count and id, the stream) for
 *     tests: standin_nccl_launch_count / standin_nccl_launch_get / standin_nccl_reset.
 * Not modelled: user-defined reduction ops, registration, ncclMemAlloc, CUDA graphs. */
#include <mpi.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void *CUstream;
typedef int CUresult;
extern CUresult standin_enqueue_host(CUstream h, void (*fn)(void *), void *arg);
extern int standin_current_device(void);

typedef enum { ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2,
               ncclInternalError = 3, ncclInvalidArgument = 4, ncclInvalidUsage = 5,
               ncclRemoteError = 6, ncclInProgress = 7 } ncclResult_t;
enum { T_INT8, T_UINT8, T_INT32, T_UINT32, T_INT64, T_UINT64, T_FLOAT16, T_FLOAT32, T_FLOAT64,
       T_BFLOAT16, N_TYPES };
enum { OP_SUM, OP_PROD, OP_MAX, OP_MIN, OP_AVG, N_OPS };
static const size_t type_size[N_TYPES] = { 1, 1, 4, 4, 8, 8, 2, 4, 8, 2 };

#define STANDIN_VERSION 22809
#define NCCL_API_MAGIC 0xcafebeef
#define UNDEF_INT INT_MIN
#define MAXCHANNELS 64
#define ID_MAGIC "al-nccl-standin"

typedef struct { char internal[128]; } ncclUniqueId;
/* The leading fields of every ncclConfig_t since 2.17 (later versions append). */
typedef struct {
  size_t size; unsigned int magic; unsigned int version;
  int blocking; int cgaClusterSize; int minCTAs; int maxCTAs;
} config_prefix;

struct id_body { char magic[16]; int creator; int pad; uint64_t counter; };

/* ------------------------------------------------------------------ communicators */
#define COMM_MAGIC 0x5ccc0a11u
struct scomm {
  unsigned magic;
  long id;                           /* unique in the process, for launch records */
  int nranks, rank, device;
  int blocking, cfg_min, cfg_max;    /* cfg_*: as configured (UNDEF_INT: unset) */
  MPI_Comm mpi;                      /* MPI_COMM_NULL for one rank */
  _Atomic int state;                 /* ncclCommGetAsyncError's answer */
  _Atomic int settle;                /* queries left before ncclInProgress settles */
  int aborted;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t issued, done;             /* issue-order tickets */
};

static atomic_long g_next_comm_id = 1;
static atomic_ulong g_uid_counter;
static _Atomic int g_stall;
static char g_last_error[512];
static pthread_mutex_t g_err_mu = PTHREAD_MUTEX_INITIALIZER;

/* Set the last error (ncclGetLastError) and return rc. */
static ncclResult_t fail(ncclResult_t rc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  pthread_mutex_lock(&g_err_mu);
  vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
  pthread_mutex_unlock(&g_err_mu);
  va_end(ap);
  return rc;
}

static int settle_polls(void) {
  const char *v = getenv("AL_NCCL_STANDIN_POLLS");
  int n = v && *v ? atoi(v) : 3;
  return n < 0 ? 0 : n;
}

/* After an operation on a nonblocking communicator: ncclInProgress for a few queries (none
   with AL_NCCL_STANDIN_POLLS=0: the call still answers ncclInProgress). */
static void comm_in_progress(struct scomm *c) {
  int n = settle_polls();
  atomic_store(&c->settle, n);
  atomic_store(&c->state, n > 0 ? ncclInProgress : ncclSuccess);
}

static struct scomm *comm_ok(void *h) {
  struct scomm *c = h;
  return c && c->magic == COMM_MAGIC ? c : NULL;
}

static uint64_t ticket_take(struct scomm *c) {
  pthread_mutex_lock(&c->mu);
  uint64_t t = c->issued++;
  pthread_mutex_unlock(&c->mu);
  return t;
}
static void ticket_wait(struct scomm *c, uint64_t t) {
  pthread_mutex_lock(&c->mu);
  while (c->done != t) pthread_cond_wait(&c->cv, &c->mu);
  pthread_mutex_unlock(&c->mu);
}
static void ticket_done(struct scomm *c) {
  pthread_mutex_lock(&c->mu);
  c->done++;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}
static void drain(struct scomm *c) {            /* wait until every issued operation ran */
  pthread_mutex_lock(&c->mu);
  while (c->done != c->issued) pthread_cond_wait(&c->cv, &c->mu);
  pthread_mutex_unlock(&c->mu);
}

static struct scomm *comm_new(int nranks, int rank, const config_prefix *cfg) {
  struct scomm *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->magic = COMM_MAGIC;
  c->id = atomic_fetch_add(&g_next_comm_id, 1);
  c->nranks = nranks; c->rank = rank; c->device = standin_current_device();
  c->blocking = cfg->blocking == 0 ? 0 : 1;
  c->cfg_min = cfg->minCTAs; c->cfg_max = cfg->maxCTAs;
  c->mpi = MPI_COMM_NULL;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  atomic_store(&c->state, ncclSuccess);
  return c;
}

/* Validate and read a config as NCCL 2.18+ does; NULL means the defaults. */
static ncclResult_t read_config(const void *p, config_prefix *out) {
  config_prefix d = { sizeof d, NCCL_API_MAGIC, STANDIN_VERSION, UNDEF_INT, UNDEF_INT, UNDEF_INT,
                      UNDEF_INT };
  if (p) {
    size_t n;
    memcpy(&n, p, sizeof n);
    memcpy(&d, p, n < sizeof d ? n : sizeof d);
    if (d.magic != NCCL_API_MAGIC)
      return fail(ncclInvalidArgument, "ncclConfig_t argument not initialized via "
                  "NCCL_CONFIG_INITIALIZER");
    if (d.blocking != UNDEF_INT && d.blocking != 0 && d.blocking != 1)
      return fail(ncclInvalidArgument, "Invalid config blocking attribute value %d", d.blocking);
    if (d.cgaClusterSize != UNDEF_INT && d.cgaClusterSize < 0)
      return fail(ncclInvalidArgument, "Invalid config cgaClusterSize attribute value %d", d.cgaClusterSize);
    if ((d.minCTAs != UNDEF_INT && d.minCTAs <= 0) || (d.maxCTAs != UNDEF_INT && d.maxCTAs <= 0) ||
        d.minCTAs > d.maxCTAs) {
      char b[64];
      snprintf(b, sizeof b, "%d/%d", d.minCTAs, d.maxCTAs);
      return fail(ncclInvalidArgument, "Invalid config min/max channels attribute value %s", b);
    }
  }
  *out = d;
  return ncclSuccess;
}

static int mpi_ready(void) {
  int init = 0, fin = 0, level = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin) return 0;
  MPI_Query_thread(&level);
  return level == MPI_THREAD_MULTIPLE ? 1 : -1;
}

/* ------------------------------------------------------------------ launch records */
struct launch {
  char coll[16]; long count; int dtype, op, root, peer;
  int min_ctas, max_ctas, nranks, rank; long comm_id; uintptr_t stream; int grouped; long group;
};
static struct launch *g_launches;
static long g_nlaunches, g_cap;
static pthread_mutex_t g_launch_mu = PTHREAD_MUTEX_INITIALIZER;

static void record(const char *coll, size_t count, int dtype, int op, int root, int peer,
                   const struct scomm *c, CUstream stream, int grouped, long group) {
  pthread_mutex_lock(&g_launch_mu);
  if (g_nlaunches == g_cap) {
    long cap = g_cap ? 2 * g_cap : 256;
    struct launch *l = realloc(g_launches, (size_t)cap * sizeof *l);
    if (l) { g_launches = l; g_cap = cap; }
  }
  if (g_nlaunches < g_cap) {
    struct launch *l = &g_launches[g_nlaunches++];
    memset(l, 0, sizeof *l);
    snprintf(l->coll, sizeof l->coll, "%s", coll);
    l->count = (long)count; l->dtype = dtype; l->op = op; l->root = root; l->peer = peer;
    l->min_ctas = c->cfg_min; l->max_ctas = c->cfg_max; l->nranks = c->nranks; l->rank = c->rank;
    l->comm_id = c->id; l->stream = (uintptr_t)stream; l->grouped = grouped; l->group = group;
  }
  pthread_mutex_unlock(&g_launch_mu);
}

long standin_nccl_launch_count(void) {
  pthread_mutex_lock(&g_launch_mu);
  long n = g_nlaunches;
  pthread_mutex_unlock(&g_launch_mu);
  return n;
}
/* Launch i: its collective name into coll (16 bytes) and 13 integers into v: count, dtype,
 * op, root, peer, minCTAs, maxCTAs (INT_MIN: unset), nranks, rank, comm id, stream, grouped,
 * and the serial number of the outermost group it was issued in (0: none). Returns 0, or -1 if there is no launch i. */
int standin_nccl_launch_get(long i, char *coll, long *v) {
  pthread_mutex_lock(&g_launch_mu);
  int rc = -1;
  if (i >= 0 && i < g_nlaunches) {
    struct launch *l = &g_launches[i];
    memcpy(coll, l->coll, sizeof l->coll);
    long vals[13] = { l->count, l->dtype, l->op, l->root, l->peer, l->min_ctas, l->max_ctas,
                      l->nranks, l->rank, l->comm_id, (long)l->stream, l->grouped, l->group };
    memcpy(v, vals, sizeof vals);
    rc = 0;
  }
  pthread_mutex_unlock(&g_launch_mu);
  return rc;
}
void standin_nccl_reset(void) {
  pthread_mutex_lock(&g_launch_mu);
  g_nlaunches = 0;
  pthread_mutex_unlock(&g_launch_mu);
}
/* 1: states that would settle stay ncclInProgress (a peer that never joins); 0: normal. */
void standin_nccl_stall(int on) { atomic_store(&g_stall, on); }

/* ------------------------------------------------------------------ reductions */
static float half_to_float(uint16_t h) {
  uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, f;
  if (e == 0) {
    if (m == 0) f = s;
    else { e = 113; while (!(m & 0x400)) { m <<= 1; e--; } m &= 0x3ff; f = s | (e << 23) | (m << 13); }
  } else if (e == 31) f = s | 0x7f800000u | (m << 13);
  else f = s | ((e + 112) << 23) | (m << 13);
  float out; memcpy(&out, &f, 4); return out;
}
static uint16_t float_to_half(float x) {           /* round to nearest even */
  uint32_t f; memcpy(&f, &x, 4);
  uint32_t s = (f >> 16) & 0x8000; int e = (int)((f >> 23) & 0xff) - 127 + 15; uint32_t m = f & 0x7fffff;
  if (((f >> 23) & 0xff) == 0xff) return (uint16_t)(s | 0x7c00 | (m ? 0x200 : 0));
  if (e >= 31) return (uint16_t)(s | 0x7c00);
  if (e <= 0) {
    if (e < -10) return (uint16_t)s;
    m |= 0x800000; int shift = 14 - e;
    uint32_t hm = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (hm & 1))) hm++;
    return (uint16_t)(s | hm);
  }
  uint32_t hm = m >> 13, rem = m & 0x1fff;
  uint32_t out = s | ((uint32_t)e << 10) | hm;
  if (rem > 0x1000 || (rem == 0x1000 && (hm & 1))) out++;
  return (uint16_t)out;
}
static float bf16_to_float(uint16_t b) { uint32_t f = (uint32_t)b << 16; float x; memcpy(&x, &f, 4); return x; }
static uint16_t float_to_bf16(float x) {
  uint32_t f; memcpy(&f, &x, 4);
  if ((f & 0x7f800000u) == 0x7f800000u && (f & 0x7fffff)) return (uint16_t)((f >> 16) | 0x40);
  f += 0x7fff + ((f >> 16) & 1);
  return (uint16_t)(f >> 16);
}

#define FOLD(T) do { T *a = (T *)acc; const T *b = (const T *)in;                           \
    for (size_t i = 0; i < n; i++) switch (op) {                                          \
      case OP_PROD: a[i] = (T)(a[i] * b[i]); break;                                       \
      case OP_MAX: a[i] = a[i] > b[i] ? a[i] : b[i]; break;                               \
      case OP_MIN: a[i] = a[i] < b[i] ? a[i] : b[i]; break;                               \
      default: a[i] = (T)(a[i] + b[i]); } } while (0)
#define FOLD16(TO, FROM) do { uint16_t *a = (uint16_t *)acc; const uint16_t *b = (const uint16_t *)in; \
    for (size_t i = 0; i < n; i++) { float x = TO(a[i]), y = TO(b[i]), r;                \
      switch (op) { case OP_PROD: r = x * y; break; case OP_MAX: r = x > y ? x : y; break;  \
        case OP_MIN: r = x < y ? x : y; break; default: r = x + y; }                        \
      a[i] = FROM(r); } } while (0)

static void fold(void *acc, const void *in, size_t n, int dtype, int op) {   /* acc = acc op in */
  switch (dtype) {
  case T_INT8: FOLD(int8_t); break;     case T_UINT8: FOLD(uint8_t); break;
  case T_INT32: FOLD(int32_t); break;   case T_UINT32: FOLD(uint32_t); break;
  case T_INT64: FOLD(int64_t); break;   case T_UINT64: FOLD(uint64_t); break;
  case T_FLOAT32: FOLD(float); break;   case T_FLOAT64: FOLD(double); break;
  case T_FLOAT16: FOLD16(half_to_float, float_to_half); break;
  case T_BFLOAT16: FOLD16(bf16_to_float, float_to_bf16); break;
  }
}

#define DIV(T) do { T *a = (T *)acc; for (size_t i = 0; i < n; i++) a[i] = (T)(a[i] / (T)k); } while (0)
#define DIV16(TO, FROM) do { uint16_t *a = (uint16_t *)acc;                                   \
    for (size_t i = 0; i < n; i++) a[i] = FROM(TO(a[i]) / (float)k); } while (0)
static void divide(void *acc, size_t n, int dtype, int k) {           /* ncclAvg */
  switch (dtype) {
  case T_INT8: DIV(int8_t); break;     case T_UINT8: DIV(uint8_t); break;
  case T_INT32: DIV(int32_t); break;   case T_UINT32: DIV(uint32_t); break;
  case T_INT64: DIV(int64_t); break;   case T_UINT64: DIV(uint64_t); break;
  case T_FLOAT32: DIV(float); break;   case T_FLOAT64: DIV(double); break;
  case T_FLOAT16: DIV16(half_to_float, float_to_half); break;
  case T_BFLOAT16: DIV16(bf16_to_float, float_to_bf16); break;
  }
}

/* dst = op over ranks of the nranks blocks of `all` (block r at all + r * bytes), in rank order. */
static void reduce_blocks(void *dst, const char *all, size_t n, int nranks, size_t stride,
                          int dtype, int op) {
  size_t bytes = n * type_size[dtype];
  char *acc = malloc(bytes ? bytes : 1);
  memcpy(acc, all, bytes);
  for (int r = 1; r < nranks; r++) fold(acc, all + (size_t)r * stride, n, dtype, op);
  if (op == OP_AVG) divide(acc, n, dtype, nranks);
  memcpy(dst, acc, bytes);
  free(acc);
}

/* ------------------------------------------------------------------ operations */
enum { K_ALLREDUCE, K_BCAST, K_REDUCE, K_ALLGATHER, K_REDUCESCATTER, K_SEND, K_RECV };
static const char *const kind_name[] = { "AllReduce", "Broadcast", "Reduce", "AllGather",
                                         "ReduceScatter", "Send", "Recv" };
struct nop {
  int kind; const void *send; void *recv; size_t count; int dtype, op, root, peer;
};
struct batch {                       /* what one host command runs */
  struct scomm *c; uint64_t ticket; int n; struct nop ops[];
};

#define BIG_OK(bytes) ((bytes) <= (size_t)INT_MAX)

static int run_collective(struct scomm *c, const struct nop *o) {
  size_t es = type_size[o->dtype], bytes = o->count * es;
  int n = c->nranks, rc = MPI_SUCCESS;
  if (!BIG_OK(bytes * (size_t)n)) return MPI_ERR_COUNT;
  char *all;
  switch (o->kind) {
  case K_ALLREDUCE:
  case K_REDUCESCATTER: {
    size_t in = o->kind == K_ALLREDUCE ? bytes : bytes * (size_t)n;
    all = malloc(in * (size_t)n + 1);
    if (!all) return MPI_ERR_NO_MEM;
    if (n == 1) memcpy(all, o->send, in);
    else rc = MPI_Allgather(o->send, (int)in, MPI_BYTE, all, (int)in, MPI_BYTE, c->mpi);
    if (rc == MPI_SUCCESS) {
      if (o->kind == K_ALLREDUCE) reduce_blocks(o->recv, all, o->count, n, in, o->dtype, o->op);
      else reduce_blocks(o->recv, all + (size_t)c->rank * bytes, o->count, n, in, o->dtype, o->op);
    }
    free(all);
    return rc;
  }
  case K_REDUCE:
    all = malloc(bytes * (size_t)n + 1);
    if (!all) return MPI_ERR_NO_MEM;
    if (n == 1) memcpy(all, o->send, bytes);
    else rc = MPI_Gather(o->send, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, o->root, c->mpi);
    if (rc == MPI_SUCCESS && c->rank == o->root)
      reduce_blocks(o->recv, all, o->count, n, bytes, o->dtype, o->op);
    free(all);
    return rc;
  case K_BCAST:
    if (c->rank == o->root && o->recv != o->send) memmove(o->recv, o->send, bytes);
    return n == 1 ? MPI_SUCCESS : MPI_Bcast(o->recv, (int)bytes, MPI_BYTE, o->root, c->mpi);
  case K_ALLGATHER:
    if (n == 1) { memmove(o->recv, o->send, bytes); return MPI_SUCCESS; }
    if ((const char *)o->send == (char *)o->recv + (size_t)c->rank * bytes)   /* in place */
      return MPI_Allgather(MPI_IN_PLACE, 0, MPI_BYTE, o->recv, (int)bytes, MPI_BYTE, c->mpi);
    return MPI_Allgather(o->send, (int)bytes, MPI_BYTE, o->recv, (int)bytes, MPI_BYTE, c->mpi);
  }
  return MPI_ERR_OTHER;
}

static void run_batch(void *arg) {
  struct batch *b = arg;
  struct scomm *c = b->c;
  MPI_Request *reqs = malloc(((size_t)b->n + 1) * sizeof *reqs);
  int nreq = 0, rc = reqs ? MPI_SUCCESS : MPI_ERR_NO_MEM;
  char where[64] = "";
  ticket_wait(c, b->ticket);
  if (c->aborted) goto out;
  for (int i = 0; i < b->n && rc == MPI_SUCCESS; i++) {   /* sends and receives, posted together */
    const struct nop *o = &b->ops[i];
    size_t bytes = o->count * type_size[o->dtype];
    if (o->kind != K_SEND && o->kind != K_RECV) continue;
    if (!bytes || o->peer == c->rank) continue;         /* to self: copied below */
    if (!BIG_OK(bytes)) { rc = MPI_ERR_COUNT; break; }
    rc = o->kind == K_SEND
         ? MPI_Isend(o->send, (int)bytes, MPI_BYTE, o->peer, 0x4e43, c->mpi, &reqs[nreq++])
         : MPI_Irecv(o->recv, (int)bytes, MPI_BYTE, o->peer, 0x4e43, c->mpi, &reqs[nreq++]);
  }
  for (int i = 0, j = 0; i < b->n && rc == MPI_SUCCESS; i++) {   /* k-th send to self -> k-th receive */
    const struct nop *o = &b->ops[i];
    if (o->kind != K_SEND || o->peer != c->rank) continue;
    while (j < b->n && !(b->ops[j].kind == K_RECV && b->ops[j].peer == c->rank)) j++;
    if (j == b->n || b->ops[j].count * type_size[b->ops[j].dtype] != o->count * type_size[o->dtype]) {
      rc = MPI_ERR_TRUNCATE;
      snprintf(where, sizeof where, "a send to self without its matching receive");
      break;
    }
    memmove(b->ops[j].recv, o->send, o->count * type_size[o->dtype]);
    j++;
  }
  for (int i = 0; i < b->n && rc == MPI_SUCCESS; i++) {
    const struct nop *o = &b->ops[i];
    if (o->kind == K_SEND || o->kind == K_RECV || !o->count) continue;
    rc = run_collective(c, o);
    if (rc != MPI_SUCCESS) snprintf(where, sizeof where, "%s", kind_name[o->kind]);
  }
  if (nreq) {
    int r2 = MPI_Waitall(nreq, reqs, MPI_STATUSES_IGNORE);
    if (rc == MPI_SUCCESS) rc = r2;
  }
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING]; int len = 0;
    MPI_Error_string(rc, msg, &len);
    fail(ncclRemoteError, "NCCL stand-in: %s failed over MPI: %s", where[0] ? where : "a group", msg);
    atomic_store(&c->state, ncclRemoteError);
  }
out:
  ticket_done(c);
  free(reqs);
  free(b);
}

/* ------------------------------------------------------------------ groups */
struct pending { struct scomm *c; CUstream stream; struct nop op; };
static _Thread_local int t_group_depth;
static _Thread_local long t_group_serial;          /* of the outermost open group */
static atomic_long g_groups;                       /* groups opened so far, in the process */
static _Thread_local struct pending *t_pending;
static _Thread_local int t_npending, t_cap;
static _Thread_local ncclResult_t t_group_error;

static ncclResult_t submit(struct scomm *c, CUstream stream, const struct nop *ops, int n) {
  struct batch *b = malloc(sizeof *b + (size_t)n * sizeof *ops);
  if (!b) return fail(ncclSystemError, "NCCL stand-in: out of memory");
  b->c = c; b->n = n;
  memcpy(b->ops, ops, (size_t)n * sizeof *ops);
  b->ticket = ticket_take(c);
  CUresult r = standin_enqueue_host(stream, run_batch, b);
  if (r != 0) {
    ticket_wait(c, b->ticket);       /* keep the ticket sequence whole */
    ticket_done(c);
    free(b);
    return fail(ncclUnhandledCudaError, "Cuda failure %d (enqueueing on the stream)", r);
  }
  return ncclSuccess;
}

static ncclResult_t check_args(struct scomm *c, const struct nop *o, const char *name) {
  if (!c) return fail(ncclInvalidArgument, "%s : comm argument is NULL or not a communicator", name);
  if (c->aborted) return fail(ncclInvalidUsage, "%s : the communicator was aborted", name);
  if (o->dtype < 0 || o->dtype >= N_TYPES)
    return fail(ncclInvalidArgument, "%s : invalid type %d", name, o->dtype);
  if (o->op < 0 || o->op >= N_OPS) return fail(ncclInvalidArgument, "%s : invalid reduction operation %d", name, o->op);
  if ((o->kind == K_BCAST || o->kind == K_REDUCE) && (o->root < 0 || o->root >= c->nranks))
    return fail(ncclInvalidArgument, "%s : invalid root %d", name, o->root);
  if ((o->kind == K_SEND || o->kind == K_RECV) && (o->peer < 0 || o->peer >= c->nranks))
    return fail(ncclInvalidArgument, "%s : invalid peer %d", name, o->peer);
  if (o->count && ((o->kind != K_RECV && !o->send && !(o->kind == K_BCAST && c->rank != o->root)) ||
                   (o->kind != K_SEND && !o->recv && !(o->kind == K_REDUCE && c->rank != o->root))))
    return fail(ncclInvalidArgument, "%s : buffer argument is NULL", name);
  return ncclSuccess;
}

static ncclResult_t issue(void *comm, CUstream stream, struct nop o) {
  struct scomm *c = comm_ok(comm);
  const char *name = kind_name[o.kind];
  ncclResult_t rc = check_args(c, &o, name);
  if (rc) { if (t_group_depth) t_group_error = rc; return rc; }
  if (atomic_load(&c->state) == ncclInProgress && !c->blocking && !t_group_depth)
    return fail(ncclInvalidUsage, "%s : the nonblocking communicator is still in progress", name);
  record(name, o.count, o.dtype, o.kind == K_ALLREDUCE || o.kind == K_REDUCE || o.kind == K_REDUCESCATTER ? o.op : -1,
         o.kind == K_BCAST || o.kind == K_REDUCE ? o.root : -1,
         o.kind == K_SEND || o.kind == K_RECV ? o.peer : -1, c, stream, t_group_depth > 0,
         t_group_depth ? t_group_serial : 0);
  if (t_group_depth) {
    if (t_npending == t_cap) {
      int cap = t_cap ? 2 * t_cap : 16;
      struct pending *p = realloc(t_pending, (size_t)cap * sizeof *p);
      if (!p) return t_group_error = fail(ncclSystemError, "out of memory");
      t_pending = p; t_cap = cap;
    }
    t_pending[t_npending++] = (struct pending){ c, stream, o };
    return ncclSuccess;
  }
  rc = submit(c, stream, &o, 1);
  if (rc) return rc;
  if (!c->blocking) { comm_in_progress(c); return ncclInProgress; }
  return ncclSuccess;
}

ncclResult_t ncclGroupStart(void) {
  if (t_group_depth++ == 0) t_group_serial = atomic_fetch_add(&g_groups, 1) + 1;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  if (t_group_depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd: not in a group call.");
  if (--t_group_depth > 0) return ncclSuccess;
  ncclResult_t rc = t_group_error, inprog = ncclSuccess;
  t_group_error = ncclSuccess;
  int n = t_npending;
  struct pending *p = t_pending;
  t_pending = NULL; t_npending = t_cap = 0;
  if (rc) { free(p); return rc; }
  /* one batch per (communicator, stream), in the order of their first operation */
  char *taken = calloc((size_t)n + 1, 1);
  struct nop *ops = malloc(((size_t)n + 1) * sizeof *ops);
  for (int i = 0; i < n && !rc; i++) {
    if (taken[i]) continue;
    int k = 0;
    for (int j = i; j < n; j++)
      if (!taken[j] && p[j].c == p[i].c && p[j].stream == p[i].stream) { ops[k++] = p[j].op; taken[j] = 1; }
    rc = submit(p[i].c, p[i].stream, ops, k);
    if (!rc && !p[i].c->blocking) { comm_in_progress(p[i].c); inprog = ncclInProgress; }
  }
  free(taken); free(ops); free(p);
  return rc ? rc : inprog;
}

/* ------------------------------------------------------------------ the API: collectives */
ncclResult_t ncclAllReduce(const void *s, void *r, size_t n, int dt, int op, void *comm, CUstream st) {
  return issue(comm, st, (struct nop){ K_ALLREDUCE, s, r, n, dt, op, 0, 0 });
}
ncclResult_t ncclBroadcast(const void *s, void *r, size_t n, int dt, int root, void *comm, CUstream st) {
  return issue(comm, st, (struct nop){ K_BCAST, s, r, n, dt, 0, root, 0 });
}
ncclResult_t ncclReduce(const void *s, void *r, size_t n, int dt, int op, int root, void *comm, CUstream st) {
  return issue(comm, st, (struct nop){ K_REDUCE, s, r, n, dt, op, root, 0 });
}
ncclResult_t ncclAllGather(const void *s, void *r, size_t n, int dt, void *comm, CUstream st) {
  return issue(comm, st, (struct nop){ K_ALLGATHER, s, r, n, dt, 0, 0, 0 });
}
ncclResult_t ncclReduceScatter(const void *s, void *r, size_t n, int dt, int op, void *comm, CUstream st) {
  return issue(comm, st, (struct nop){ K_REDUCESCATTER, s, r, n, dt, op, 0, 0 });
}
ncclResult_t ncclSend(const void *s, size_t n, int dt, int peer, void *comm, CUstream st) {
  return issue(comm, st, (struct nop){ K_SEND, s, NULL, n, dt, 0, 0, peer });
}
ncclResult_t ncclRecv(void *r, size_t n, int dt, int peer, void *comm, CUstream st) {
  return issue(comm, st, (struct nop){ K_RECV, NULL, r, n, dt, 0, 0, peer });
}

/* ------------------------------------------------------------------ the API: communicators */
ncclResult_t ncclGetVersion(int *v) {
  if (!v) return fail(ncclInvalidArgument, "ncclGetVersion : version argument is NULL");
  *v = STANDIN_VERSION;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  if (!id) return fail(ncclInvalidArgument, "ncclGetUniqueId : uniqueId argument is NULL");
  struct id_body b;
  memset(id, 0, sizeof *id);
  memset(&b, 0, sizeof b);
  memcpy(b.magic, ID_MAGIC, sizeof ID_MAGIC);
  b.creator = -1;
  if (mpi_ready() != 0) MPI_Comm_rank(MPI_COMM_WORLD, &b.creator);
  b.counter = atomic_fetch_add(&g_uid_counter, 1);
  memcpy(id->internal, &b, sizeof b);
  return ncclSuccess;
}

struct init_job { struct scomm *c; struct id_body id; };

/* Build c->mpi from the unique id: the rendezvous at the id's creator (see the model). */
static ncclResult_t rendezvous(struct scomm *c, const struct id_body *id) {
  int n = c->nranks, me = -1, ready = mpi_ready(), rc;
  if (n == 1) return ncclSuccess;
  if (ready == 0) return fail(ncclInvalidUsage, "NCCL stand-in: MPI is not initialized (a communicator of %d ranks needs it)", n);
  if (ready < 0) return fail(ncclInvalidUsage, "NCCL stand-in: MPI must provide MPI_THREAD_MULTIPLE");
  if (id->creator < 0) return fail(ncclInvalidUsage, "NCCL stand-in: the unique id was made before MPI_Init");
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  int tag = 0x4000 + (int)(id->counter & 0x3fff);
  int *world = malloc((size_t)n * sizeof(int));
  if (!world) return fail(ncclSystemError, "out of memory");
  int mine[2] = { c->rank, me };
  if (me == id->creator) {
    for (int i = 0; i < n; i++) world[i] = -1;
    world[c->rank] = me;
    int *from = malloc((size_t)n * sizeof(int));
    for (int k = 1; k < n; k++) {
      int msg[2]; MPI_Status st;
      MPI_Recv(msg, 2, MPI_INT, MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, &st);
      from[k] = st.MPI_SOURCE;
      if (msg[0] < 0 || msg[0] >= n || world[msg[0]] != -1) world[0] = -2;   /* bad or duplicate rank */
      else world[msg[0]] = msg[1];
    }
    for (int k = 1; k < n; k++) MPI_Send(world, n, MPI_INT, from[k], tag, MPI_COMM_WORLD);
    free(from);
  } else {
    MPI_Send(mine, 2, MPI_INT, id->creator, tag, MPI_COMM_WORLD);
    MPI_Recv(world, n, MPI_INT, id->creator, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  }
  for (int i = 0; i < n; i++)
    if (world[i] < 0) { free(world); return fail(ncclInvalidUsage, "NCCL stand-in: ranks of a communicator of %d are missing or repeated", n); }
  MPI_Group wg, g;
  MPI_Comm_group(MPI_COMM_WORLD, &wg);
  MPI_Group_incl(wg, n, world, &g);
  rc = MPI_Comm_create_group(MPI_COMM_WORLD, g, tag, &c->mpi);
  MPI_Group_free(&g); MPI_Group_free(&wg);
  free(world);
  if (rc != MPI_SUCCESS) return fail(ncclSystemError, "NCCL stand-in: MPI_Comm_create_group failed (%d)", rc);
  MPI_Comm_set_errhandler(c->mpi, MPI_ERRORS_RETURN);
  return ncclSuccess;
}

static void *init_thread(void *arg) {
  struct init_job *j = arg;
  ncclResult_t rc = rendezvous(j->c, &j->id);
  if (!atomic_load(&g_stall)) atomic_store(&j->c->state, rc);
  free(j);
  return NULL;
}

static int spawn(void *(*fn)(void *), void *arg) {
  pthread_t t;
  pthread_attr_t a;
  pthread_attr_init(&a);
  pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
  int rc = pthread_create(&t, &a, fn, arg);
  pthread_attr_destroy(&a);
  return rc;
}

ncclResult_t ncclCommInitRankConfig(void **newcomm, int nranks, ncclUniqueId id, int rank, void *config) {
  config_prefix cfg;
  struct id_body b;
  if (!newcomm) return fail(ncclInvalidArgument, "CommInitRank : newcomm argument is NULL");
  *newcomm = NULL;
  ncclResult_t rc = read_config(config, &cfg);
  if (rc) return rc;
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return fail(ncclInvalidArgument, "Invalid rank requested : %d", rank);
  memcpy(&b, id.internal, sizeof b);
  if (memcmp(b.magic, ID_MAGIC, sizeof ID_MAGIC) != 0)
    return fail(ncclInvalidArgument, "NCCL stand-in: not a unique id from ncclGetUniqueId");
  struct scomm *c = comm_new(nranks, rank, &cfg);
  if (!c) return fail(ncclSystemError, "out of memory");
  if (c->blocking) {
    rc = rendezvous(c, &b);
    if (rc) { c->magic = 0; free(c); return rc; }
    *newcomm = c;
    return ncclSuccess;
  }
  struct init_job *j = malloc(sizeof *j);
  j->c = c; j->id = b;
  atomic_store(&c->state, ncclInProgress);
  atomic_store(&c->settle, 0);
  *newcomm = c;
  if (spawn(init_thread, j) != 0) { free(j); atomic_store(&c->state, ncclSystemError); return ncclSystemError; }
  return ncclInProgress;
}

ncclResult_t ncclCommInitRank(void **newcomm, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(newcomm, nranks, id, rank, NULL);
}

struct split_job { struct scomm *parent, *child; int color, key; uint64_t ticket; void **out; };

static ncclResult_t do_split(struct split_job *j) {
  struct scomm *p = j->parent;
  MPI_Comm m = MPI_COMM_NULL;
  int rc = MPI_SUCCESS;
  ticket_wait(p, j->ticket);
  if (p->nranks > 1) rc = MPI_Comm_split(p->mpi, j->color < 0 ? MPI_UNDEFINED : j->color, j->key, &m);
  ticket_done(p);
  if (rc != MPI_SUCCESS) return fail(ncclSystemError, "NCCL stand-in: MPI_Comm_split failed (%d)", rc);
  if (j->color < 0) return ncclSuccess;                 /* NCCL_SPLIT_NOCOLOR: no communicator */
  struct scomm *c = j->child;
  if (p->nranks > 1) {
    MPI_Comm_size(m, &c->nranks); MPI_Comm_rank(m, &c->rank);
    if (c->nranks == 1) MPI_Comm_free(&m); else { c->mpi = m; MPI_Comm_set_errhandler(m, MPI_ERRORS_RETURN); }
  }
  __atomic_store_n(j->out, (void *)c, __ATOMIC_RELEASE);
  return ncclSuccess;
}

static void *split_thread(void *arg) {
  struct split_job *j = arg;
  ncclResult_t rc = do_split(j);
  if (!atomic_load(&g_stall)) atomic_store(&j->parent->state, rc);
  free(j);
  return NULL;
}

ncclResult_t ncclCommSplit(void *comm, int color, int key, void **newcomm, void *config) {
  struct scomm *p = comm_ok(comm);
  config_prefix cfg;
  if (!p) return fail(ncclInvalidArgument, "CommSplit : comm argument is NULL or not a communicator");
  if (!newcomm) return fail(ncclInvalidArgument, "CommSplit : newcomm argument is NULL");
  *newcomm = NULL;
  ncclResult_t rc = read_config(config, &cfg);
  if (rc) return rc;
  if (!config) cfg.blocking = p->blocking;              /* the parent's config */
  struct split_job *j = malloc(sizeof *j);
  j->parent = p; j->color = color; j->key = key; j->out = newcomm;
  j->child = color < 0 ? NULL : comm_new(p->nranks, p->rank, &cfg);
  j->ticket = ticket_take(p);
  if (p->blocking) {
    rc = do_split(j);
    if (rc && j->child) free(j->child);
    free(j);
    return rc;
  }
  atomic_store(&p->state, ncclInProgress);
  atomic_store(&p->settle, 0);
  if (spawn(split_thread, j) != 0) return ncclSystemError;
  return ncclSuccess;            /* as NCCL 2.28: the group's ncclInProgress is not returned */
}

ncclResult_t ncclCommGetAsyncError(void *comm, ncclResult_t *err) {
  struct scomm *c = comm_ok(comm);
  if (!c) return fail(ncclInvalidArgument, "ncclCommGetAsyncError : comm argument is NULL");
  if (!err) return fail(ncclInvalidArgument, "ncclCommGetAsyncError : asyncError argument is NULL");
  int st = atomic_load(&c->state);
  /* an operation's ncclInProgress settles after a few queries; a creation's or split's is
     settled by its thread (settle stays 0) */
  if (st == ncclInProgress && !atomic_load(&g_stall) && atomic_load(&c->settle) > 0 &&
      atomic_fetch_sub(&c->settle, 1) == 1)
    atomic_compare_exchange_strong(&c->state, &st, ncclSuccess);
  *err = (ncclResult_t)atomic_load(&c->state);
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(void *comm) {
  struct scomm *c = comm_ok(comm);
  if (!c) return fail(ncclInvalidArgument, "ncclCommFinalize : comm argument is NULL");
  drain(c);
  if (!c->blocking) { comm_in_progress(c); return ncclInProgress; }
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(void *comm) {
  struct scomm *c = comm;
  if (!c) return ncclSuccess;
  if (c->magic != COMM_MAGIC) return fail(ncclInvalidArgument, "comm %p has already been destroyed", comm);
  drain(c);
  c->magic = 0;
  if (c->mpi != MPI_COMM_NULL && mpi_ready() != 0) MPI_Comm_free(&c->mpi);
  pthread_mutex_destroy(&c->mu); pthread_cond_destroy(&c->cv);
  free(c);
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(void *comm) {
  struct scomm *c = comm;
  if (!c) return ncclSuccess;
  if (c->magic != COMM_MAGIC) return fail(ncclInvalidArgument, "comm %p has already been destroyed", comm);
  c->aborted = 1;           /* queued operations do nothing; the struct is leaked (workers may hold it) */
  c->magic = 0;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const void *comm, int *n) {
  const struct scomm *c = comm_ok((void *)comm);
  if (!c || !n) return fail(ncclInvalidArgument, "CommCount : NULL argument");
  *n = c->nranks; return ncclSuccess;
}
ncclResult_t ncclCommUserRank(const void *comm, int *r) {
  const struct scomm *c = comm_ok((void *)comm);
  if (!c || !r) return fail(ncclInvalidArgument, "CommUserRank : NULL argument");
  *r = c->rank; return ncclSuccess;
}
ncclResult_t ncclCommCuDevice(const void *comm, int *d) {
  const struct scomm *c = comm_ok((void *)comm);
  if (!c || !d) return fail(ncclInvalidArgument, "CommCuDevice : NULL argument");
  *d = c->device; return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t code) {
  switch (code) {
  case ncclSuccess: return "no error";
  case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
  case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
  case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
  case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
  case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
  case ncclRemoteError: return "remote process exited or there was a network error";
  case ncclInProgress: return "NCCL operation in progress";
  default: return "unknown result code";
  }
}
const char *ncclGetLastError(void *comm) {
  (void)comm;
  return g_last_error;
}
