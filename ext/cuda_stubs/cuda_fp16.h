/* Stub of <cuda_fp16.h> (see cuda_runtime.h). */
