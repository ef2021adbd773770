/* The shm transport's segment (ext/al_shm.h includes every part): its layout, its header
 * (nonce and checks), how it is created, opened and mapped, and its health word.
 *
 * The segment (al_shm_bytes): a header line, then one flag per rank, each on its own 128-byte
 * line (two 64-byte lines: x86's adjacent-line prefetcher pairs them), then the data: two
 * buffers, each one slot of `slot` bytes per rank (4 KiB aligned):
 *
 *     [header][flag 0][flag 1]...[flag p-1][buf 0: slot 0 ... slot p-1][buf 1: slot 0 ... slot p-1]
 *
 * A rank's flag line also holds, after the 8-byte flag, two fingerprint words, one per buffer
 * (al_shm_fp: the signature of the op of the round, ext/shm/protocol.h), then two
 * "inline" areas of AL_SHM_INLINE bytes, one per buffer: a round whose data is at most that
 * many bytes per rank puts it there instead of in the slot (al_shm_data), so that a reader
 * takes one cache-line transfer (flag, fingerprint and data together) instead of two.
 * Everything said of a slot of buffer b holds for inline area b and fingerprint b.
 *
 * A rank writes only its own flag line and its own slots; it reads everybody's.
 */
#ifndef AL_SHM_SEGMENT_H
#define AL_SHM_SEGMENT_H

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
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

typedef struct al_shm_seg {
  char *base;                        /* the mapping */
  size_t len;
  int rank, size;
  size_t slot;                       /* bytes per rank per buffer */
  size_t small;                      /* messages of at most this many bytes: symmetric protocol */
  uint64_t seq;                      /* the last value this rank published */
  uint64_t round;                    /* rounds so far (buffer = round % 2) */
  uint64_t ops;                      /* ops begun on the segment (the fingerprints' number) */
  size_t chunk;                      /* bytes of a split allreduce's round when the allreduce
                                        is under chunk_upto bytes (at most the slot): rank 0's,
                                        sent to every rank at setup (al_shm_chunk) */
  size_t chunk_upto;
  uint64_t pidns;                    /* this process's PID namespace (al_shm_ident_write) */
  double next_check;                 /* when a wait may next look for a dead peer (seconds,
                                        CLOCK_MONOTONIC; al_shm_dead_peer) */
} al_shm_seg;

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
       AL_SHM_MISMATCHED = 2,        /* the ranks' calls differ (fingerprints) */
       AL_SHM_DIED = 3 };            /* its process is gone (stored by a survivor) */

static inline void al_shm_mark_broken_why(al_shm_seg *s, int why) {
  uint64_t healthy = 0;
  __atomic_compare_exchange_n(al_shm_health(s), &healthy,
                              (uint64_t)why << 32 | ((uint64_t)s->rank + 1), 0,
                              __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

static inline void al_shm_mark_broken(al_shm_seg *s) { al_shm_mark_broken_why(s, AL_SHM_ABANDONED); }

/* Rank r's process is gone: a survivor stores that in the health word (r + 1, AL_SHM_DIED). */
static inline void al_shm_mark_dead(al_shm_seg *s, int r) {
  uint64_t healthy = 0;
  __atomic_compare_exchange_n(al_shm_health(s), &healthy,
                              (uint64_t)AL_SHM_DIED << 32 | ((uint64_t)r + 1), 0,
                              __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

/* The rank that broke the segment, or -1 while it is usable. */
static inline int al_shm_broken_by(const al_shm_seg *s) {
  return (int)(__atomic_load_n(al_shm_health(s), __ATOMIC_ACQUIRE) & 0xffffffffULL) - 1;
}

/* Why (AL_SHM_ABANDONED ...), once al_shm_broken_by is >= 0. */
static inline int al_shm_broken_why(const al_shm_seg *s) {
  return (int)(__atomic_load_n(al_shm_health(s), __ATOMIC_ACQUIRE) >> 32);
}

/* ---- dead peers ----
 * A peer whose process is gone never publishes again.  Each rank records who it is in the
 * second line of its flag's line pair at setup (al_shm_ident_write: its pid, the start time
 * /proc gives it, its PID namespace), and a rank that waits for a peer looks, every few dozen
 * milliseconds, whether that process still exists (al_shm_peer_gone: /proc/<pid>/stat gone, a
 * zombie, or another process under the same pid), and fails the op naming the dead rank
 * (al_shm_dead_peer, shm.pxi).  A peer in another PID namespace, or where /proc cannot be
 * read, is not looked at: its death is left to the hang timeout. */
static inline uint64_t *al_shm_ident(const al_shm_seg *s, int r) {
  return (uint64_t *)((char *)al_shm_flag(s, r) + 64);
}

/* Process `pid`'s state in /proc: 1 alive (its start time, in clock ticks since boot, in
 * *start), 0 gone (no such process, a zombie, or dead), -1 unknown (/proc unreadable). */
static int al_shm_proc_start(long pid, uint64_t *start) {
  char path[64], buf[1024], *p;
  ssize_t n;
  int fd, field;
  snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
  fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return errno == ENOENT || errno == ESRCH ? 0 : -1;
  n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n <= 0)
    return n == 0 || errno == ESRCH ? 0 : -1;
  buf[n] = 0;
  p = strrchr(buf, ')');              /* the command may hold spaces and parentheses */
  if (p == NULL || p[1] != ' ')
    return -1;
  p += 2;                             /* field 3, the state */
  if (*p == 'Z' || *p == 'X' || *p == 'x')
    return 0;
  for (field = 3; field < 22 && *p; field++) {
    p = strchr(p, ' ');
    if (p == NULL)
      return -1;
    p++;
  }
  *start = strtoull(p, NULL, 10);     /* field 22, the start time */
  return 1;
}

/* Record this rank's identity in its flag's line pair of the mapping `base` of `size` ranks
 * (at setup, before the ranks report: every peer sees it once the setup is done).  pid 0
 * (nothing to look at) where /proc does not tell the start time. */
static void al_shm_ident_write(char *base, int rank, uint64_t *pidns) {
  uint64_t *w = (uint64_t *)(base + (size_t)(rank + 1) * AL_SHM_LINE + 64), start = 0;
  struct stat st;
  long pid = (long)getpid();
  *pidns = stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
  w[0] = al_shm_proc_start(pid, &start) == 1 ? (uint64_t)pid : 0;
  w[1] = start;
  w[2] = *pidns;
}

/* 1 when rank r's process is gone (al_shm_ident_write's pid no longer runs the process that
 * wrote it), else 0 (alive, or not known). */
static int al_shm_peer_gone(const al_shm_seg *s, int r) {
  const uint64_t *w = al_shm_ident(s, r);
  uint64_t start = 0;
  int state;
  if (r == s->rank || w[0] == 0 || w[2] != s->pidns)
    return 0;
  state = al_shm_proc_start((long)w[0], &start);
  return state == 0 || (state == 1 && start != w[1]);
}

#endif  /* AL_SHM_SEGMENT_H */
