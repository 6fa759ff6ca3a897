// hostkv_rs transfer kernels: gather/scatter between a host KV pool (any of the four HiCache host
// layouts, one or two planes) and layer-first device pools.
//
// One source, two builds:
//   * nvcc -ptx for sm_80 (scripts/gen_ptx.sh); the PTX is committed and embedded in the crate.
//   * g++ as plain C++ under emu_shim.h (build.rs), so CI runs this exact code on the CPU.
// Therefore: no shared memory, no warp shuffles/votes, no __syncthreads(); every lane of a warp
// computes the same task and copies its own disjoint share of the bytes, so running the threads
// one after another (the emulator) gives the same result as running them in lock step.
//
// The parameter block is passed by value (__grid_constant__) and mirrored field for field by
// rust/src/cuda/params.rs; hkv_params_layout() (emulation build) lets a Rust test check that.

#ifndef __CUDACC__
#include "emu_shim.h"
#endif

typedef unsigned long long hkv_u64;
typedef unsigned int hkv_u32;

// Device layer pointers that travel inside the parameter block (2 planes x 128 layers). More than
// that goes through a table in device-visible memory (dev_table). The block stays below the
// 4 KiB kernel-parameter limit of PTX ISA 8.0.
#define HKV_INLINE_PTRS 256
// Launch sequence numbers are recorded in a ring of this many slots; a copy kernel only needs
// its own slot to survive until it starts, i.e. fewer than this many launches in flight.
#define HKV_ABORT_RING 4096
#define HKV_WARP 32
// Vectors each lane loads before it stores any: bytes in flight per warp = 32 * 16 * HKV_UNROLL.
#define HKV_UNROLL 4

#define HKV_LAYER_FIRST 0
#define HKV_PAGE_FIRST 1
#define HKV_PAGE_FIRST_DIRECT 2
#define HKV_PAGE_HEAD 3
#define HKV_PAGE_UNIFIED 4

#define HKV_SIDE_HOST 0
#define HKV_SIDE_DEVICE 1
// A broken page run (value: the raw position, bound: the page size) on the host / device side.
#define HKV_SIDE_HOST_RUN 2
#define HKV_SIDE_DEVICE_RUN 3

// Threads per block of both kernels, and the blocks per SM the copy kernel is compiled to allow
// (__launch_bounds__): 256 threads x 4 blocks caps it at 64 registers per thread, so one copy
// block takes a quarter of an SM's register file and the forward pass's blocks keep running
// beside it (a 1024-thread block at 64 registers would need a whole, empty SM).
#define HKV_BLOCK 256
#define HKV_MIN_BLOCKS_PER_SM 4

// Bad device-resident indices are reported through two records per CUDA context.
//
// HkvDeviceRecord lives in device memory: every atomic of the protocol is a device-scope atomic
// on it (atomics on mapped host memory are not atomic for the host or for other devices). The
// first thread of a launch to find a bad index marks the launch in abort_ring (exchange; the
// copy kernel of that launch then writes nothing) and counts it in `aborted` (one count per
// refused launch, whether or not an earlier report is still unread). If no record is pending
// (`claim` == the host's `ack`), it claims the next generation, writes the details into the
// host-mapped HkvErrorRecord and publishes them (flag = generation) after a system fence; the
// count is raised after that, so a host reading half-way counts every launch exactly once.
//
// HkvErrorRecord is pinned, device-mapped host memory the host reads without synchronising:
// `flag` > `ack` means a published, unreported record; `aborted` mirrors the device count; the
// host writes `ack` = `flag` once it has reported the record, which lets the next one be claimed.
struct HkvErrorRecord {
    hkv_u64 flag;
    hkv_u64 value;
    hkv_u64 bound;
    hkv_u64 side;
    hkv_u64 aborted;
    hkv_u64 ack;
};

struct HkvDeviceRecord {
    hkv_u64 claim;
    hkv_u64 aborted;
    hkv_u64 abort_ring[HKV_ABORT_RING];
};

