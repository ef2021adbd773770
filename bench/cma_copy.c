/* The kernel's cross-memory copy (process_vm_readv of a forked child's buffer) against a
 * memcpy in one process, best of many: what the direct protocol of issue 31 paid per byte.
 *     cc -O2 -o cma_copy bench/cma_copy.c && ./cma_copy BYTES [BYTES_PER_SYSCALL]
 * Results: bench/results/issue31_shm_direct.txt. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
int main(int argc,char**argv){
  size_t n = (size_t)atol(argv[1]); size_t tile = argc>2? (size_t)atol(argv[2]) : n;
  char *src = aligned_alloc(4096, n); memset(src, 1, n);
  pid_t c = fork();
  if (c==0){ memset(src,2,n); pause(); return 0; } usleep(300000);
  char *dst = aligned_alloc(4096, n); memset(dst, 0, n);
  int reps = (int)(2e9 / n); if (reps>2000) reps=2000; if (reps<20) reps=20;
  double best=1e9, bm=1e9;
  for (int r=0;r<reps;r++){
    double t0=now();
    for (size_t off=0; off<n; off+=tile){
      size_t len = n-off<tile? n-off: tile;
      struct iovec l={dst+off,len}, rm={src+off,len};
      if (process_vm_readv(c,&l,1,&rm,1,0)!=(ssize_t)len){perror("cma");return 1;}
    }
    double t=now()-t0; if(t<best)best=t;
    t0=now(); memcpy(dst,src,n); t=now()-t0; if(t<bm)bm=t;
  }
  printf("%zu B tile %zu: cma %.1f us (%.2f GB/s)  memcpy %.1f us (%.2f GB/s)\n", n, tile, best*1e6, n/best/1e9, bm*1e6, n/bm/1e9);
  kill(c,9); wait(NULL); return 0;
}
