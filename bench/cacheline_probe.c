/* Where the host put two CPUs (bench/shm_stores.py): two threads pinned to CPUs A and B
 * (arguments, default 0 and 1) pass one cache line back and forth 100000 times and print the
 * round trip in ns (near: the CPUs share a last-level cache; on the 2-core reference VM 50-65
 * ns there, 330-590 ns when the host ran them on cores that share none), then the GB/s at
 * which B reads 512 KiB that A has just written, and at which A reads what it wrote itself.
 *     cc -O2 -pthread -o probe bench/cacheline_probe.c && ./probe [A B] */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define N (512*1024)
#define REPS 200
static volatile uint64_t flag __attribute__((aligned(128)));
static volatile uint64_t flag2 __attribute__((aligned(128)));
static char *buf;
static double rt_ns, remote_gbs, local_gbs;
static volatile uint64_t sink;
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);pthread_setaffinity_np(pthread_self(),sizeof s,&s);}
static uint64_t readbuf(void){uint64_t s=0;const uint64_t*p=(const uint64_t*)buf;for(size_t i=0;i<N/8;i+=8)s+=p[i]+p[i+1]+p[i+2]+p[i+3]+p[i+4]+p[i+5]+p[i+6]+p[i+7];return s;}
static int cpu_a = 0, cpu_b = 1;
static void *t1(void*a){pin(cpu_b);
  /* ping-pong */
  for(uint64_t i=1;i<=100000;i++){while(flag!=2*i-1);flag=2*i;}
  /* remote read: wait for writer round r, read, ack */
  double tot=0;
  for(uint64_t r=1;r<=REPS;r++){while(flag2!=2*r-1);double t0=now();sink+=readbuf();tot+=now()-t0;flag2=2*r;}
  remote_gbs=(double)N*REPS/tot/1e9;
  return NULL;}
int main(int argc,char**argv){pthread_t th;if(argc>2){cpu_a=atoi(argv[1]);cpu_b=atoi(argv[2]);}buf=aligned_alloc(4096,N);memset(buf,1,N);flag=0;flag2=0;
  pthread_create(&th,NULL,t1,NULL);pin(cpu_a);
  double t0=now();
  for(uint64_t i=1;i<=100000;i++){flag=2*i-1;while(flag!=2*i);}
  rt_ns=(now()-t0)/100000*1e9;
  for(uint64_t r=1;r<=REPS;r++){memset(buf,(int)r,N);flag2=2*r-1;while(flag2!=2*r);}
  pthread_join(th,NULL);
  double tot=0;for(int r=0;r<REPS;r++){memset(buf,r,N);double a=now();sink+=readbuf();tot+=now()-a;}
  local_gbs=(double)N*REPS/tot/1e9;
  printf("rt_ns %.0f remote_dirty_GBs %.1f local_GBs %.1f\n",rt_ns,remote_gbs,local_gbs);return 0;}