// How an index array is read (rust/src/index_map.rs): position i reads raw element
// offset + i * stride and maps its value t to floor(t / div) * mul + (t mod div) * rem_mul + add
// (DCP slots, V4 page rows, C4 token rows). The identity is {0, 1, 1, 1, 0, 0}.
struct HkvIndexMap {
    hkv_u64 offset;
    hkv_u64 stride;
    long long div;
    long long mul;
    long long rem_mul;
    long long add;
    // V4 page rows: every read element must start a run of `run` consecutive raw elements that
    // begins on a multiple of `run` (a whole page of token slots; 0: no such rule).
    hkv_u64 run;
};

struct HkvParams {
    // Plane-major device layer bases: plane p, moved layer j at [p * layer_count + j].
    hkv_u64 dev_ptrs[HKV_INLINE_PTRS];
    // Non-zero: the same table in device-visible memory, used instead of dev_ptrs.
    hkv_u64 dev_table;
    // Device-visible base address of each host plane.
    hkv_u64 host_base[2];
    // Bytes of one row of one layer, per plane, and of one contiguous segment of it (the whole
    // row, or one head's share for page_head).
    hkv_u64 item_bytes[2];
    hkv_u64 seg_bytes[2];
    // Bytes from one device row to the next, per plane: the item size, or the stride of a
    // device pool whose layers are strided views (SGLang's unified pools).
    hkv_u64 dev_pitch[2];
    // Device-visible int32/int64 index arrays (host slots, device rows).
    hkv_u64 host_idx;
    hkv_u64 dev_idx;
    hkv_u64 n;
    // Bounds: host rows S and device rows.
    hkv_u64 host_rows;
    hkv_u64 dev_rows;
    // Device-visible HkvErrorRecord* and HkvDeviceRecord* (0: none), and this launch's sequence
    // number (0: no abort slot).
    hkv_u64 err;
    hkv_u64 dev_err;
    hkv_u64 abort_seq;
    // How each index array is read; n counts mapped positions.
    HkvIndexMap host_map;
    HkvIndexMap dev_map;
    hkv_u32 layers;       // L of the host pool
    hkv_u32 layer_begin;  // first host layer moved
    hkv_u32 layer_count;  // layers moved: L for a backup, 1 for a load
    hkv_u32 planes;       // 1 or 2
    hkv_u32 layout;       // HKV_LAYER_FIRST ...
    hkv_u32 to_host;      // 1: backup (device -> host); 0: load (host -> device)
    hkv_u32 page_size;
    hkv_u32 heads;        // segments per item (page_head: heads, page_unified: head groups), else 1
    hkv_u32 host_idx_wide;  // 1: int64, 0: int32
    hkv_u32 dev_idx_wide;
};

// Cache hints. Sources are never written during a transfer, so the read-only (non-coherent) path
// is safe; stores go to L2 only (.cg) since nothing reads the destination back soon.
#ifdef __CUDACC__
#define HKV_LOAD(ptr) __ldg(ptr)
#define HKV_STORE(ptr, v) __stcg((ptr), (v))
#define HKV_PRAGMA_UNROLL _Pragma("unroll")
#endif

template <typename T>
__device__ __forceinline__ T hkv_load(const T* p) {
    return HKV_LOAD(p);
}

template <typename T>
__device__ __forceinline__ void hkv_store(T* p, T v) {
    HKV_STORE(p, v);
}

// Raw element k of an int64 (`wide`) or int32 index array.
__device__ __forceinline__ long long hkv_raw(hkv_u64 base, hkv_u32 wide, hkv_u64 k) {
    return wide ? hkv_load(reinterpret_cast<const long long*>(base) + k)
                : static_cast<long long>(hkv_load(reinterpret_cast<const int*>(base) + k));
}

__device__ __forceinline__ long long hkv_index(hkv_u64 base, hkv_u32 wide, const HkvIndexMap& m,
                                               hkv_u64 i) {
    const long long t = hkv_raw(base, wide, m.offset + i * m.stride);
    if (m.div == 1 && m.mul == 1 && m.add == 0) {
        return t;
    }
    long long q = t / m.div;
    long long r = t - q * m.div;
    if (r < 0) {  // floor division: a negative index stays negative
        r += m.div;
        q -= 1;
    }
    // Saturate far past any bound instead of wrapping (div, mul, rem_mul and add are small).
    const long long limit = 0x3fffffffffffffffLL / m.mul;
    if (q > limit) {
        return 0x7fffffffffffffffLL;
    }
    if (q < -limit) {
        return -0x7fffffffffffffffLL;
    }
    return q * m.mul + r * m.rem_mul + m.add;
}

