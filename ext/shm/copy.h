/* The shm transport's copy kernels: blocks, streaming stores, copies between the slots and
 * the user's buffers, tile-by-tile reductions, and which stores write the slots
 * (ext/al_shm.h includes every part). */
#ifndef AL_SHM_COPY_H
#define AL_SHM_COPY_H

#include "protocol.h"

/* Block j of a chunk of n elements of esize bytes: [lo, hi).  Blocks are whole cache lines
 * (except the last), so no two ranks ever write the same line of recvbuf or of a slot. */
static inline void al_shm_block(int64_t n, int p, int esize, int j, int64_t *lo, int64_t *hi) {
  int64_t per_line = 64 / esize > 0 ? 64 / esize : 1;
  int64_t b = ((n + p - 1) / p + per_line - 1) / per_line * per_line;
  *lo = (int64_t)j * b < n ? (int64_t)j * b : n;
  *hi = *lo + b < n ? *lo + b : n;
}

/* ---- streaming stores ----
 *
 * A message larger than the caches is read once from memory (sendbuf) and written once to it
 * (recvbuf).  Written with ordinary stores, every line of recvbuf is first read from memory
 * ("read for ownership") and then written back: 3n bytes of memory traffic instead of the 2n
 * of the bound (docs/performance.md).  A streaming (non-temporal) store writes a whole line
 * without reading it and without keeping it in the caches.  Used for recvbuf only, above
 * al_shm_stream_from (AL_SHM_STREAM_BYTES; unset: where the node's sendbufs and recvbufs,
 * 2 x ranks x n bytes, fill the last-level cache, al_shm_cache_bytes): a smaller result may be
 * read from the caches by the caller next, and the slots must stay in the caches for the peers.
 * On the reference VM (32 MiB L3) that is 8 MiB at 2 ranks and 4 MiB at 4, where streaming took
 * 0.76-0.92 of ordinary stores' time in both placements, and 0.89-0.94 with the caller summing
 * the result next; at 2 ranks 4 MiB streamed alone 0.81-0.94 but 1.05-1.10 with the sum
 * (docs/performance.md, "Streaming recvbuf stores by the cache").
 *
 * Memory ordering: streaming stores are weakly ordered, neither with the release store of a
 * flag nor with the completion flag of an op that another thread reads (a plain store on
 * x86).  No peer ever reads recvbuf, so the protocol above needs no fence; but every
 * function below that streams ends with an sfence (al_shm_stream_fence), so that whatever
 * follows it in this thread (a publish, the op's completion, the op's hand-over to the
 * progress engine between two advances, the caller reading recvbuf in another thread) comes
 * after the streamed bytes are visible everywhere.  Where SSE2 is missing, streaming is a
 * plain memcpy. */
#if defined(__SSE2__)
#include <emmintrin.h>
#define AL_SHM_CAN_STREAM 1
#else
#define AL_SHM_CAN_STREAM 0
#endif

#define AL_SHM_STREAM_BY_CACHE ((size_t)-1)
static size_t al_shm_stream_bytes = AL_SHM_STREAM_BY_CACHE;  /* allreduces of at least this stream */
static size_t al_shm_cache_bytes = (size_t)32 << 20;        /* the last-level cache's size */

/* The least allreduce (bytes per rank) of `size` ranks that writes recvbuf with streaming
 * stores (rank 0's goes to every rank at setup: s->chunk_upto). */
static inline size_t al_shm_stream_from(int size) {
  if (al_shm_stream_bytes != AL_SHM_STREAM_BY_CACHE)
    return al_shm_stream_bytes;
  return al_shm_cache_bytes / (2 * (size_t)(size > 1 ? size : 1));
}

static inline void al_shm_stream_fence(void) {
#if AL_SHM_CAN_STREAM
  _mm_sfence();
#endif
}

/* dst = src (n bytes, any alignment): ordinary stores up to dst's first 16-byte boundary and
 * after its last one, streaming stores in between.  No fence (callers end with one). */
static void al_shm_copy_nt(char *dst, const char *src, size_t n) {
#if AL_SHM_CAN_STREAM
  size_t head = (size_t)(-(uintptr_t)dst & 15);
  if (head > n) head = n;
  memcpy(dst, src, head);
  dst += head; src += head; n -= head;
  for (; n >= 64; n -= 64, dst += 64, src += 64) {
    __m128i x0 = _mm_loadu_si128((const __m128i *)src);
    __m128i x1 = _mm_loadu_si128((const __m128i *)(src + 16));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(src + 32));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(src + 48));
    _mm_stream_si128((__m128i *)dst, x0);
    _mm_stream_si128((__m128i *)(dst + 16), x1);
    _mm_stream_si128((__m128i *)(dst + 32), x2);
    _mm_stream_si128((__m128i *)(dst + 48), x3);
  }
  for (; n >= 16; n -= 16, dst += 16, src += 16)
    _mm_stream_si128((__m128i *)dst, _mm_loadu_si128((const __m128i *)src));
  memcpy(dst, src, n);
