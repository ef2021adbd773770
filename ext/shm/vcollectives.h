/* The shm allgatherv, alltoall and alltoallv (ext/al_shm.h includes every part).
 *
 * The same rounds as the collectives of ext/shm/collectives.h (one publish per round, a full
 * arrive, every round fingerprinted), over blocks of per-rank sizes.  A round covers elements
 * [off, off + stride) of every block; `end` (al_shm_op) is where the rounds stop, the same on
 * every rank.
 *
 *   allgatherv (counts[j], displs[j]: rank j's block of recvbuf; the same counts on every
 *     rank): a round takes `slot / esize` elements of each block (stride); I copy my part of
 *     my block into my slot (inline area when it is at most AL_SHM_INLINE bytes; the reader
 *     knows my count, so it knows where), and into my block of recvbuf unless sendbuf is
 *     already there (in place: sendbuf is recvbuf + displs[me]); after the arrive I copy every
 *     peer's part out to its block.  end = max(counts); one round when every count is 0.
 *     The fingerprint's count is a hash of the counts: ranks whose counts differ fail.
 *   alltoall (count: elements per block, block j of sendbuf goes to rank j, block j of recvbuf
 *     comes from rank j): as reduce_scatter's rounds, `chunk` elements of each of the p - 1
 *     blocks for my peers ((p - 1) * chunk fit one slot; the block for rank j at q * chunk,
 *     q = al_shm_a2a_pos(me, j): my own block takes no room), and I copy my block of every
 *     peer's slot out; my own block goes straight from sendbuf to recvbuf.
 *   alltoallv (scounts[j], sdispls[j]: what I send rank j; rcounts[j], rdispls[j]: what I
 *     receive from it): the counts are not known across ranks (I know my row and column of
 *     the matrix only), so my slot starts with a header, written in round 0: my scounts, my
 *     rcounts, the scounts' maximum (int32 words), then two sums over my row and my column
 *     of a 64-bit mix of (sender, receiver, count) (al_shm_vmix).  After round 0's arrive
 *     every rank reads every header: each peer must send it what it expects (else
 *     AL_SHM_COUNTS_DIFFER) and expect what it sends (else AL_SHM_COUNTS_EXPECTED), and the
 *     sums of the row sums and of the column sums over every rank must be equal (else a pair
 *     of other ranks disagrees: AL_SHM_COUNTS_ELSEWHERE).  Every rank reads the same headers,
 *     so where any pair disagrees every rank fails the op (and breaks the segment, as a
 *     fingerprint mismatch); else it takes end = the largest maximum, the same on every
 *     rank.  Round 0 always runs (it carries the header); the data follows the header, a
 *     fixed `cap` elements per block (the block for rank j at header + al_shm_a2a_pos(me, j)
 *     * cap).  A block shorter than the round's range moves nothing in it.
 *   In place (alltoall(v): sendbuf == recvbuf with recvbuf's layout, which MPI requires): a
 *     round copies elements [off, off + stride) of my blocks into my slot before it overwrites
 *     the same elements of recvbuf with the peers' data, and later rounds read only later
 *     elements: the slot is the staging area, nothing else is needed.  My own block stays.
 */
#ifndef AL_SHM_VCOLLECTIVES_H
#define AL_SHM_VCOLLECTIVES_H

#include "copy.h"

/* Where an alltoallv slot's header has its two sums (after 2p + 1 int32 words, 8-aligned), and
 * the header's bytes (whole cache lines). */
static inline size_t al_shm_vsums(int p) { return al_shm_round_up((size_t)(2 * p + 1) * 4, 8); }
static inline size_t al_shm_vheader(int p) { return al_shm_round_up(al_shm_vsums(p) + 16, 64); }

/* A 64-bit mix of one entry of the count matrix: `from` sends `to` `count` elements
 * (splitmix64's finaliser): a pair whose two ranks disagree changes the sums of one side. */
static inline uint64_t al_shm_vmix(int from, int to, int32_t count) {
  uint64_t z = (uint64_t)from << 48 ^ (uint64_t)to << 32 ^ (uint32_t)count;
  z = (z ^ z >> 30) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ z >> 27) * 0x94d049bb133111ebULL;
  return z ^ z >> 31;
}

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
  o->phase = AL_SHM_PUT;             /* every count 0 too: its round checks the peers' */
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
 * AL_SHM_COUNTS_DIFFER: peer o->waiting sends o->theirs elements, not rcounts[o->waiting];
 * AL_SHM_COUNTS_EXPECTED: it expects o->theirs, not scounts[o->waiting];
 * AL_SHM_COUNTS_ELSEWHERE: two other ranks disagree. */
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
      nt = o->nt && span > AL_SHM_INLINE;      /* never into the flag's line */
      *al_shm_fpw(s, b, me) = o->fp;
      mine = al_shm_data(s, b, me, span) + hdr;
      if (v && off == 0) {
        int32_t *h = (int32_t *)al_shm_slot(s, b, me), most = 0;
        uint64_t *sums = (uint64_t *)((char *)h + al_shm_vsums(p));
        sums[0] = sums[1] = 0;
        for (j = 0; j < p; j++) {
          h[j] = a->scounts[j];
          h[p + j] = a->rcounts[j];
          if (a->scounts[j] > most) most = a->scounts[j];
          sums[0] += al_shm_vmix(me, j, a->scounts[j]);
          sums[1] += al_shm_vmix(j, me, a->rcounts[j]);
        }
        h[2 * p] = most;
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
    if (v && off == 0) {             /* the headers: the counts agree, and where the rounds end */
      uint64_t sent = 0, expected = 0;
      for (j = 0; j < p; j++) {
        const int32_t *h = (const int32_t *)al_shm_slot(s, b, j);
        const uint64_t *sums = (const uint64_t *)((const char *)h + al_shm_vsums(p));
        o->waiting = j;
        if (j != me && h[me] != a->rcounts[j]) {
          o->theirs = (uint64_t)(int64_t)h[me];
          return AL_SHM_COUNTS_DIFFER;
        }
        if (j != me && h[p + me] != a->scounts[j]) {
          o->theirs = (uint64_t)(int64_t)h[p + me];
          return AL_SHM_COUNTS_EXPECTED;
        }
        if (h[2 * p] > o->end) o->end = h[2 * p];
        sent += sums[0];
        expected += sums[1];
      }
      if (sent != expected)
        return AL_SHM_COUNTS_ELSEWHERE;
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

#endif  /* AL_SHM_VCOLLECTIVES_H */
