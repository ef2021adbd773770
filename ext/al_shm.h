/* The intra-node shared-memory transport ("shm") of aluminum_py: one segment per communicator
 * whose ranks all share a node, and the allreduce over it.  Pure C, called without the GIL
 * from ext/core/shm.pxi (the op glue, the collective segment setup, the Python classes).
 *
 * The segment (al_shm_bytes): a header line, then one flag per rank, each on its own 128-byte
 * line (two 64-byte lines: x86's adjacent-line prefetcher pairs them), then the data: two
 * buffers, each one slot of `slot` bytes per rank (4 KiB aligned):
 *
 *     [header][flag 0][flag 1]...[flag p-1][buf 0: slot 0 ... slot p-1][buf 1: slot 0 ... slot p-1]
 *
 * A rank's flag line also holds, after the 8-byte flag, two fingerprint words, one per buffer
 * (al_shm_fp: the signature of the op of the round, see "fingerprints" below), then two
 * "inline" areas of AL_SHM_INLINE bytes, one per buffer: a round whose data is at most that
 * many bytes per rank puts it there instead of in the slot (al_shm_data), so that a reader
 * takes one cache-line transfer (flag, fingerprint and data together) instead of two.
 * Everything said of a slot of buffer b below holds for inline area b and fingerprint b.
 *
 * A rank writes only its own flag line and its own slots; it reads everybody's.
 *
 * The protocol.  Every rank makes the same sequence of "rounds" (one chunk of one op per round;
 * ops on a communicator run one at a time in call order, see shm_gate in shm.pxi), and round m
 * uses buffer m % 2.  A rank's flag is a 64-bit counter: each time it has written what its
 * peers may read next, it stores the counter + 1 with release ordering ("publish"); it then
 * waits until every peer's flag, loaded with acquire ordering, has reached the same value
 * ("arrive").  Every rank publishes the same number of times in every round (one, or two in
 * the split protocol), so the value a rank publishes first in round m is the same on every
 * rank; call it v(m).  Release/acquire pairs make everything the peer wrote before its publish
 * visible to the reader after its arrive; no other ordering is needed, as every byte has one
 * writer.
 *
 *   symmetric (small messages, one publish per round; DeepSpeed's "symmetric" allreduce):
 *     copy the whole chunk into my slot (inline area up to AL_SHM_INLINE bytes); publish;
 *     arrive; reduce all p slots, in rank order, into recvbuf (every rank computes the same
 *     bits from the same data in the same order).
 *   split (large messages, two publishes per round; reduce-scatter then allgather):
 *     copy the blocks j != me of the chunk into my slot (block j is what rank j reduces);
 *     publish; arrive; reduce my block from my own sendbuf and every peer's slot into recvbuf
 *     (one rank computes each block: every rank gets the same bits), copying each reduced tile
 *     into my slot's block `me` while it is in cache; publish; arrive; copy every peer's
 *     reduced block from its slot into recvbuf.  Large messages write recvbuf with streaming
 *     stores (below: each tile is reduced into the slot, then streamed to recvbuf).
 *
 * Why no closing barrier.  The rule: a rank writes into buffer b in round m + 2 only once
 * every peer's flag has reached v(m + 1).  A peer publishes v(m + 1) only after it finished
 * round m, whose reads of buffer b are the last ones before round m + 2 (round m + 1 uses the
 * other buffer); so the writes cannot reach a reader still in round m.  In the memory model:
 * the peer's reads of round m are sequenced before its release store of v(m + 1), which the
 * writer's acquire load reads, and that load is sequenced before the writes: the reads happen
 * before the writes and cannot see them.  A rank that arrived in round m + 1 has met the rule
 * (its first arrive of round m + 1 waited for v(m + 1)).  In the split protocol a rank also
 * writes its slot's own block during round m's reduction, a block no peer reads before the
 * second publish of round m.  So the two buffers alternate with no extra synchronisation, and
 * a rank can run at most one round ahead of the slowest peer.
 *
 * Fingerprints.  Every round, each rank writes the signature of its op (al_shm_fp: kind,
 * dtype, reduction op, root, count and the op's number on the segment, packed in 64 bits) into
 * its fingerprint word of the round's buffer, before the publish, and checks at its arrive
 * that every peer it reads wrote the same (al_shm_arrived).  Ranks whose calls differ (a count,
 * a dtype, the order of two calls, a call one rank skipped) fail the op at their first common
 * round instead of combining data of different calls (AL_SHM_MISMATCH; shm.pxi names both
 * calls).  The word is in the flag's cache line: no extra transfer.  It has the lifetime of
 * the round's data, so every round settles before writing it (below), even one that writes no
 * data (a bcast's non-root, a barrier): a peer may still check the word of round m until this
 * rank has seen it publish round m + 1.
 *
 * Lazy arrive.  A rank that reads nothing a peer wrote in round k (a bcast's root) skips
 * that round's arrive and completes the round right after its publish, recording in `owed`
 * the value v(k) it did not wait for; a rank that reads one peer only (a bcast's non-root
 * reads the root) waits for that peer's flag alone and records v(k) the same way; a round
 * with a full arrive sets `owed` to 0.  So at the start of any round k every peer's flag is
 * known to have reached v(k - 1), or `owed` is v(k - 1).  Before it writes into a buffer in
 * round k a rank waits until every peer's flag has reached `owed` (al_shm_settled, then
 * `owed` is 0): that is the rule above.  Every round writes at least its fingerprint, so every
 * round settles first (a bcast's non-root and a barrier included).  Nothing waits in a cycle: a rank settling in round k waits for
 * publishes of round k - 1, which need nothing of round k.
 *
 * The memory traffic of the split protocol per rank and per element of the message is the
 * minimum for any algorithm that cannot read a peer's private memory (docs/performance.md):
 * what peers reduce is copied out once ((p-1)/p read + write), the own block is read from
 * sendbuf and the peers' slots (1 read) and written twice (recvbuf and the slot, 2/p), the
 * peers' reduced blocks are copied in ((p-1)/p read + write).  All of it but reading sendbuf
 * and writing recvbuf stays in the caches (the slots); recvbuf's writes cost a read of each
 * line too unless they stream (see "streaming stores").  Where the ranks' cores share no cache,
 * the slots are better written with streaming stores as well ("the slots' stores").
 */
#ifndef AL_SHM_H
#define AL_SHM_H

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "al_reduce.h"

