/* The intra-node shared-memory transport ("shm") of aluminum_py: one segment per communicator
 * whose ranks all share a node, and the collectives over it.  Pure C, called without the GIL
 * from ext/core/shm.pxi (the op glue, the collective segment setup, the Python classes).
 *
 * One file per concept, each including the ones it builds on:
 *   shm/segment.h       the segment's layout, header (nonce, checks), creation and health word
 *   shm/protocol.h      rounds, flags, fingerprints, the lazy arrive (and why no barrier)
 *   shm/copy.h          blocks, streaming stores, copies, tile-by-tile reductions, slot stores
 *   shm/allreduce.h     the allreduce (symmetric and split protocols)
 *   shm/collectives.h   allgather, bcast, reduce_scatter, barrier
 *   shm/vcollectives.h  allgatherv, alltoall, alltoallv
 */
#ifndef AL_SHM_H
#define AL_SHM_H

#include "shm/segment.h"
#include "shm/protocol.h"
#include "shm/copy.h"
#include "shm/allreduce.h"
#include "shm/collectives.h"
#include "shm/vcollectives.h"

#endif  /* AL_SHM_H */
