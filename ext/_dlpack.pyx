# cython: language_level=3
"""A small native DLPack consumer: the tensor behind a ``__dlpack__`` capsule, without CuPy.

Struct layouts are those of dlpack.h (DLPack 0.8 and 1.x, which keep DLTensor unchanged):

* ``DLManagedTensor {DLTensor dl_tensor; void *manager_ctx; void (*deleter)(DLManagedTensor*)}``
  in a capsule named ``"dltensor"``;
* ``DLManagedTensorVersioned {DLPackVersion version; void *manager_ctx; void (*deleter)(...);
  uint64_t flags; DLTensor dl_tensor}`` in a capsule named ``"dltensor_versioned"`` (DLPack
  >= 1.0; flags bit 0: read-only).

Consuming a capsule renames it ``"used_dltensor"`` / ``"used_dltensor_versioned"``, so that the
capsule's own destructor no longer frees the tensor; the :class:`DLPackBuffer` that took it calls
the producer's deleter exactly once, when it is released.
"""
from cpython.pycapsule cimport (PyCapsule_CheckExact, PyCapsule_GetName, PyCapsule_GetPointer, PyCapsule_IsValid,
                                PyCapsule_SetName)
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t

cdef extern from *:
    """
    typedef struct { int32_t device_type; int32_t device_id; } al_DLDevice;
    typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } al_DLDataType;
    typedef struct {
      void *data; al_DLDevice device; int32_t ndim; al_DLDataType dtype;
      int64_t *shape; int64_t *strides; uint64_t byte_offset;
    } al_DLTensor;
    typedef struct al_DLManagedTensor {
      al_DLTensor dl_tensor; void *manager_ctx; void (*deleter)(struct al_DLManagedTensor *);
    } al_DLManagedTensor;
    typedef struct { uint32_t major; uint32_t minor; } al_DLPackVersion;
    typedef struct al_DLManagedTensorVersioned {
      al_DLPackVersion version; void *manager_ctx;
      void (*deleter)(struct al_DLManagedTensorVersioned *);
      uint64_t flags; al_DLTensor dl_tensor;
    } al_DLManagedTensorVersioned;
    """
    ctypedef struct al_DLDevice:
        int32_t device_type
        int32_t device_id
    ctypedef struct al_DLDataType:
        uint8_t code
        uint8_t bits
        uint16_t lanes
    ctypedef struct al_DLTensor:
        void* data
        al_DLDevice device
        int32_t ndim
        al_DLDataType dtype
        int64_t* shape
        int64_t* strides
        uint64_t byte_offset
    ctypedef struct al_DLManagedTensor:
        al_DLTensor dl_tensor
        void* manager_ctx
        void (*deleter)(al_DLManagedTensor*) noexcept
    ctypedef struct al_DLPackVersion:
        uint32_t major
        uint32_t minor
    ctypedef struct al_DLManagedTensorVersioned:
        al_DLPackVersion version
        void* manager_ctx
        void (*deleter)(al_DLManagedTensorVersioned*) noexcept
        uint64_t flags
        al_DLTensor dl_tensor

MAJOR_VERSION = 1                # the DLPack major version this reader understands
MINOR_VERSION = 0
FLAG_READ_ONLY = 1               # DLPACK_FLAG_BITMASK_READ_ONLY
# DLDeviceType
CPU, CUDA, CUDA_HOST, CUDA_MANAGED = 1, 2, 3, 13
# DLDataTypeCode
INT, UINT, FLOAT, OPAQUE_HANDLE, BFLOAT, COMPLEX, BOOL = 0, 1, 2, 3, 4, 5, 6

_CODE_NAMES = {INT: "int", UINT: "uint", FLOAT: "float", OPAQUE_HANDLE: "opaque handle",
               BFLOAT: "bfloat", COMPLEX: "complex", BOOL: "bool"}


