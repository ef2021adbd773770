/* The shm allgather, bcast, reduce_scatter and barrier (ext/al_shm.h includes every part).
 *
 * One publish per round, as the symmetric allreduce: write what the peers read from my slot
 * (possibly nothing; inline areas when a round's data is at most AL_SHM_INLINE bytes per
 * rank); publish; arrive; read the peers' slots.  Every rank publishes in every round, even
 * one that writes nothing (bcast's non-roots, barrier), so the flags stay in step and the rule
 * of the protocol holds as it is.  These ops share the rounds with the allreduce.
 *
 *   allgather (count: elements per rank): copy my chunk of sendbuf into my slot; copy every
 *     peer's chunk out into its block of recvbuf (my own block straight from sendbuf).
 *   bcast (count: elements of the buffer): the root copies the chunk into its slot; every
 *     rank publishes and waits for every peer, checking its fingerprint (the root and the
 *     count: ranks that disagree on either fail on every rank); the others copy the chunk
 *     out.
 *   reduce_scatter (count: elements of each rank's result): a round takes `chunk` elements of
 *     each of the p blocks (p * chunk fit one slot); I copy the blocks j != me into my slot
 *     (block j at j * chunk); I reduce my block, in rank order, from my sendbuf and the peers'
 *     slots into recvbuf (AVG: divided in the last pass).  In place (recvbuf == sendbuf, the
 *     result in its first `count` elements) works: round k writes recvbuf[off, off + chunk)
 *     after copying those elements of block 0 in, and reads nothing there afterwards.
 *   barrier (count 0): one round that writes nothing.
 */
#ifndef AL_SHM_COLLECTIVES_H
#define AL_SHM_COLLECTIVES_H

#include "copy.h"

/* Elements of each block per round. */
static inline int64_t al_shm_coll_cap(const al_shm_seg *s, const al_shm_args *a) {
  int64_t cap = (int64_t)(s->slot / (size_t)a->esize);
  if (a->coll == AL_SHM_REDUCE_SCATTER) cap /= s->size;
  return cap > 0 ? cap : 1;
}

static inline void al_shm_coll_begin(al_shm_seg *s, al_shm_op *o, const al_shm_args *a) {
  memset(o, 0, sizeof(*o));
  o->phase = AL_SHM_PUT;             /* a count of 0 too: its round checks the peers' */
  o->fp = al_shm_fp(a->coll, a->dtype, a->rop, a->root, a->count, ++s->ops);
  al_shm_choose_stores(s, o, al_shm_written_bytes(s, a));
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
    if ((rc = al_shm_arrive_poll(s, o, b)) != 1)
      return rc;
    if (bcast && !root) {
      al_shm_copy_lines(a->rbuf + off * es, al_shm_data(s, b, a->root, span), (size_t)(c * es));
    } else if (a->coll == AL_SHM_ALLGATHER) {
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
    s->round++;
    o->off += c;
    o->phase = o->off >= n ? AL_SHM_END : AL_SHM_PUT;
  }
  return 1;
}

#endif  /* AL_SHM_COLLECTIVES_H */