#define AL_SHM_LINE 128              /* a flag per line pair: no false sharing, no paired prefetch*/
#define AL_SHM_ALIGN 4096            /* slots start on page boundaries */
#define AL_SHM_TILE 2048             /* bytes reduced at a time (al_shm_reduce_copy) */
#define AL_SHM_MAGIC 0x6d68735f6c61ULL /* "al_shm" */
#define AL_SHM_MAX_RANKS 256         /* ranks per segment (a reduction's inputs are on the stack) */
#define AL_SHM_INLINE 16             /* bytes per rank of a round carried in the flag's line */
#define AL_SHM_MISMATCH (-2)         /* an advance's result: a peer's fingerprint differs */
#define AL_SHM_COUNTS_DIFFER (-3)    /* alltoallv: a peer sends another count than expected */

typedef struct al_shm_seg {
  char *base;                        /* the mapping */
  size_t len;
  int rank, size;
  size_t slot;                       /* bytes per rank per buffer */
  size_t small;                      /* messages of at most this many bytes: symmetric protocol */
  uint64_t seq;                      /* the last value this rank published */
  uint64_t round;                    /* rounds so far (buffer = round % 2) */
  uint64_t owed;                     /* 0, or the value every peer's flag must reach before this
                                        rank writes again (a lazy arrive: al_shm_settled) */
  uint64_t ops;                      /* ops begun on the segment (the fingerprints' number) */
  size_t chunk;                      /* bytes of a split allreduce's round when the allreduce
                                        is under chunk_upto bytes (at most the slot): rank 0's,
                                        sent to every rank at setup (al_shm_chunk) */
  size_t chunk_upto;
} al_shm_seg;

/* Where one op stands (al_op.shm); zero is "not started". */
enum { AL_SHM_PUT = 0, AL_SHM_WAIT_IN = 1, AL_SHM_WAIT_OUT = 2, AL_SHM_END = 3 };

typedef struct al_shm_op {
  int phase;                         /* AL_SHM_PUT ... AL_SHM_END */
  int split;                         /* 1: reduce-scatter + allgather, 0: symmetric */
  int stream;                        /* write recvbuf with streaming stores (al_shm_copy_nt) */
  int64_t off;                       /* the current chunk: elements [off, off + chunk) */
  int64_t chunk;
  uint64_t want;                     /* the flag value every peer must reach */
  int waiting;                       /* the first peer not yet seen at `want` */
  long polls;                        /* unsuccessful polls of the current wait (when to yield) */
  uint64_t fp;                       /* this op's fingerprint (al_shm_fp) */
  uint64_t theirs;                   /* AL_SHM_MISMATCH: the fingerprint rank `waiting` wrote;
                                        AL_SHM_COUNTS_DIFFER: the count it sends this rank */
  int64_t end;                       /* v-collectives: the rounds cover elements [0, end) of
                                        every block (-1: not known before round 0's arrive) */
  int nt;                            /* write the slots with streaming stores
                                        (al_shm_choose_stores) */
} al_shm_op;

static inline size_t al_shm_round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

static inline size_t al_shm_data_offset(int size) {
  return al_shm_round_up((size_t)(size + 1) * AL_SHM_LINE, AL_SHM_ALIGN);
}

/* The segment's length for `size` ranks and slots of `slot` bytes; 0 when that is no segment's:
 * `size` not in 1..AL_SHM_MAX_RANKS, `slot` not a positive multiple of AL_SHM_ALIGN, or the
 * length beyond what an offset (off_t) and a mapping can hold (overflow). */
static inline size_t al_shm_bytes(int size, size_t slot) {
  size_t data;
  if (size < 1 || size > AL_SHM_MAX_RANKS || slot == 0 || slot % AL_SHM_ALIGN != 0 ||
      __builtin_mul_overflow(slot, 2 * (size_t)size, &data) ||
      data > (size_t)INT64_MAX - al_shm_data_offset(size))
    return 0;
  return al_shm_data_offset(size) + data;
}

/* ---- the header: the segment's first line, 64-bit words ----
 *   0  AL_SHM_MAGIC, stored last (release) by the rank that makes the segment
 *   1  ranks            2  slot bytes
 *   3  the health word (al_shm_health, below)
 *   4  the nonce: a random number rank 0 draws for each segment and sends to the peers with
 *      where the segment is, so that a file that is not this communicator's segment (another
 *      one, a name planted in /dev/shm, a reused pid's fd) never passes for it
 * Every rank checks the header (al_shm_header_check) before it uses the segment; the setup
 * (shm.pxi) gathers every rank's verdict, so all use the segment or none does. */
enum { AL_SHM_H_MAGIC = 0, AL_SHM_H_SIZE = 1, AL_SHM_H_SLOT = 2, AL_SHM_H_NONCE = 4 };

static void al_shm_header_write(char *p, int size, size_t slot, uint64_t nonce) {
  uint64_t *h = (uint64_t *)p;
  h[AL_SHM_H_SIZE] = (uint64_t)size;
  h[AL_SHM_H_SLOT] = (uint64_t)slot;
  h[AL_SHM_H_NONCE] = nonce;
  __atomic_store_n(&h[AL_SHM_H_MAGIC], AL_SHM_MAGIC, __ATOMIC_RELEASE);
}

/* 0 when the header at p (of a mapping of `len` bytes) is that of the segment every rank
 * expects: `size` ranks, `slot`, `nonce`, and `len` the length they make; else -1 with a
 * message naming `what` and the first field that differs in err. */
static int al_shm_header_check(const char *p, size_t len, int size, size_t slot, uint64_t nonce,
                               const char *what, char *err, size_t errlen) {
  const uint64_t *h = (const uint64_t *)p;
  const char *bad = NULL;
  if (len < sizeof(uint64_t) * (AL_SHM_H_NONCE + 1) ||
      __atomic_load_n(&h[AL_SHM_H_MAGIC], __ATOMIC_ACQUIRE) != AL_SHM_MAGIC)
    bad = "magic";
  else if (h[AL_SHM_H_SIZE] != (uint64_t)size)
    bad = "ranks";
  else if (h[AL_SHM_H_SLOT] != (uint64_t)slot)
    bad = "slot bytes";
  else if (h[AL_SHM_H_NONCE] != nonce)
    bad = "nonce";
  else if (al_shm_bytes(size, slot) != len)
    bad = "length";
  if (bad == NULL)
    return 0;
  snprintf(err, errlen, "%s is not the segment of this communicator (header: %s differs)", what,
           bad);
  return -1;
}

static inline uint64_t *al_shm_flag(const al_shm_seg *s, int r) {
  return (uint64_t *)(s->base + (size_t)(r + 1) * AL_SHM_LINE);
}

static inline char *al_shm_slot(const al_shm_seg *s, int buf, int r) {
  return s->base + al_shm_data_offset(s->size) + ((size_t)buf * s->size + r) * s->slot;
}

/* Rank r's fingerprint word of buffer `buf` (bytes 8 + 8 buf of its flag line). */
static inline uint64_t *al_shm_fpw(const al_shm_seg *s, int buf, int r) {
  return al_shm_flag(s, r) + 1 + buf;
}

