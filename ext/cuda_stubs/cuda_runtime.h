/* Stub of <cuda_runtime.h>: just what nccl.h needs to compile on a machine without CUDA.
 * aluminum_py never links CUDA; it calls NCCL through dlopen and passes streams as handles. */
#ifndef AL_CUDA_RUNTIME_STUB_H
#define AL_CUDA_RUNTIME_STUB_H
#include <stddef.h>     /* size_t, NULL: the real header brings them, nccl.h relies on it */
#ifndef CUDART_VERSION
#define CUDART_VERSION 12000
#endif
typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
#endif