// Byte offset of (row t, layer l, head h) in one host plane; see docs/design.md "Planes". Rows
// and page sizes fit in 32 bits (the host checks), so the page split is a 32-bit division.
__device__ __forceinline__ hkv_u64 hkv_host_offset(const HkvParams& p, hkv_u32 plane, hkv_u32 t,
                                                   hkv_u32 l, hkv_u32 h) {
    const hkv_u64 item = p.item_bytes[plane];
    const hkv_u64 ld = static_cast<hkv_u64>(p.layers) * item;
    switch (p.layout) {
        case HKV_LAYER_FIRST:
            return (static_cast<hkv_u64>(l) * p.host_rows + t) * item;
        case HKV_PAGE_FIRST:
            return static_cast<hkv_u64>(t) * ld + static_cast<hkv_u64>(l) * item;
        case HKV_PAGE_FIRST_DIRECT: {
            const hkv_u32 page = t / p.page_size;
            const hkv_u32 slot = t - page * p.page_size;
            return static_cast<hkv_u64>(page) * p.page_size * ld +
                   (static_cast<hkv_u64>(l) * p.page_size + slot) * item;
        }
        case HKV_PAGE_UNIFIED: {
            // SGLang 0.5.23's page block: (head group, layer, component, slot) rows of one head
            // group's bytes; the planes (K, V) are the components of one allocation.
            const hkv_u64 seg = p.seg_bytes[plane];
            const hkv_u64 comps = p.planes;
            const hkv_u32 page = t / p.page_size;
            const hkv_u32 slot = t - page * p.page_size;
            return static_cast<hkv_u64>(page) * comps * p.page_size * ld +
                   (((static_cast<hkv_u64>(h) * p.layers + l) * comps + plane) * p.page_size +
                    slot) *
                       seg;
        }
        default: {
            const hkv_u64 seg = p.seg_bytes[plane];
            const hkv_u32 page = t / p.page_size;
            const hkv_u32 slot = t - page * p.page_size;
            return static_cast<hkv_u64>(page) * p.page_size * ld +
                   ((static_cast<hkv_u64>(h) * p.page_size + slot) * p.layers + l) * seg;
        }
    }
}

__device__ __forceinline__ hkv_u64 hkv_dev_layer(const HkvParams& p, hkv_u32 k) {
    if (p.dev_table != 0) {
        return hkv_load(reinterpret_cast<const hkv_u64*>(p.dev_table) + k);
    }
    return p.dev_ptrs[k];
}

// Lane `lane` copies vectors lane, lane+32, ... of V; HKV_UNROLL loads are issued before the
// first store so each lane keeps several transactions in flight (what sets bandwidth over PCIe).
template <typename V>
__device__ __forceinline__ void hkv_copy_vectors(const V* s, V* d, hkv_u32 nvec, hkv_u32 lane) {
    for (hkv_u32 v = lane; v < nvec; v += HKV_WARP * HKV_UNROLL) {
        V r[HKV_UNROLL];
        HKV_PRAGMA_UNROLL
        for (hkv_u32 k = 0; k < HKV_UNROLL; ++k) {
            if (v + k * HKV_WARP < nvec) {
                r[k] = hkv_load(s + v + k * HKV_WARP);
            }
        }
        HKV_PRAGMA_UNROLL
        for (hkv_u32 k = 0; k < HKV_UNROLL; ++k) {
            if (v + k * HKV_WARP < nvec) {
                hkv_store(d + v + k * HKV_WARP, r[k]);
            }
        }
    }
}