/* Where rank r puts its data of a round of buffer `buf` that has `bytes` bytes per rank: the
 * inline area `buf` of its flag line (bytes 24 + 16 buf .. 40 + 16 buf, 8-byte aligned) when
 * they fit, else its slot.  The same on every rank: `bytes` is. */
static inline char *al_shm_data(const al_shm_seg *s, int buf, int r, size_t bytes) {
  if (bytes <= AL_SHM_INLINE)
    return (char *)al_shm_flag(s, r) + 3 * sizeof(uint64_t) + (size_t)buf * AL_SHM_INLINE;
  return al_shm_slot(s, buf, r);
}

/* ---- fingerprints ----
 * An op's signature in 64 bits: bits 0-2 the collective (0 allreduce, AL_SHM_ALLGATHER ...
 * AL_SHM_ALLTOALLV: all eight values are taken),
 * 3-7 the dtype, 8-11 the reduction op (allreduce, reduce_scatter), 12-19 the root (bcast),
 * 20-50 the count (at most 2**31 - 1 elements; Allgatherv: a hash of the counts, Alltoallv: 0,
 * its counts are checked pairwise instead), 51-63 the op's number on the segment modulo
 * 8192 (counted from 1).  al_shm_fp_unpack reverses it for the error message. */
#define AL_SHM_FP_SEQ_BITS 13

static inline uint64_t al_shm_fp(int coll, int dtype, int rop, int root, int64_t count,
                                 uint64_t number) {
  int reduces = coll == 0 || coll == 3;            /* allreduce, AL_SHM_REDUCE_SCATTER */
  return (uint64_t)(coll & 7) | (uint64_t)(dtype & 31) << 3 |
         (uint64_t)(reduces ? rop & 15 : 0) << 8 | (uint64_t)(coll == 2 ? root & 255 : 0) << 12 |
         ((uint64_t)count & 0x7fffffffULL) << 20 |
         (number & ((1ULL << AL_SHM_FP_SEQ_BITS) - 1)) << 51;
}

static inline void al_shm_fp_unpack(uint64_t fp, int *coll, int *dtype, int *rop, int *root,
                                    int64_t *count, long *number) {
  *coll = (int)(fp & 7);
  *dtype = (int)(fp >> 3 & 31);
  *rop = (int)(fp >> 8 & 15);
  *root = (int)(fp >> 12 & 255);
  *count = (int64_t)(fp >> 20 & 0x7fffffffULL);
  *number = (long)(fp >> 51);
}

/* ---- the segment: create (one rank), open (the others), unmap ----
 *
 * Rank 0 creates the segment as an anonymous memory file (memfd_create: the name is only what
 * /proc shows, nothing is named in /dev/shm), and the peers open it through
 * /proc/<rank 0's pid>/fd/<fd>; rank 0 closes its fd once every rank has reported.  Nothing can
 * leak, whoever dies when: the memory goes away with the last fd or mapping.  Where
 * memfd_create is missing (ENOSYS) or a peer may not open rank 0's fd (restricted /proc, other
 * user, other PID namespace: *named_instead), the setup falls back for the whole communicator
 * to a named POSIX object in /dev/shm (al_shm_create / al_shm_open), unlinked by rank 0 once
 * every rank has reported; a rank killed between its creation and that unlink leaves the name. */

/* Reserve `len` bytes of memory for the open file `fd` (posix_fallocate: a full /dev/shm or
 * memory cgroup is reported here, not as SIGBUS in the middle of an op) and map it; the header
 * records what the openers check.  Does not close fd.  Returns the mapping, or NULL with a
 * message naming `what` in err. */
static char *al_shm_init_fd(int fd, const char *what, size_t len, int size, size_t slot,
                            uint64_t nonce, char *err, size_t errlen) {
  int rc = ftruncate(fd, (off_t)len) != 0 ? errno : posix_fallocate(fd, 0, (off_t)len);
  char *p;
  if (rc != 0) {
    snprintf(err, errlen, "reserving %zu bytes of shared memory for %s failed: %s", len, what,
             strerror(rc));
    return NULL;
  }
  p = (char *)mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    snprintf(err, errlen, "mmap of %zu bytes of %s failed: %s", len, what, strerror(errno));
    return NULL;
  }
  al_shm_header_write(p, size, slot, nonce);
  return p;
}

/* Map the open file `fd` another rank created; checks its length and header.  Does not close
 * fd. */
static char *al_shm_map_fd(int fd, const char *what, size_t len, int size, size_t slot,
                           uint64_t nonce, char *err, size_t errlen) {
  struct stat st;
  char *p;
  if (fstat(fd, &st) != 0 || (size_t)st.st_size != len) {
    snprintf(err, errlen, "%s has %lld bytes, expected %zu", what, (long long)st.st_size, len);
    return NULL;
  }
  p = (char *)mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    snprintf(err, errlen, "mmap of %zu bytes of %s failed: %s", len, what, strerror(errno));
    return NULL;
  }
  if (al_shm_header_check(p, len, size, slot, nonce, what, err, errlen) != 0) {
    munmap(p, len);
    return NULL;
  }
  return p;
}

#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif

/* Create the segment as a memory file labelled `label` (close-on-exec), reserve and map it.
 * Returns the mapping with the open fd in *fd (the caller closes it once every peer has opened
 * it), or NULL with *fd = -1 and a message in err; *unsupported = 1 when the kernel has no
 * memfd_create (ENOSYS: use the named path). */
static char *al_shm_create_memfd(const char *label, size_t len, int size, size_t slot,
                                 uint64_t nonce, int *fd, int *unsupported, char *err,
                                 size_t errlen) {
  char *p;
  *unsupported = 0;
#ifdef SYS_memfd_create
  *fd = (int)syscall(SYS_memfd_create, label, MFD_CLOEXEC);
#else
  *fd = -1;
  errno = ENOSYS;
#endif
  if (*fd < 0) {
    *unsupported = errno == ENOSYS;
    snprintf(err, errlen, "memfd_create(%s) failed: %s", label, strerror(errno));
    return NULL;
  }
  p = al_shm_init_fd(*fd, label, len, size, slot, nonce, err, errlen);
  if (p == NULL) {
    close(*fd);
    *fd = -1;
  }
  return p;
}

/* Map the memory file that process `pid` holds open as `fd` (/proc/<pid>/fd/<fd>).  *named_instead
 * = 1 when /proc does not let this process open it (EACCES, EPERM, ENOENT: restricted /proc,
 * another user, another PID namespace), i.e. when the named path may work instead. */
