// CPU emulation of the CUDA features hostkv_transfer.cu uses, so the same kernel source compiles
// with a plain C++ compiler (build.rs) and runs in CI without a GPU.
//
// The emulator (emu_runner.cpp) runs every thread of every block one after another on the
// calling OS thread. That is equivalent to the GPU only because the kernels never synchronise or
// exchange data between threads; the shim deliberately offers nothing that would (no
// __syncthreads, no shuffles, no shared memory), so a kernel that started relying on it would
// fail to compile here.
#pragma once

#include <cstddef>
#include <cstring>

struct dim3 {
    unsigned int x, y, z;
};

// Thread-local: several Rust test threads may run emulated grids at the same time.
static thread_local dim3 threadIdx;
static thread_local dim3 blockIdx;
static thread_local dim3 blockDim;
static thread_local dim3 gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __grid_constant__
#define __launch_bounds__(...)

struct uint2 {
    unsigned int x, y;
};
struct uint4 {
    unsigned int x, y, z, w;
};

// Loads and stores go through memcpy: the kernel casts byte pointers to vector types, which is
// fine for the GPU but would be an aliasing/alignment violation for a C++ compiler.
template <typename T>
inline T hkv_emu_load(const T* p) {
    T v;
    std::memcpy(&v, static_cast<const void*>(p), sizeof(T));
    return v;
}

template <typename T>
inline void hkv_emu_store(T* p, T v) {
    std::memcpy(static_cast<void*>(p), &v, sizeof(T));
}

// A includer may define its own (the stand-in driver checks every address a kernel touches).
#ifndef HKV_LOAD
#define HKV_LOAD(ptr) hkv_emu_load(ptr)
#endif
#ifndef HKV_STORE
#define HKV_STORE(ptr, v) hkv_emu_store((ptr), (v))
#endif
#define HKV_PRAGMA_UNROLL

inline unsigned long long atomicCAS(unsigned long long* addr, unsigned long long compare,
                                    unsigned long long val) {
    __atomic_compare_exchange_n(addr, &compare, val, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;
}

inline unsigned long long atomicExch(unsigned long long* addr, unsigned long long val) {
    return __atomic_exchange_n(addr, val, __ATOMIC_SEQ_CST);
}

inline unsigned long long atomicAdd(unsigned long long* addr, unsigned long long val) {
    return __atomic_fetch_add(addr, val, __ATOMIC_SEQ_CST);
}

inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
