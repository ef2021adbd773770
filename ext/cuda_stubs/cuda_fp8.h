/* Stub of <cuda_fp8.h> (see cuda_runtime.h): NCCL 2.24-2.27's nccl.h includes it whenever
 * CUDART_VERSION >= 11080 (2.28 and later only from C++); nothing of it is used here. */
#ifndef AL_CUDA_FP8_STUB_H
#define AL_CUDA_FP8_STUB_H
#endif