static char *al_shm_open_memfd(long pid, int fd, size_t len, int size, size_t slot,
                               uint64_t nonce, int *named_instead, char *err, size_t errlen) {
  char path[64];
  char *p;
  int mine, e;
  *named_instead = 0;
  snprintf(path, sizeof(path), "/proc/%ld/fd/%d", pid, fd);
  mine = open(path, O_RDWR | O_CLOEXEC);
  if (mine < 0) {
    e = errno;
    *named_instead = e == EACCES || e == EPERM || e == ENOENT || e == ENXIO;
    snprintf(err, errlen, "open(%s) failed: %s", path, strerror(e));
    return NULL;
  }
  p = al_shm_map_fd(mine, path, len, size, slot, nonce, err, errlen);
  close(mine);
  return p;
}

/* The named path: create `name` (O_EXCL, mode 0600), reserve and map it.  Removes the name on
 * failure; otherwise the caller unlinks it once every peer has opened it. */
static char *al_shm_create(const char *name, size_t len, int size, size_t slot, uint64_t nonce,
                           char *err, size_t errlen) {
  int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  char *p;
  if (fd < 0) {
    snprintf(err, errlen, "shm_open(%s, O_CREAT) failed: %s", name, strerror(errno));
    return NULL;
  }
  p = al_shm_init_fd(fd, name, len, size, slot, nonce, err, errlen);
  close(fd);
  if (p == NULL)
    shm_unlink(name);
  return p;
}

/* The named path: map the segment another rank created as `name`. */
static char *al_shm_open(const char *name, size_t len, int size, size_t slot, uint64_t nonce,
                         char *err, size_t errlen) {
  int fd = shm_open(name, O_RDWR, 0);
  char *p;
  if (fd < 0) {
    snprintf(err, errlen, "shm_open(%s) failed: %s", name, strerror(errno));
    return NULL;
  }
  p = al_shm_map_fd(fd, name, len, size, slot, nonce, err, errlen);
  close(fd);
  return p;
}

static void al_shm_init(al_shm_seg *s, char *base, size_t len, int rank, int size, size_t slot,
                        size_t small) {
  memset(s, 0, sizeof(*s));
  s->base = base;
  s->len = len;
  s->rank = rank;
  s->size = size;
  s->slot = slot;
  s->small = small;
  s->chunk = slot;
}

/* ---- flags ---- */

static inline void al_shm_publish(al_shm_seg *s, al_shm_op *o) {
  s->seq++;
  __atomic_store_n(al_shm_flag(s, s->rank), s->seq, __ATOMIC_RELEASE);
  o->want = s->seq;
  o->waiting = 0;
  o->polls = 0;
}

/* The segment's health word (the header's fourth 64-bit word, 0 when the segment is made): a
 * rank that gives up an op over the segment in the middle of the sequence of rounds (a
 * host-transfer allreduce abandoned at the hang timeout: shm.pxi, ht_op.pxi) stores its
 * rank + 1 there, as the ranks' rounds and flags are then out of step for good; every rank
 * checks it before an op starts and while it waits, and fails the op instead of waiting for, or
 * reading, a round that will never match.  The first rank to store it is kept. */
static inline uint64_t *al_shm_health(const al_shm_seg *s) { return (uint64_t *)s->base + 3; }

/* Why a rank broke the segment (the health word's high half). */
enum { AL_SHM_ABANDONED = 0,         /* it gave up an op at its hang timeout */
       AL_SHM_REFUSED = 1,           /* it refused a call (another thread's: commstate.pxi) */
       AL_SHM_MISMATCHED = 2 };      /* the ranks' calls differ (fingerprints) */