cdef class DLPackBuffer:
    """The tensor of a consumed DLPack capsule. Holds it until this object is released, then
    calls the producer's deleter (once).

    Attributes:
        ptr: address of the first element (``data + byte_offset``).
        shape: tuple of ints. strides: tuple in elements, or None (C order, as DLPack says).
        code, bits, lanes: the DLDataType. device_type, device_id: the DLDevice.
        readonly: the versioned capsule's read-only flag (unversioned capsules: False).
        version: (major, minor) of a versioned capsule, None for an unversioned one.
    """
    cdef al_DLManagedTensor* legacy
    cdef al_DLManagedTensorVersioned* versioned
    cdef readonly object ptr, shape, strides, code, bits, lanes, device_type, device_id
    cdef readonly object readonly, version

    def __dealloc__(self):
        if self.legacy != NULL:
            if self.legacy.deleter != NULL:
                self.legacy.deleter(self.legacy)
            self.legacy = NULL
        if self.versioned != NULL:
            if self.versioned.deleter != NULL:
                self.versioned.deleter(self.versioned)
            self.versioned = NULL

    cdef void _read(self, al_DLTensor* t):
        cdef int i
        self.ptr = <uintptr_t>t.data + t.byte_offset
        self.shape = tuple(t.shape[i] for i in range(t.ndim))
        self.strides = None if t.strides == NULL else tuple(t.strides[i] for i in range(t.ndim))
        self.code, self.bits, self.lanes = t.dtype.code, t.dtype.bits, t.dtype.lanes
        self.device_type, self.device_id = t.device.device_type, t.device.device_id

    @property
    def dtype_name(self):
        """The DLDataType as a numpy-style name ("float32", "bfloat16", ...), or a description
        such as "bool8" or "float32x4" for types without one."""
        name = _CODE_NAMES.get(self.code, f"code {self.code} ")
        return f"{name}{self.bits}" + (f"x{self.lanes}" if self.lanes != 1 else "")

    def __repr__(self):
        return (f"<DLPackBuffer {self.dtype_name} shape={self.shape} strides={self.strides} "
                f"device=({self.device_type}, {self.device_id}) ptr=0x{self.ptr:x}>")


def from_capsule(capsule):
    """Consume a DLPack capsule (``"dltensor"`` or ``"dltensor_versioned"``). Raises
    BufferError for a used capsule or an unsupported major version (which is left unconsumed,
    so its own destructor frees it), TypeError for anything else."""
    cdef DLPackBuffer b = DLPackBuffer.__new__(DLPackBuffer)
    cdef al_DLManagedTensorVersioned* v
    cdef const char* name
    if PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        v = <al_DLManagedTensorVersioned*>PyCapsule_GetPointer(capsule, b"dltensor_versioned")
        if v.version.major > MAJOR_VERSION:
            raise BufferError(f"DLPack {v.version.major}.{v.version.minor} tensor: this reader "
                              f"supports major version {MAJOR_VERSION}")
        PyCapsule_SetName(capsule, b"used_dltensor_versioned")
        b.versioned = v
        b._read(&v.dl_tensor)
        b.readonly = bool(v.flags & FLAG_READ_ONLY)
        b.version = (v.version.major, v.version.minor)
        return b
    if PyCapsule_IsValid(capsule, b"dltensor"):
        b.legacy = <al_DLManagedTensor*>PyCapsule_GetPointer(capsule, b"dltensor")
        PyCapsule_SetName(capsule, b"used_dltensor")
        b._read(&b.legacy.dl_tensor)
        b.readonly = False
        b.version = None
        return b
    if PyCapsule_CheckExact(capsule):
        name = PyCapsule_GetName(capsule)
        if name != NULL and (<bytes>name).startswith(b"used_dltensor"):
            raise BufferError("the DLPack capsule has already been consumed")
    raise TypeError(f"expected a DLPack capsule, got {type(capsule).__name__}")


def read(obj, stream=None):
    """Call ``obj.__dlpack__`` and consume the capsule. `stream` is passed through (DLPack:
    the consumer's stream for CUDA tensors, None for others). Asks for a versioned capsule
    (``max_version=(1, 0)``) and falls back to the unversioned call for producers that do not
    take ``max_version``."""
    try:
        capsule = obj.__dlpack__(stream=stream, max_version=(MAJOR_VERSION, MINOR_VERSION))
    except TypeError:
        capsule = obj.__dlpack__(stream=stream)
    return from_capsule(capsule)
