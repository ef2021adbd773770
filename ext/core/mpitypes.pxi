# MPI datatypes and ops for our dtype codes

cdef MPI_Datatype g_types[16]
cdef MPI_Op g_mpi_ops[16]
cdef MPI_Op g_half_ops[2][4]      # user ops for float16 / bfloat16: SUM, PROD, MIN, MAX
cdef int g_mpi_ready = 0

cdef void uop_f16_sum(void* i, void* io, int* n, MPI_Datatype* t) noexcept nogil:
    al_reduce(AL_FLOAT16, AL_SUM, io, io, i, <size_t>n[0])
cdef void uop_f16_prod(void* i, void* io, int* n, MPI_Datatype* t) noexcept nogil:
    al_reduce(AL_FLOAT16, AL_PROD, io, io, i, <size_t>n[0])
cdef void uop_f16_min(void* i, void* io, int* n, MPI_Datatype* t) noexcept nogil:
    al_reduce(AL_FLOAT16, AL_MIN, io, io, i, <size_t>n[0])
cdef void uop_f16_max(void* i, void* io, int* n, MPI_Datatype* t) noexcept nogil:
    al_reduce(AL_FLOAT16, AL_MAX, io, io, i, <size_t>n[0])
cdef void uop_bf16_sum(void* i, void* io, int* n, MPI_Datatype* t) noexcept nogil:
    al_reduce(AL_BFLOAT16, AL_SUM, io, io, i, <size_t>n[0])
cdef void uop_bf16_prod(void* i, void* io, int* n, MPI_Datatype* t) noexcept nogil:
    al_reduce(AL_BFLOAT16, AL_PROD, io, io, i, <size_t>n[0])
cdef void uop_bf16_min(void* i, void* io, int* n, MPI_Datatype* t) noexcept nogil:
    al_reduce(AL_BFLOAT16, AL_MIN, io, io, i, <size_t>n[0])
cdef void uop_bf16_max(void* i, void* io, int* n, MPI_Datatype* t) noexcept nogil:
    al_reduce(AL_BFLOAT16, AL_MAX, io, io, i, <size_t>n[0])

cdef int mpi_tables_init() except -1:
    global g_mpi_ready
    if g_mpi_ready:
        return 0
    g_types[AL_INT8] = mpi.MPI_INT8_T
    g_types[AL_INT16] = mpi.MPI_INT16_T
    g_types[AL_INT32] = mpi.MPI_INT32_T
    g_types[AL_INT64] = mpi.MPI_INT64_T
    g_types[AL_UINT8] = mpi.MPI_UINT8_T
    g_types[AL_UINT16] = mpi.MPI_UINT16_T
    g_types[AL_UINT32] = mpi.MPI_UINT32_T
    g_types[AL_UINT64] = mpi.MPI_UINT64_T
    g_types[AL_FLOAT16] = mpi.MPI_UINT16_T     # float16: moved as 16-bit words, reduced by our user ops
    g_types[AL_BFLOAT16] = mpi.MPI_UINT16_T     # bfloat16: likewise
    g_types[AL_FLOAT32] = mpi.MPI_FLOAT
    g_types[AL_FLOAT64] = mpi.MPI_DOUBLE
    g_types[AL_COMPLEX64] = mpi.MPI_C_FLOAT_COMPLEX
    g_types[AL_COMPLEX128] = mpi.MPI_C_DOUBLE_COMPLEX
    g_mpi_ops[AL_SUM] = mpi.MPI_SUM
    g_mpi_ops[AL_PROD] = mpi.MPI_PROD
    g_mpi_ops[AL_MIN] = mpi.MPI_MIN
    g_mpi_ops[AL_MAX] = mpi.MPI_MAX
    g_mpi_ops[AL_LAND] = mpi.MPI_LAND
    g_mpi_ops[AL_LOR] = mpi.MPI_LOR
    g_mpi_ops[AL_LXOR] = mpi.MPI_LXOR
    g_mpi_ops[AL_BAND] = mpi.MPI_BAND
    g_mpi_ops[AL_BOR] = mpi.MPI_BOR
    g_mpi_ops[AL_BXOR] = mpi.MPI_BXOR
    g_mpi_ops[AL_AVG] = mpi.MPI_SUM       # AVG: SUM, then divide
    mpi.MPI_Op_create(uop_f16_sum, 1, &g_half_ops[0][0])
    mpi.MPI_Op_create(uop_f16_prod, 1, &g_half_ops[0][1])
    mpi.MPI_Op_create(uop_f16_min, 1, &g_half_ops[0][2])
    mpi.MPI_Op_create(uop_f16_max, 1, &g_half_ops[0][3])
    mpi.MPI_Op_create(uop_bf16_sum, 1, &g_half_ops[1][0])
    mpi.MPI_Op_create(uop_bf16_prod, 1, &g_half_ops[1][1])
    mpi.MPI_Op_create(uop_bf16_min, 1, &g_half_ops[1][2])
    mpi.MPI_Op_create(uop_bf16_max, 1, &g_half_ops[1][3])
    g_mpi_ready = 1
    return 0

cdef MPI_Op mpi_op_for(int dtype, int rop) noexcept:
    cdef int r = AL_SUM if rop == AL_AVG else rop
    if dtype == AL_FLOAT16 or dtype == AL_BFLOAT16:
        return g_half_ops[dtype - AL_FLOAT16][r]
    return g_mpi_ops[r]