// Copies exactly `len` bytes (< 2^32, checked on the host) with the widest vector both addresses
// allow; the bytes after the last whole vector are copied one by one, so no item size loses a
// tail.
__device__ __forceinline__ void hkv_copy_segment(const unsigned char* src, unsigned char* dst,
                                                 hkv_u32 len, hkv_u32 lane) {
    const hkv_u32 align =
        static_cast<hkv_u32>(reinterpret_cast<hkv_u64>(src) | reinterpret_cast<hkv_u64>(dst));
    hkv_u32 done = 0;
    if ((align & 15u) == 0) {
        done = len & ~15u;
        hkv_copy_vectors(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst),
                         len >> 4, lane);
    } else if ((align & 7u) == 0) {
        done = len & ~7u;
        hkv_copy_vectors(reinterpret_cast<const uint2*>(src), reinterpret_cast<uint2*>(dst),
                         len >> 3, lane);
    } else if ((align & 3u) == 0) {
        done = len & ~3u;
        hkv_copy_vectors(reinterpret_cast<const unsigned int*>(src),
                         reinterpret_cast<unsigned int*>(dst), len >> 2, lane);
    } else if ((align & 1u) == 0) {
        // bf16/fp16 rows at an odd multiple of 2 bytes (a page_head head of 1 x 2-byte dim,
        // a 66-byte item): half the transactions of a byte loop.
        done = len & ~1u;
        hkv_copy_vectors(reinterpret_cast<const unsigned short*>(src),
                         reinterpret_cast<unsigned short*>(dst), len >> 1, lane);
    }
    for (hkv_u32 b = done + lane; b < len; b += HKV_WARP) {
        hkv_store(dst + b, hkv_load(src + b));
    }
}

__device__ __forceinline__ void hkv_record_bad_index(const HkvParams& p, long long value,
                                                     hkv_u64 bound, hkv_u64 side) {
    if (p.err == 0 || p.dev_err == 0) {
        return;
    }
    HkvDeviceRecord* d = reinterpret_cast<HkvDeviceRecord*>(p.dev_err);
    volatile HkvErrorRecord* h = reinterpret_cast<volatile HkvErrorRecord*>(p.err);
    if (p.abort_seq != 0 &&
        atomicExch(&d->abort_ring[p.abort_seq % HKV_ABORT_RING], p.abort_seq) == p.abort_seq) {
        return;  // this launch is already marked and counted
    }
    const hkv_u64 gen = h->ack;
    if (atomicCAS(&d->claim, gen, gen + 1ULL) == gen) {
        h->value = static_cast<hkv_u64>(value);
        h->bound = bound;
        h->side = side;
        // The fields must reach host memory before the host can see the record as published.
        __threadfence_system();
        h->flag = gen + 1ULL;
    }
    // Counted after publishing, so a host that reads the record counts this launch once.
    atomicAdd(&d->aborted, 1ULL);
    // Mirror the count to the host; re-read until no other launch moved it meanwhile, so the
    // host's copy never ends below the device count.
    hkv_u64 seen;
    do {
        seen = atomicAdd(&d->aborted, 0ULL);
        h->aborted = seen;
        __threadfence_system();
    } while (atomicAdd(&d->aborted, 0ULL) != seen);
}

__device__ __forceinline__ bool hkv_aborted(const HkvParams& p) {
    if (p.dev_err == 0 || p.abort_seq == 0) {
        return false;
    }
    const volatile hkv_u64* ring = reinterpret_cast<const HkvDeviceRecord*>(p.dev_err)->abort_ring;
    return ring[p.abort_seq % HKV_ABORT_RING] == p.abort_seq;
}

// Position i of a page-run map: the raw elements it stands for are one whole page of slots,
// `first, first + 1, ...` with `first` on a page boundary (the planner's rule for host-resident
// indices, which the map's first-element read would otherwise not see).
__device__ __forceinline__ void hkv_check_run(const HkvParams& p, hkv_u64 base, hkv_u32 wide,
                                              const HkvIndexMap& m, hkv_u64 i, hkv_u64 side) {
    const hkv_u64 k = m.offset + i * m.stride;
    const long long first = hkv_raw(base, wide, k);
    const long long run = static_cast<long long>(m.run);
    if (first % run != 0) {
        hkv_record_bad_index(p, static_cast<long long>(k), m.run, side);
        return;
    }
    for (hkv_u64 j = 1; j < m.run; ++j) {
        if (hkv_raw(base, wide, k + j) != first + static_cast<long long>(j)) {
            hkv_record_bad_index(p, static_cast<long long>(k + j), m.run, side);
            return;
        }
    }
}

