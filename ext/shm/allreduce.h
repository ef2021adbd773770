/* The shm allreduce: the symmetric and the split protocol (ext/shm/protocol.h describes both;
 * ext/al_shm.h includes every part). */
#ifndef AL_SHM_ALLREDUCE_H
#define AL_SHM_ALLREDUCE_H

#include "copy.h"

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
  o->phase = AL_SHM_PUT;             /* a count of 0 too: its round checks the peers' */
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

#endif  /* AL_SHM_ALLREDUCE_H */
