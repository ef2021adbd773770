/* The shm transport's protocol: rounds, flags and fingerprints, with the argument that they
 * need no closing barrier (ext/al_shm.h includes every part).
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
 *     stores (ext/shm/copy.h: each tile is reduced into the slot, then streamed to recvbuf).
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
 * calls).  The word is in the flag's cache line: no extra transfer.  Every rank waits for,
 * and checks, every peer in every round, even where it reads no peer's data (a bcast's root,
 * a barrier): so a mismatch fails the op on every rank of it, in the call, and a rank whose
 * count is 0 still makes its op's one round (a peer whose count is not fails with it).  The
 * word has the lifetime of the round's data: a peer may still check the word of round m until
 * this rank has seen it publish round m + 1, which the rule above waits for.
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
#ifndef AL_SHM_PROTOCOL_H
#define AL_SHM_PROTOCOL_H

#include "segment.h"

#define AL_SHM_MISMATCH (-2)         /* an advance's result: a peer's fingerprint differs */
#define AL_SHM_COUNTS_DIFFER (-3)    /* alltoallv: a peer sends another count than expected */
#define AL_SHM_COUNTS_EXPECTED (-4)  /* alltoallv: a peer expects another count than sent */
#define AL_SHM_COUNTS_ELSEWHERE (-5) /* alltoallv: two other ranks' counts disagree */

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

/* The collectives' codes (al_shm_fp's bits 0-2; 0 is the allreduce), described with each. */
enum { AL_SHM_ALLGATHER = 1, AL_SHM_BCAST = 2, AL_SHM_REDUCE_SCATTER = 3, AL_SHM_BARRIER = 4 };
enum { AL_SHM_ALLGATHERV = 5, AL_SHM_ALLTOALL = 6, AL_SHM_ALLTOALLV = 7 };

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

/* ---- flags ---- */

static inline void al_shm_publish(al_shm_seg *s, al_shm_op *o) {
  s->seq++;
  __atomic_store_n(al_shm_flag(s, s->rank), s->seq, __ATOMIC_RELEASE);
  o->want = s->seq;
  o->waiting = 0;
  o->polls = 0;
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

/* The peer an op waits for (o->waiting), if its process is gone, else -1: looked at every
 * AL_SHM_CHECK_POLLS unsuccessful polls and at most every AL_SHM_CHECK_EVERY seconds per
 * segment (a read of /proc: microseconds), so that a survivor names a dead peer well within a
 * second and a long wait spends next to nothing on it. */
#define AL_SHM_CHECK_POLLS 64
#define AL_SHM_CHECK_EVERY 0.05
static inline int al_shm_dead_peer(al_shm_seg *s, const al_shm_op *o) {
  struct timespec t;
  double now;
  if (o->polls % AL_SHM_CHECK_POLLS != 0 || o->waiting < 0 || o->waiting >= s->size)
    return -1;
  clock_gettime(CLOCK_MONOTONIC, &t);
  now = (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
  if (now < s->next_check)
    return -1;
  s->next_check = now + AL_SHM_CHECK_EVERY;
  return al_shm_peer_gone(s, o->waiting) ? o->waiting : -1;
}

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

#endif  /* AL_SHM_PROTOCOL_H */