// Pass 1 for device-resident indices: checks every index before the copy kernel (same stream)
// runs, so one bad index means nothing of the transfer is written.
extern "C" __global__ void __launch_bounds__(HKV_BLOCK, HKV_MIN_BLOCKS_PER_SM)
    hkv_check_indices(const __grid_constant__ HkvParams p) {
    const hkv_u64 stride = static_cast<hkv_u64>(gridDim.x) * blockDim.x;
    for (hkv_u64 i = static_cast<hkv_u64>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n;
         i += stride) {
        const long long h = hkv_index(p.host_idx, p.host_idx_wide, p.host_map, i);
        if (static_cast<hkv_u64>(h) >= p.host_rows) {
            hkv_record_bad_index(p, h, p.host_rows, HKV_SIDE_HOST);
        }
        const long long d = hkv_index(p.dev_idx, p.dev_idx_wide, p.dev_map, i);
        if (static_cast<hkv_u64>(d) >= p.dev_rows) {
            hkv_record_bad_index(p, d, p.dev_rows, HKV_SIDE_DEVICE);
        }
        if (p.host_map.run > 1) {
            hkv_check_run(p, p.host_idx, p.host_idx_wide, p.host_map, i, HKV_SIDE_HOST_RUN);
        }
        if (p.dev_map.run > 1) {
            hkv_check_run(p, p.dev_idx, p.dev_idx_wide, p.dev_map, i, HKV_SIDE_DEVICE_RUN);
        }
    }
}

// Pass 2: one warp per task (index position i, plane, moved layer j, head segment h); tasks are
// dealt out round-robin over all warps of the grid, so any grid size (block quota) moves the same
// bytes. A row of several segments (page_head's heads, page_unified's head groups) is several
// tasks, so its segments move in parallel rather than one load-then-store after another.
// The task counter is kept as (i, r) and advanced without 64-bit division (registers are capped
// at 64 per thread by the launch bounds).
extern "C" __global__ void __launch_bounds__(HKV_BLOCK, HKV_MIN_BLOCKS_PER_SM)
    hkv_transfer(const __grid_constant__ HkvParams p) {
    if (hkv_aborted(p)) {
        return;
    }
    const hkv_u32 lane = threadIdx.x % HKV_WARP;
    const hkv_u32 warp = (blockIdx.x * blockDim.x + threadIdx.x) / HKV_WARP;
    const hkv_u32 nwarps = gridDim.x * blockDim.x / HKV_WARP;
    const hkv_u32 per_item = p.planes * p.layer_count * p.heads;
    const hkv_u32 step_i = nwarps / per_item;
    const hkv_u32 step_r = nwarps - step_i * per_item;
    hkv_u64 i = warp / per_item;
    hkv_u32 r = warp - static_cast<hkv_u32>(i) * per_item;
    for (; i < p.n; i += step_i) {
        const long long hs = hkv_index(p.host_idx, p.host_idx_wide, p.host_map, i);
        const long long ds = hkv_index(p.dev_idx, p.dev_idx_wide, p.dev_map, i);
        // Host-resident indices were checked on the host and device-resident ones by pass 1;
        // this re-check is what makes a write outside a pool impossible whatever happened.
        if (static_cast<hkv_u64>(hs) >= p.host_rows) {
            if (lane == 0) {
                hkv_record_bad_index(p, hs, p.host_rows, HKV_SIDE_HOST);
            }
        } else if (static_cast<hkv_u64>(ds) >= p.dev_rows) {
            if (lane == 0) {
                hkv_record_bad_index(p, ds, p.dev_rows, HKV_SIDE_DEVICE);
            }
        } else {
            // r = (plane * layer_count + j) * heads + h
            const hkv_u32 pj = p.heads == 1 ? r : r / p.heads;
            const hkv_u32 h = r - pj * p.heads;
            const hkv_u32 plane = pj >= p.layer_count ? 1u : 0u;
            const hkv_u32 j = pj - plane * p.layer_count;
            const hkv_u32 seg = static_cast<hkv_u32>(p.seg_bytes[plane]);
            unsigned char* hp = reinterpret_cast<unsigned char*>(p.host_base[plane]) +
                                hkv_host_offset(p, plane, static_cast<hkv_u32>(hs),
                                                p.layer_begin + j, h);
            unsigned char* dp = reinterpret_cast<unsigned char*>(hkv_dev_layer(p, pj)) +
                                static_cast<hkv_u64>(ds) * p.dev_pitch[plane] + h * seg;
            hkv_copy_segment(p.to_host ? dp : hp, p.to_host ? hp : dp, seg, lane);
        }
        r += step_r;
        if (r >= per_item) {
            r -= per_item;
            ++i;
        }
    }
}
