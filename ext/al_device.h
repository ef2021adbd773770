/* The device interface the host-transfer state machine is written against, and its two
 * implementations.  All functions are callable without the GIL.
 *
 * One file per concept, each including the one it builds on:
 *   device/interface.h  the interface (al_device: semantics as CUDA's) and the pinned pool
 *   device/cpu.h        CPU: streams are worker threads executing queued commands in order
 *                       (the state machine under real MPI ranks without a GPU), and the
 *                       strict device that synchronizes and serializes as CUDA does
 *   device/cuda.h       CUDA: the driver API through dlopen
 */
#ifndef AL_DEVICE_H
#define AL_DEVICE_H

#include "device/interface.h"
#include "device/cpu.h"
#include "device/cuda.h"

#endif  /* AL_DEVICE_H */
