#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#include <immintrin.h>
#include <unistd.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);pthread_setaffinity_np(pthread_self(),sizeof s,&s);}
#define MAXBUF 8
static size_t SLOT = 1<<20;
static int NBUF = 2;
static volatile uint64_t flags[2][32] __attribute__((aligned(128)));
static char *slots; /* [buf][rank] */
static char *slot(int b,int r){return slots+((size_t)b*2+r)*SLOT;}
static volatile int variant, go_id; static volatile size_t msg;
static volatile uint64_t cmd[2][32] __attribute__((aligned(128)));
static double res[2];
static void nt_copy(char*d,const char*s,size_t n){for(size_t i=0;i<n;i+=64){__m512i x=_mm512_loadu_si512(s+i);_mm512_stream_si512((void*)(d+i),x);}}
static void flush(const char*p,size_t n){for(size_t i=0;i<n;i+=64)_mm_clflushopt((void*)(p+i));}
static void add(float*o,const float*a,const float*b,size_t n){for(size_t i=0;i<n;i++)o[i]=a[i]+b[i];}
static void add_nt2(float*o,float*o2,const float*a,const float*b,size_t n){for(size_t i=0;i<n;i+=16){__m512 x=_mm512_add_ps(_mm512_loadu_ps(a+i),_mm512_loadu_ps(b+i));_mm512_storeu_ps(o+i,x);_mm512_stream_ps(o2+i,x);}}
static uint64_t seq[2];
static void publish(int me){seq[me]++;__atomic_store_n(&flags[me][0],seq[me],__ATOMIC_RELEASE);}
static void arrive(int me){while(__atomic_load_n(&flags[1-me][0],__ATOMIC_ACQUIRE)<seq[me])_mm_pause();}
static uint64_t round_[2];
static void allreduce(int me,char*sb,char*rb,size_t n,int v){
  size_t off=0;
  while(off<n){size_t c=n-off<SLOT?n-off:SLOT;size_t h=c/2;
    int b=(int)(round_[me]%NBUF);
    size_t mylo=me?h:0, peerlo=me?0:h; size_t mylen=me?c-h:h, peerlen=me?h:c-h;
    char*ms=slot(b,me),*ps=slot(b,1-me);
    if(v==1||v==3) nt_copy(ms+peerlo,sb+off+peerlo,peerlen); else memcpy(ms+peerlo,sb+off+peerlo,peerlen);
    if(v==1||v==3) _mm_sfence();
    publish(me);arrive(me);
    if(v==1||v==4) add_nt2((float*)(rb+off+mylo),(float*)(ms+mylo),(float*)(sb+off+mylo),(float*)(ps+mylo),mylen/4);
    else {add((float*)(rb+off+mylo),(float*)(sb+off+mylo),(float*)(ps+mylo),mylen/4);memcpy(ms+mylo,rb+off+mylo,mylen);}
    if(v==1||v==4) _mm_sfence();
    if(v==2) flush(ps+mylo,mylen);
    publish(me);arrive(me);
    memcpy(rb+off+peerlo,ps+peerlo,peerlen);
    if(v==2) flush(ps+peerlo,peerlen);
    round_[me]++; off+=c;}
}
static char *bufs[2][2];
static void *worker(void*arg){int me=(int)(intptr_t)arg;pin(me);uint64_t last=0;
  for(;;){while(cmd[me][0]==last)_mm_pause();last=cmd[me][0];if(last==~0ULL)return NULL;
    int v=variant;size_t n=msg;double t0=now();
    for(int k=0;k<5;k++) allreduce(me,bufs[me][0],bufs[me][1],n,v);
    res[me]=(now()-t0)/5;
    __atomic_store_n(&cmd[me][1],last,__ATOMIC_RELEASE);}
}
static double runv(int v,size_t n){variant=v;msg=n;static uint64_t c=0;c++;
  /* sync round counters so both use same buffers */
  cmd[0][0]=c;cmd[1][0]=c;while(cmd[0][1]!=c||cmd[1][1]!=c)usleep(200);return res[0]>res[1]?res[0]:res[1];}
static volatile uint64_t pp __attribute__((aligned(128)));
static void*pong(void*a){pin(1);for(uint64_t i=1;i<=20000;i++){while(pp!=2*i-1);pp=2*i;}return NULL;}
static double rt(void){pthread_t t;pp=0;pthread_create(&t,NULL,pong,NULL);pin(0);double t0=now();for(uint64_t i=1;i<=20000;i++){pp=2*i-1;while(pp!=2*i);}double r=(now()-t0)/20000*1e9;pthread_join(t,NULL);return r;}
int main(int argc,char**argv){int secs=argc>1?atoi(argv[1]):60; if(argc>2)SLOT=(size_t)atoi(argv[2])<<10; if(argc>3)NBUF=atoi(argv[3]);
  slots=aligned_alloc(4096,SLOT*2*MAXBUF);memset(slots,0,SLOT*2*MAXBUF);
  size_t sizes[3]={2<<20,16<<20,64<<20};
  for(int r=0;r<2;r++)for(int k=0;k<2;k++){bufs[r][k]=(char*)aligned_alloc(4096,(64<<20)+4096)+16;memset(bufs[r][k],1,64<<20);}
  double end=now()+secs;
  while(now()<end){double r=rt();
    pthread_t th[2];
    for(int i=0;i<2;i++)pthread_create(&th[i],NULL,worker,(void*)(intptr_t)i);
    printf("rt %4.0f",r);
    for(int s=0;s<3;s++){printf(" | %2zuM",sizes[s]>>20);for(int v=0;v<5;v++)printf(" v%d %6.0f",v,runv(v,sizes[s])*1e6);}
    printf("\n");fflush(stdout);
    cmd[0][0]=~0ULL;cmd[1][0]=~0ULL;for(int i=0;i<2;i++)pthread_join(th[i],NULL);
    cmd[0][0]=cmd[1][0]=cmd[0][1]=cmd[1][1]=0;
  }
}
