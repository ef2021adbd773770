/* Stub of <cuda_bf16.h> (see cuda_runtime.h). */