#else
  memcpy(dst, src, n);
#endif
}

/* dst = src (n bytes) with ordinary stores: memcpy, except where the two start at different
 * places in a cache line (a slot starts on one, numpy's large arrays 16 bytes into one).
 * There glibc's memcpy aligns its wide (32- or 64-byte) stores and every load then spans two
 * lines: copying a peer's slot into such a recvbuf made a 2-rank allreduce of 1-4 MiB 1.15-1.45x
 * slower (measured by sweeping the recvbuf offset).  16-byte vectors,
 * aligned on the destination, never span two lines when the source is 16-byte aligned too. */
static void al_shm_copy_lines(char *dst, const char *src, size_t n) {
#if AL_SHM_CAN_STREAM
  if ((((uintptr_t)dst ^ (uintptr_t)src) & 63) != 0 && n >= 256) {
    size_t head = (size_t)(-(uintptr_t)dst & 15);
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    if (((uintptr_t)src & 15) == 0) {
      for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i x0 = _mm_load_si128((const __m128i *)src);
        __m128i x1 = _mm_load_si128((const __m128i *)(src + 16));
        __m128i x2 = _mm_load_si128((const __m128i *)(src + 32));
        __m128i x3 = _mm_load_si128((const __m128i *)(src + 48));
        _mm_store_si128((__m128i *)dst, x0);
        _mm_store_si128((__m128i *)(dst + 16), x1);
        _mm_store_si128((__m128i *)(dst + 32), x2);
        _mm_store_si128((__m128i *)(dst + 48), x3);
      }
    }
    memcpy(dst, src, n);
    return;
  }
#endif
  memcpy(dst, src, n);
}

/* dst = src, n bytes, streamed (and fenced) if `stream`. */
static inline void al_shm_copy(char *dst, const char *src, size_t n, int stream) {
  if (stream) {
    al_shm_copy_nt(dst, src, n);
    al_shm_stream_fence();
  } else {
    al_shm_copy_lines(dst, src, n);
  }
}

/* One tile: out = src[0] op ... op src[k-1] over the m elements at byte `off` of every source
 * (k >= 2; AVG, avg_div > 0, divides in the last pass).  `out` may be src[0] + off exactly. */
static inline int al_shm_reduce_tile(int dtype, int op, char *out, const char *const *src, int k,
                                     size_t off, size_t m, double avg_div) {
  int j, rc = 0;
  for (j = 1; j < k && rc == 0; j++) {
    const char *a = j == 1 ? src[0] + off : out;
    if (j == k - 1 && avg_div > 0)
      rc = al_reduce_div(dtype, out, a, src[j] + off, m, avg_div);
    else
      rc = al_reduce(dtype, op, out, a, src[j] + off, m);
  }
  return rc;
}

/* out = src[0] op src[1] op ... op src[k-1] over n elements (k >= 2), AL_SHM_TILE bytes at a
 * time so that the partial results stay in L1 (2 KiB tiles were 1.06-1.13x faster than 8 KiB
 * ones at 32-64 MiB, docs/performance.md "Tiles that stay in L1": three 8 KiB streams crowd a
 * 32 KiB L1; memory traffic: k reads and one write per element); AVG (avg_div
 * > 0) divides in the last pass.  `out` may be src[0] exactly.  Each tile is then copied to
 * `copy_to` if it is not NULL, with streaming stores if `stream` (al_shm_copy_nt; one fence at
 * the end).  Returns 0, or -1 for an unsupported (dtype, op). */
static int al_shm_reduce_copy(int dtype, int op, int esize, char *out, const char *const *src,
                              int k, int64_t n, double avg_div, char *copy_to, int stream) {
  int64_t tile = (int64_t)(AL_SHM_TILE / (size_t)esize), t, m;
  int rc = 0;
  for (t = 0; t < n && rc == 0; t += tile) {
    size_t off = (size_t)t * esize;
    m = n - t < tile ? n - t : tile;
    rc = al_shm_reduce_tile(dtype, op, out + off, src, k, off, (size_t)m, avg_div);
    if (copy_to != NULL && stream)
      al_shm_copy_nt(copy_to + off, out + off, (size_t)m * esize);
    else if (copy_to != NULL)
      al_shm_copy_lines(copy_to + off, out + off, (size_t)m * esize);
  }
  if (stream)
    al_shm_stream_fence();
  return rc;
}

/* al_shm_reduce_copy with ordinary stores. */
static int al_shm_reduce(int dtype, int op, int esize, char *out, const char *const *src, int k,
                         int64_t n, double avg_div, char *copy_to) {
  return al_shm_reduce_copy(dtype, op, esize, out, src, k, n, avg_div, copy_to, 0);
}

