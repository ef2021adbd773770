/* How long the host keeps two vCPUs in one placement (docs/performance.md, "How long a
 * placement lasts").  Two threads pinned to CPUs 0 and 1 pass a cache line back and forth in
 * batches of 200 round trips (the least of 5 batches is a sample), one sample every 10 ms for
 * SECONDS; between samples the main thread sleeps (`idle`, the default) or spins (`busy`: both
 * vCPUs stay busy, as during a run of collectives).  Prints each change of placement: near
 * (round trip up to 200 ns: the CPUs share a last-level cache) or far, with how long the one
 * before lasted, then the count of placements and the longest.
 *     cc -O2 -pthread -o flips bench/placement_flips.c && ./flips [SECONDS] [idle|busy] */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static volatile uint64_t flag __attribute__((aligned(128)));
#define STOP (~(uint64_t)0)

static void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

static void *echo(void *arg) {
  (void)arg;
  pin(1);
  for (uint64_t i = 1;; i++) {
    uint64_t f;
    while ((f = flag) != 2 * i - 1)
      if (f == STOP) return NULL;
    flag = 2 * i;
  }
}

int main(int argc, char **argv) {
  double seconds = argc > 1 ? atof(argv[1]) : 60, t0, since, longest = 0;
  int busy = argc > 2 && strcmp(argv[2], "busy") == 0, last = -1, states = 0;
  uint64_t i = 1;
  pthread_t t;
  pthread_create(&t, NULL, echo, NULL);
  pin(0);
  t0 = since = now();
  while (now() - t0 < seconds) {
    double best = 1e9;
    for (int b = 0; b < 5; b++) {
      double s = now();
      for (int k = 0; k < 200; k++, i++) {
        flag = 2 * i - 1;
        while (flag != 2 * i) {}
      }
      if ((now() - s) / 200 * 1e9 < best) best = (now() - s) / 200 * 1e9;
    }
    int far = best > 200;
    if (far != last) {
      double lasted = now() - since;
      if (last >= 0 && lasted > longest) longest = lasted;
      printf("%7.2f s %s %4.0f ns (the one before lasted %.2f s)\n", now() - t0,
             far ? "far " : "near", best, last < 0 ? 0.0 : lasted);
      since = now();
      last = far;
      states++;
    }
    if (busy) {
      double w = now();
      while (now() - w < 0.01) {}
    } else {
      struct timespec ts = {0, 10000000};
      nanosleep(&ts, NULL);
    }
  }
  if (now() - since > longest) longest = now() - since;
  printf("%d placements in %.0f s (%s), the longest %.2f s\n", states, seconds,
         busy ? "busy" : "idle", longest);
  flag = STOP;
  pthread_join(t, NULL);
  return 0;
}