static inline void al_shm_mark_broken_why(al_shm_seg *s, int why) {
  uint64_t healthy = 0;
  __atomic_compare_exchange_n(al_shm_health(s), &healthy,
                              (uint64_t)why << 32 | ((uint64_t)s->rank + 1), 0,
                              __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

static inline void al_shm_mark_broken(al_shm_seg *s) { al_shm_mark_broken_why(s, AL_SHM_ABANDONED); }

/* The rank that broke the segment, or -1 while it is usable. */
static inline int al_shm_broken_by(const al_shm_seg *s) {
  return (int)(__atomic_load_n(al_shm_health(s), __ATOMIC_ACQUIRE) & 0xffffffffULL) - 1;
}

/* Why (AL_SHM_ABANDONED ...), once al_shm_broken_by is >= 0. */
static inline int al_shm_broken_why(const al_shm_seg *s) {
  return (int)(__atomic_load_n(al_shm_health(s), __ATOMIC_ACQUIRE) >> 32);
}

/* The lazy arrive (see the protocol): 1 once every peer's flag has reached s->owed, after
 * which nothing is owed; else 0 with the first peer short of it in o->waiting and the value in
 * o->want (the timeout message).  Never blocks; rescans every peer (a poll is p loads). */
static inline int al_shm_settled(al_shm_seg *s, al_shm_op *o) {
  int r;
  if (s->owed == 0)
    return 1;
  for (r = 0; r < s->size; r++)
    if (r != s->rank && __atomic_load_n(al_shm_flag(s, r), __ATOMIC_ACQUIRE) < s->owed) {
      o->want = s->owed;
      o->waiting = r;
      return 0;
    }
  s->owed = 0;
  return 1;
}

/* 1 once every peer's flag has reached o->want, and every peer's fingerprint of buffer b is
 * this op's; AL_SHM_MISMATCH (o->waiting: the peer, o->theirs: its fingerprint) if one is
 * not; else 0 (never blocks). */
static inline int al_shm_arrived(const al_shm_seg *s, al_shm_op *o, int b) {
  while (o->waiting < s->size) {
    if (o->waiting != s->rank) {
      if (__atomic_load_n(al_shm_flag(s, o->waiting), __ATOMIC_ACQUIRE) < o->want)
        return 0;
      o->theirs = *al_shm_fpw(s, b, o->waiting);
      if (o->theirs != o->fp)
        return AL_SHM_MISMATCH;
    }
    o->waiting++;
  }
  return 1;
}

/* ---- data movement ---- */

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
 * slower (bench/recvbuf_offsets.py, docs/performance.md "recvbuf alignment").  16-byte vectors,
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
/* The collectives' codes (al_shm_fp's bits 0-2; 0 is the allreduce), described with each. */
enum { AL_SHM_ALLGATHER = 1, AL_SHM_BCAST = 2, AL_SHM_REDUCE_SCATTER = 3, AL_SHM_BARRIER = 4 };
enum { AL_SHM_ALLGATHERV = 5, AL_SHM_ALLTOALL = 6, AL_SHM_ALLTOALLV = 7 };

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

/* ---- the allreduce ---- */

typedef struct al_shm_args {
  int dtype, rop, esize;
  const char *sbuf;                  /* == rbuf in place */
  char *rbuf;
  int64_t count;
  double avg_div;                    /* > 0: AVG, divide in the last reduction pass */
  int coll;                          /* 0: allreduce, else AL_SHM_ALLGATHER ... (below) */
  int root;                          /* bcast */
  const int *scounts, *sdispls;      /* v-collectives: per-rank elements (below); NULL where */
  const int *rcounts, *rdispls;      /* the collective has none */
} al_shm_args;

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

/* Elements of the round that starts at element `off`: a slot's worth, or what is left.  A split
 * allreduce of fewer than s->chunk_upto bytes takes s->chunk bytes a round instead: where each
 * rank has a core, rounds of a quarter of its L2 keep a round's blocks (its copy-in, the two
 * inputs and two outputs of its reduction, the copy-out) in L2 where recvbuf is not streamed:
 * 1.06-1.17x faster than 1 MiB rounds at 512 KiB-4 MiB at 2 ranks (docs/performance.md, "Rounds
 * that stay in L2").  Both are rank 0's, so every rank makes the same rounds. */
static inline int64_t al_shm_chunk(const al_shm_seg *s, const al_shm_args *a, int64_t off) {
  size_t bytes = (size_t)a->count * (size_t)a->esize, round = s->slot;
  int64_t cap;
  if (bytes > s->small && bytes < s->chunk_upto && s->chunk < round)
    round = s->chunk;
  cap = (int64_t)(round / (size_t)a->esize);
  return a->count - off < cap ? a->count - off : cap;
}

/* Start an allreduce: the protocol by size (the same on every rank: count and esize are), and
 * whether recvbuf is written with streaming stores (may differ between ranks: only this rank's
 * stores change). */
static inline void al_shm_allreduce_begin(al_shm_seg *s, al_shm_op *o, const al_shm_args *a) {
  size_t bytes = (size_t)a->count * a->esize;
  memset(o, 0, sizeof(*o));
  o->split = bytes > s->small && s->size > 1;
  o->stream = o->split && AL_SHM_CAN_STREAM && bytes >= al_shm_stream_from(s->size);
  o->phase = a->count > 0 ? AL_SHM_PUT : AL_SHM_END;
  o->fp = al_shm_fp(0, a->dtype, a->rop, 0, a->count, ++s->ops);
  al_shm_choose_stores(s, o, bytes);
}

/* Split protocol, copy-in: the blocks j != me of the chunk [off, off + chunk) of sendbuf into
 * my slot of buffer b (streamed and fenced if `nt`). */
static void al_shm_split_in(const al_shm_seg *s, const al_shm_args *a, int b, int64_t off,
                            int64_t chunk, int nt) {
  int64_t lo, hi, es = a->esize;
  int j;
  for (j = 0; j < s->size; j++) {
    if (j == s->rank) continue;
    al_shm_block(chunk, s->size, a->esize, j, &lo, &hi);
    al_shm_slot_copy(al_shm_slot(s, b, s->rank) + lo * es, a->sbuf + (off + lo) * es,
                     (size_t)(hi - lo) * es, nt);
  }
  if (nt)
    al_shm_stream_fence();
}

/* Split protocol, copy-out: every peer's reduced block of the chunk from its slot of buffer b
 * into recvbuf. */
static void al_shm_split_out(const al_shm_seg *s, const al_shm_args *a, int b, int64_t off,
                             int64_t chunk, int stream) {
  int64_t lo, hi, es = a->esize;
  int j;
  for (j = 0; j < s->size; j++) {
    if (j == s->rank) continue;
    al_shm_block(chunk, s->size, a->esize, j, &lo, &hi);
    al_shm_copy(a->rbuf + (off + lo) * es, al_shm_slot(s, b, j) + lo * es,
                (size_t)(hi - lo) * es, stream);
  }
}

/* Run the op until it must wait for a peer (returns 0), it is complete (1) or fails (-1:
 * unsupported (dtype, op), checked before by the caller).  Never blocks.
 *
 * Not done, measured (docs/performance.md): copying the next chunk in (into the other buffer)
 * and publishing it right after the second arrive of a round, before copying the peers'
 * reduced blocks of this round out, so that a peer late in one round does not delay the next
 * round's reduction by this rank's copy-out.  It would be safe (round m uses buffer b, round
 * m + 1 the other, b'):
 *   - writing my slot of b' in round m + 1 needs every peer done reading round m - 1 (b').  A
 *     peer's last reads of round m - 1 (its copy-out) come before its reduction of round m,
 *     hence before its second publish of round m, which my second arrive of round m has seen.
 *     Right after my first arrive of round m would not do: in this order a peer publishes
 *     round m's first flag before its copy-out of round m - 1.
 *   - reading b after publishing round m + 1's first flag: a peer writes b next in round
 *     m + 2, by the same rule only after its second arrive of round m + 1, i.e. after my second
 *     publish of round m + 1, which comes after my copy-out of round m.
 *   - the counters stay in step: that publish (flag 2m + 3) also satisfies a peer still
 *     waiting for 2m + 2.
 * With ranks of equal speed the copy-out and copy-in take the same time on every rank and
 * the wait it removes is short; interleaved with the plain order at 4-64 MiB it was neither
 * consistently faster nor slower, so the plain order (one copy per phase) stays. */
static int al_shm_allreduce_advance(al_shm_seg *s, al_shm_op *o, const al_shm_args *a) {
  const char *src[AL_SHM_MAX_RANKS];
  int p = s->size, me = s->rank, j, k, b;
  int64_t lo, hi, es = a->esize;
  while (o->phase != AL_SHM_END) {
    b = (int)(s->round & 1);
    if (o->phase == AL_SHM_PUT) {
      if (!al_shm_settled(s, o)) { o->polls++; return 0; }   /* a lazy arrive owed (above) */
      o->chunk = al_shm_chunk(s, a, o->off);
      *al_shm_fpw(s, b, me) = o->fp;
      if (o->split) {
        al_shm_split_in(s, a, b, o->off, o->chunk, o->nt);
      } else {
        al_shm_slot_copy(al_shm_data(s, b, me, (size_t)(o->chunk * es)), a->sbuf + o->off * es,
                         (size_t)o->chunk * es, o->nt);
        if (o->nt) al_shm_stream_fence();
      }
      al_shm_publish(s, o);
      o->phase = AL_SHM_WAIT_IN;
    }
    if (o->phase == AL_SHM_WAIT_IN) {
      if ((k = al_shm_arrived(s, o, b)) != 1) {
        if (k < 0) return k;
        o->polls++;
        return 0;
      }
      if (o->split) {
        /* my block: into my slot (the peers copy it out), and into recvbuf: streamed from the
         * slot's tile (in L1) when streaming, else written and then copied to the slot; with
         * streamed slot stores, both from a tile on the stack */
        char *in_slot = al_shm_slot(s, b, me), *in_rbuf;
        al_shm_block(o->chunk, p, a->esize, me, &lo, &hi);
        in_slot += lo * es;
        in_rbuf = a->rbuf + (o->off + lo) * es;
        src[0] = a->sbuf + (o->off + lo) * es;
        for (j = 0, k = 1; j < p; j++)
          if (j != me) src[k++] = al_shm_slot(s, b, j) + lo * es;
        if (o->nt)
          k = al_shm_reduce_streamed(a->dtype, a->rop, a->esize, in_rbuf, in_slot, src, p,
                                     hi - lo, a->avg_div, o->stream);
        else
          k = al_shm_reduce_copy(a->dtype, a->rop, a->esize, o->stream ? in_slot : in_rbuf, src,
                                 p, hi - lo, a->avg_div, o->stream ? in_rbuf : in_slot,
                                 o->stream);
        if (k != 0)
          return -1;
        al_shm_publish(s, o);
        o->phase = AL_SHM_WAIT_OUT;
      } else {
        for (j = 0; j < p; j++) src[j] = al_shm_data(s, b, j, (size_t)(o->chunk * es));
        if (al_shm_reduce(a->dtype, a->rop, a->esize, a->rbuf + o->off * es, src, p, o->chunk,
                          a->avg_div, NULL) != 0)
          return -1;
        o->phase = AL_SHM_PUT;          /* round complete */
      }
    }
    if (o->phase == AL_SHM_WAIT_OUT) {
      if ((k = al_shm_arrived(s, o, b)) != 1) {
        if (k < 0) return k;
        o->polls++;
        return 0;
      }
      al_shm_split_out(s, a, b, o->off, o->chunk, o->stream);
      o->phase = AL_SHM_PUT;            /* round complete */
    }
    /* here only at the end of a round */
    s->round++;
    o->off += o->chunk;
    if (o->off >= a->count)
      o->phase = AL_SHM_END;
  }
  return 1;
}

/* ---- allgather, bcast, reduce_scatter, barrier ----
 *
 * One publish per round, as the symmetric allreduce: write what the peers read from my slot
 * (possibly nothing; inline areas when a round's data is at most AL_SHM_INLINE bytes per
 * rank); publish; arrive; read the peers' slots.  Every rank publishes in every round, even
 * one that writes nothing (bcast's non-roots, barrier), so the flags stay in step and the rule
 * of the protocol holds as it is.  These ops share the rounds with the allreduce.
 *
 *   allgather (count: elements per rank): copy my chunk of sendbuf into my slot; copy every
 *     peer's chunk out into its block of recvbuf (my own block straight from sendbuf).
 *   bcast (count: elements of the buffer): the root, once settled, copies the chunk into its
 *     slot and publishes, and is done with the round: it reads nothing, so its arrive is lazy
 *     (owed until its next write).  The others publish, wait for the root's flag alone, copy
 *     the chunk out, and owe the arrive of the other peers.  So a root returns without waiting
 *     for its peers, and runs at most one round ahead of the slowest one (its next write waits
 *     for their publish of this round).
 *   reduce_scatter (count: elements of each rank's result): a round takes `chunk` elements of
 *     each of the p blocks (p * chunk fit one slot); I copy the blocks j != me into my slot
 *     (block j at j * chunk); I reduce my block, in rank order, from my sendbuf and the peers'
 *     slots into recvbuf (AVG: divided in the last pass).  In place (recvbuf == sendbuf, the
 *     result in its first `count` elements) works: round k writes recvbuf[off, off + chunk)
 *     after copying those elements of block 0 in, and reads nothing there afterwards.
 *   barrier (count 0): one round that writes nothing, with a full arrive (it settles whatever
 *     was owed: every flag has reached this round's value).
 */
/* (AL_SHM_ALLGATHER ... AL_SHM_BARRIER: the collectives' codes, with the slots' stores) */

/* Elements of each block per round. */
static inline int64_t al_shm_coll_cap(const al_shm_seg *s, const al_shm_args *a) {
  int64_t cap = (int64_t)(s->slot / (size_t)a->esize);
  if (a->coll == AL_SHM_REDUCE_SCATTER) cap /= s->size;
  return cap > 0 ? cap : 1;
}

static inline void al_shm_coll_begin(al_shm_seg *s, al_shm_op *o, const al_shm_args *a) {
  memset(o, 0, sizeof(*o));
  o->phase = a->count > 0 || a->coll == AL_SHM_BARRIER ? AL_SHM_PUT : AL_SHM_END;
  o->fp = al_shm_fp(a->coll, a->dtype, a->rop, a->root, a->count, ++s->ops);
  al_shm_choose_stores(s, o, al_shm_written_bytes(s, a));
}

/* As al_shm_arrived for peer r alone (a bcast's non-root waits for the root alone). */
static inline int al_shm_arrived_from(const al_shm_seg *s, al_shm_op *o, int r, int b) {
  o->waiting = r;
  if (__atomic_load_n(al_shm_flag(s, r), __ATOMIC_ACQUIRE) < o->want)
    return 0;
  o->theirs = *al_shm_fpw(s, b, r);
  return o->theirs == o->fp ? 1 : AL_SHM_MISMATCH;
}

/* As al_shm_allreduce_advance, for a->coll (never blocks; -1: unsupported (dtype, op)). */
static int al_shm_coll_advance(al_shm_seg *s, al_shm_op *o, const al_shm_args *a) {
  const char *src[AL_SHM_MAX_RANKS];
  int p = s->size, me = s->rank, j, b;
  int bcast = a->coll == AL_SHM_BCAST, root = bcast && me == a->root;
  int64_t es = a->esize, n = a->count, off, c;
  int rc, nt;
  size_t span;                       /* bytes of a round per rank: where they go (al_shm_data) */
  while (o->phase != AL_SHM_END) {
    b = (int)(s->round & 1);
    off = o->off;
    if (o->phase == AL_SHM_PUT) {
      int64_t cap = al_shm_coll_cap(s, a);
      char *mine;
      if (!al_shm_settled(s, o)) { o->polls++; return 0; }   /* every round: the fingerprint */
      c = o->chunk = n - off < cap ? n - off : cap;
      *al_shm_fpw(s, b, me) = o->fp;
      span = (size_t)(c * es) * (a->coll == AL_SHM_REDUCE_SCATTER ? (size_t)p : 1);
      mine = al_shm_data(s, b, me, span);
      nt = o->nt && span > AL_SHM_INLINE;       /* never into the flag's line */
      if (a->coll == AL_SHM_ALLGATHER) {
        al_shm_slot_copy(mine, a->sbuf + off * es, (size_t)(c * es), nt);
        if (a->rbuf + (me * n + off) * es != a->sbuf + off * es)
          memcpy(a->rbuf + (me * n + off) * es, a->sbuf + off * es, (size_t)(c * es));
      } else if (root) {
        memcpy(mine, a->sbuf + off * es, (size_t)(c * es));
      } else if (a->coll == AL_SHM_REDUCE_SCATTER) {
        for (j = 0; j < p; j++)
          if (j != me)
            al_shm_slot_copy(mine + j * c * es, a->sbuf + (j * n + off) * es, (size_t)(c * es),
                             nt);
      }
      if (nt) al_shm_stream_fence();
      al_shm_publish(s, o);
      o->phase = AL_SHM_WAIT_IN;
    }
    c = o->chunk;
    span = (size_t)(c * es) * (a->coll == AL_SHM_REDUCE_SCATTER ? (size_t)p : 1);
    if (root) {
      s->owed = s->seq;                /* the lazy arrive: nothing to read */
    } else if (bcast) {
      if ((rc = al_shm_arrived_from(s, o, a->root, b)) != 1) {
        if (rc < 0) return rc;
        o->polls++;
        return 0;
      }
      s->owed = s->seq;                /* the other peers' flags are not known to be there */
      al_shm_copy_lines(a->rbuf + off * es, al_shm_data(s, b, a->root, span), (size_t)(c * es));
    } else {
      if ((rc = al_shm_arrived(s, o, b)) != 1) {
        if (rc < 0) return rc;
        o->polls++;
        return 0;
      }
      s->owed = 0;                     /* every flag has reached this round's value */
      if (a->coll == AL_SHM_ALLGATHER) {
        for (j = 0; j < p; j++)
          if (j != me)
            al_shm_copy_lines(a->rbuf + (j * n + off) * es, al_shm_data(s, b, j, span),
                              (size_t)(c * es));
      } else if (a->coll == AL_SHM_REDUCE_SCATTER) {
        for (j = 0; j < p; j++)
          src[j] = j == me ? a->sbuf + (me * n + off) * es : al_shm_data(s, b, j, span) + me * c * es;
        if (al_shm_reduce(a->dtype, a->rop, a->esize, a->rbuf + off * es, src, p, c, a->avg_div,
                          NULL) != 0)
          return -1;
      }
    }
    s->round++;
    o->off += c;
    o->phase = o->off >= n ? AL_SHM_END : AL_SHM_PUT;
  }
  return 1;
}

/* ---- allgatherv, alltoall, alltoallv (issue 29) ----
 *
 * The same rounds as the collectives above (one publish per round, a full arrive, every round
 * settled first and fingerprinted), over blocks of per-rank sizes.  A round covers elements
 * [off, off + stride) of every block; `end` (al_shm_op) is where the rounds stop, the same on
 * every rank.
 *
 *   allgatherv (counts[j], displs[j]: rank j's block of recvbuf; the same counts on every
 *     rank): a round takes `slot / esize` elements of each block (stride); I copy my part of
 *     my block into my slot (inline area when it is at most AL_SHM_INLINE bytes; the reader
 *     knows my count, so it knows where), and into my block of recvbuf unless sendbuf is
 *     already there (in place: sendbuf is recvbuf + displs[me]); after the arrive I copy every
 *     peer's part out to its block.  end = max(counts): no round when every count is 0.
 *     The fingerprint's count is a hash of the counts: ranks whose counts differ fail.
 *   alltoall (count: elements per block, block j of sendbuf goes to rank j, block j of recvbuf
 *     comes from rank j): as reduce_scatter's rounds, `chunk` elements of each of the p - 1
 *     blocks for my peers ((p - 1) * chunk fit one slot; the block for rank j at q * chunk,
 *     q = al_shm_a2a_pos(me, j): my own block takes no room), and I copy my block of every
 *     peer's slot out; my own block goes straight from sendbuf to recvbuf.
 *   alltoallv (scounts[j], sdispls[j]: what I send rank j; rcounts[j], rdispls[j]: what I
 *     receive from it): the counts are not known across ranks (I know my row and column of
 *     the matrix only), so my slot starts with a header of p + 1 int32 words, written in round
 *     0: my scounts, then their maximum.  After round 0's arrive every rank checks that each
 *     peer sends it what it expects (header word `me` == rcounts[peer], else
 *     AL_SHM_COUNTS_DIFFER: the op fails and breaks the segment, as a fingerprint mismatch) and
 *     takes end = the largest maximum, the same on every rank.  Round 0 always runs (it carries
 *     the header); the data follows the header, a fixed `cap` elements per block (the block for
 *     rank j at header + al_shm_a2a_pos(me, j) * cap).  A block shorter than the round's range moves nothing in it.
 *   In place (alltoall(v): sendbuf == recvbuf with recvbuf's layout, which MPI requires): a
 *     round copies elements [off, off + stride) of my blocks into my slot before it overwrites
 *     the same elements of recvbuf with the peers' data, and later rounds read only later
 *     elements: the slot is the staging area, nothing else is needed.  My own block stays.
 */
/* (AL_SHM_ALLGATHERV ... AL_SHM_ALLTOALLV: with the slots' stores) */

/* The bytes of an alltoallv slot's header (p + 1 int32 words, whole cache lines). */
static inline size_t al_shm_vheader(int p) { return al_shm_round_up((size_t)(p + 1) * 4, 64); }

/* Elements of each block per round of an alltoall(v) of `esize`-byte elements (p - 1 blocks
 * a slot; alltoallv: after the header); 0 when not one fits (the entry refuses such an op). */
static inline int64_t al_shm_a2a_cap(const al_shm_seg *s, int esize, int v) {
  size_t room = s->slot - (v ? al_shm_vheader(s->size) : 0);
  if (v && al_shm_vheader(s->size) >= s->slot) return 0;
  return (int64_t)(room / (size_t)(s->size > 1 ? s->size - 1 : 1) / (size_t)esize);
}

/* Where writer i's slot holds its block for rank j (j != i): the p - 1 blocks in rank order,
 * i's own left out. */
static inline int al_shm_a2a_pos(int i, int j) { return j < i ? j : j - 1; }

/* al_shm_arrived, counting an unsuccessful poll (1: arrived, 0: wait, < 0: a mismatch). */
static inline int al_shm_arrive_poll(const al_shm_seg *s, al_shm_op *o, int b) {
  int rc = al_shm_arrived(s, o, b);
  if (rc == 0) o->polls++;
  return rc;
}

/* A 31-bit hash of p counts (FNV-1a): the fingerprint's count of an allgatherv. */
static inline int64_t al_shm_counts_hash(const int *c, int p) {
  uint64_t h = 1469598103934665603ULL;
  int i;
  for (i = 0; i < p; i++) {
    h ^= (uint32_t)c[i];
    h *= 1099511628211ULL;
  }
  return (int64_t)((h ^ h >> 31) & 0x7fffffffULL);
}

/* Elements of a block of n elements in the round [off, off + cap). */
static inline int64_t al_shm_part(int64_t n, int64_t off, int64_t cap) {
  return n <= off ? 0 : (n - off < cap ? n - off : cap);
}

static inline void al_shm_v_begin(al_shm_seg *s, al_shm_op *o, const al_shm_args *a) {
  int64_t key = 0, j;
  memset(o, 0, sizeof(*o));
  if (a->coll == AL_SHM_ALLGATHERV) {
    for (j = 0; j < s->size; j++)
      if (a->rcounts[j] > o->end) o->end = a->rcounts[j];
    key = al_shm_counts_hash(a->rcounts, s->size);
  } else if (a->coll == AL_SHM_ALLTOALL) {
    o->end = key = a->count;
  } else {
    o->end = -1;                     /* round 0 tells */
  }
  o->phase = o->end != 0 ? AL_SHM_PUT : AL_SHM_END;
  o->fp = al_shm_fp(a->coll, a->dtype, 0, 0, key, ++s->ops);
  al_shm_choose_stores(s, o, al_shm_written_bytes(s, a));
}

/* allgatherv: round [off, off + stride) in, then out (never blocks; 0: wait, 1: complete). */
static int al_shm_allgatherv_advance(al_shm_seg *s, al_shm_op *o, const al_shm_args *a) {
  int p = s->size, me = s->rank, j, rc;
  int64_t es = a->esize, cap = (int64_t)(s->slot / (size_t)a->esize), off, c;
  while (o->phase != AL_SHM_END) {
    int b = (int)(s->round & 1);
    off = o->off;
    o->chunk = cap;
    if (o->phase == AL_SHM_PUT) {
      if (!al_shm_settled(s, o)) { o->polls++; return 0; }
      int nt;
      *al_shm_fpw(s, b, me) = o->fp;
      c = al_shm_part(a->rcounts[me], off, cap);
      nt = o->nt && (size_t)(c * es) > AL_SHM_INLINE;
      al_shm_slot_copy(al_shm_data(s, b, me, (size_t)(c * es)), a->sbuf + off * es,
                       (size_t)(c * es), nt);
      if (a->rbuf + ((int64_t)a->rdispls[me] + off) * es != a->sbuf + off * es)
        memcpy(a->rbuf + ((int64_t)a->rdispls[me] + off) * es, a->sbuf + off * es,
               (size_t)(c * es));
      if (nt) al_shm_stream_fence();
      al_shm_publish(s, o);
      o->phase = AL_SHM_WAIT_IN;
    }
    if ((rc = al_shm_arrive_poll(s, o, b)) != 1)
      return rc;
    s->owed = 0;
    for (j = 0; j < p; j++) {
      if (j == me || (c = al_shm_part(a->rcounts[j], off, cap)) == 0) continue;
      al_shm_copy_lines(a->rbuf + ((int64_t)a->rdispls[j] + off) * es,
                        al_shm_data(s, b, j, (size_t)(c * es)), (size_t)(c * es));
    }
    s->round++;
    o->off += cap;
    o->phase = o->off >= o->end ? AL_SHM_END : AL_SHM_PUT;
  }
  return 1;
}

/* alltoall (a->scounts NULL: a->count per block) and alltoallv: as allgatherv's advance;
 * AL_SHM_COUNTS_DIFFER: peer o->waiting sends o->theirs elements, not rcounts[o->waiting]. */
static int al_shm_alltoall_advance(al_shm_seg *s, al_shm_op *o, const al_shm_args *a) {
  int p = s->size, me = s->rank, j, rc, v = a->coll == AL_SHM_ALLTOALLV;
  int64_t es = a->esize, n = a->count, cap = al_shm_a2a_cap(s, a->esize, v), off, c;
  size_t hdr = v ? al_shm_vheader(p) : 0, span;
  int inplace = a->sbuf == a->rbuf;
  while (o->phase != AL_SHM_END) {
    int b = (int)(s->round & 1);
    off = o->off;
    /* uniform blocks: `chunk` elements of each, packed (inline when small); v: `cap` apart */
    c = v ? cap : (n - off < cap ? n - off : cap);
    span = v ? s->slot : (size_t)(c * es) * (size_t)(p - 1);
    o->chunk = c;
    if (o->phase == AL_SHM_PUT) {
      char *mine;
      int nt;
      if (!al_shm_settled(s, o)) { o->polls++; return 0; }
      nt = o->nt && span > AL_SHM_INLINE;      /* never into the flag's line */
      *al_shm_fpw(s, b, me) = o->fp;
      mine = al_shm_data(s, b, me, span) + hdr;
      if (v && off == 0) {
        int32_t *h = (int32_t *)al_shm_slot(s, b, me), most = 0;
        for (j = 0; j < p; j++) {
          h[j] = a->scounts[j];
          if (a->scounts[j] > most) most = a->scounts[j];
        }
        h[p] = most;
      }
      for (j = 0; j < p; j++) {
        int64_t m = v ? al_shm_part(a->scounts[j], off, cap) : c;
        const char *from = a->sbuf + ((v ? (int64_t)a->sdispls[j] : j * n) + off) * es;
        if (m == 0) continue;
        if (j != me)
          al_shm_slot_copy(mine + al_shm_a2a_pos(me, j) * c * es, from, (size_t)(m * es), nt);
        else if (!inplace)
          al_shm_copy_lines(a->rbuf + ((v ? (int64_t)a->rdispls[j] : j * n) + off) * es, from,
                            (size_t)(m * es));
      }
      if (nt) al_shm_stream_fence();
      al_shm_publish(s, o);
      o->phase = AL_SHM_WAIT_IN;
    }
    if ((rc = al_shm_arrive_poll(s, o, b)) != 1)
      return rc;
    s->owed = 0;
    if (v && off == 0) {             /* the headers: the counts agree, and where the rounds end */
      for (j = 0; j < p; j++) {
        const int32_t *h = (const int32_t *)al_shm_slot(s, b, j);
        if (j != me && h[me] != a->rcounts[j]) {
          o->waiting = j;
          o->theirs = (uint64_t)(int64_t)h[me];
          return AL_SHM_COUNTS_DIFFER;
        }
        if (h[p] > o->end) o->end = h[p];
      }
    }
    for (j = 0; j < p; j++) {
      int64_t m = v ? al_shm_part(a->rcounts[j], off, cap) : c;
      if (j == me || m == 0) continue;
      al_shm_copy_lines(a->rbuf + ((v ? (int64_t)a->rdispls[j] : j * n) + off) * es,
                        al_shm_data(s, b, j, span) + hdr + al_shm_a2a_pos(j, me) * c * es,
                        (size_t)(m * es));
    }
    s->round++;
    o->off += c;
    o->phase = o->off >= o->end ? AL_SHM_END : AL_SHM_PUT;
  }
  return 1;
}

#endif