/* ---- the slots' stores: cached or streamed, by size ----
 *
 * The protocol writes the slots either with ordinary stores, which a peer then reads from a
 * cache the two ranks share, or with streaming (non-temporal) stores, which write whole lines
 * to memory without asking for them.  Which is cheaper depends on where the ranks run, which
 * a program cannot see and a virtual machine's host changes within seconds: where the ranks'
 * cores share a last-level cache ("near"), ordinary stores; where they share none ("far"),
 * every ordinary store to a slot line a peer read the round before must first take that line
 * back across the chip, and streaming stores are cheaper.  Measured at 2 ranks
 * (docs/performance.md, "Why large messages were bimodal" and "Measured slot stores from
 * 4 KiB"), streamed stores cost, relative to the better kind: near 1.0-1.08x at 4-16 KiB,
 * 1.86x at 256 KiB, 2.06x at 2 MiB, 1.36x at 64 MiB; ordinary stores: far 1.29x at 4 KiB,
 * 1.55x at 8 KiB, 2.96x at 256 KiB, 2.87x at 2 MiB, 3.67x at 64 MiB.  At 4 ranks on 2 cores:
 * streamed 1.07-1.24x near, ordinary 1.5-2.7x far (4-64 MiB).  Below 4 KiB the kinds are within
 * 10% in either placement.  So the rule is the smaller worst case: a rank writes AL_SHM_STREAM_
 * SLOTS_FROM bytes or more into its slots in an op with streaming stores, less with ordinary
 * ones (a bcast and a barrier, which write no slot data that a peer waits on, with ordinary
 * ones).  AL_SHM_SLOT_STORES (al_shm_slot_stores) fixes one kind instead.  A reader does not
 * care how a line was written, and a fence orders streamed stores before the publish, so ranks
 * whose kinds differ (an alltoallv's ranks write different amounts) are harmless. */

#define AL_SHM_STREAM_SLOTS_FROM ((size_t)4096)

enum { AL_SHM_STORES_BY_SIZE = 0, AL_SHM_STORES_CACHED = 1, AL_SHM_STORES_STREAMED = 2 };
static int al_shm_slot_stores = AL_SHM_STORES_BY_SIZE;

/* The op's slot stores (o->nt) for `bytes` written into this rank's slots. */
static inline void al_shm_choose_stores(const al_shm_seg *s, al_shm_op *o, size_t bytes) {
  if (!AL_SHM_CAN_STREAM || s->size < 2 || al_shm_slot_stores == AL_SHM_STORES_CACHED)
    o->nt = 0;
  else if (al_shm_slot_stores == AL_SHM_STORES_STREAMED)
    o->nt = bytes > AL_SHM_INLINE;
  else
    o->nt = bytes >= AL_SHM_STREAM_SLOTS_FROM;
}

/* dst = src (n bytes) into a slot: streamed if `nt` (no fence: the caller's publish follows
 * one), else memcpy. */
static inline void al_shm_slot_copy(char *dst, const char *src, size_t n, int nt) {
  if (nt)
    al_shm_copy_nt(dst, src, n);
  else
    al_shm_copy_lines(dst, src, n);
}

/* The split protocol's reduction with streamed slot stores: as al_shm_reduce_copy, but each
 * tile is reduced in L1 (a buffer on the stack) and then written to the slot with streaming
 * stores and to recvbuf with them if `stream`, with one fence at the end. */
static int al_shm_reduce_streamed(int dtype, int op, int esize, char *rbuf, char *slot,
                                  const char *const *src, int k, int64_t n, double avg_div,
                                  int stream) {
  char tile[AL_SHM_TILE] __attribute__((aligned(64)));
  int64_t per = (int64_t)(AL_SHM_TILE / (size_t)esize), t, m;
  int rc = 0;
  for (t = 0; t < n && rc == 0; t += per) {
    size_t off = (size_t)t * esize;
    m = n - t < per ? n - t : per;
    rc = al_shm_reduce_tile(dtype, op, tile, src, k, off, (size_t)m, avg_div);
    al_shm_copy_nt(slot + off, tile, (size_t)m * esize);
    if (stream)
      al_shm_copy_nt(rbuf + off, tile, (size_t)m * esize);
    else
      al_shm_copy_lines(rbuf + off, tile, (size_t)m * esize);
  }
  al_shm_stream_fence();
  return rc;
}

/* The bytes this rank writes into its slots in an op of a->coll (what its stores are chosen
 * by), or 0 where ordinary stores are used whatever the size: a bcast and a barrier. */
static inline size_t al_shm_written_bytes(const al_shm_seg *s, const al_shm_args *a) {
  size_t es = (size_t)a->esize, sum = 0;
  int j;
  switch (a->coll) {
  case 0: case AL_SHM_ALLGATHER:
    return (size_t)a->count * es;
  case AL_SHM_REDUCE_SCATTER: case AL_SHM_ALLTOALL:
    return (size_t)(s->size - 1) * (size_t)a->count * es;
  case AL_SHM_ALLGATHERV:
    return (size_t)a->rcounts[s->rank] * es;
  case AL_SHM_ALLTOALLV:
    for (j = 0; j < s->size; j++)
      if (j != s->rank) sum += (size_t)a->scounts[j];
    return sum * es;
  default:
    return 0;
  }
}

#endif  /* AL_SHM_COPY_H */
