// Emulation entry points for the Rust crate (build.rs compiles this file; never used on a GPU).
#include "emu_shim.h"
#include "hostkv_transfer.cu"

typedef void (*hkv_kernel_fn)(const HkvParams);

namespace {

void run_grid(hkv_kernel_fn kernel, const HkvParams& p, unsigned int grid, unsigned int block) {
    gridDim = dim3{grid, 1, 1};
    blockDim = dim3{block, 1, 1};
    for (unsigned int b = 0; b < grid; ++b) {
        blockIdx = dim3{b, 0, 0};
        for (unsigned int t = 0; t < block; ++t) {
            threadIdx = dim3{t, 0, 0};
            kernel(p);
        }
    }
}

}  // namespace

extern "C" {

// kernel: 0 = hkv_check_indices, 1 = hkv_transfer. Returns 0, or -1 for an unknown kernel id.
int hkv_emu_launch(int kernel, const HkvParams* params, unsigned int grid, unsigned int block) {
    switch (kernel) {
        case 0:
            run_grid(hkv_check_indices, *params, grid, block);
            return 0;
        case 1:
            run_grid(hkv_transfer, *params, grid, block);
            return 0;
        default:
            return -1;
    }
}

// sizeof and field offsets, so a Rust test can prove its mirror struct has the same layout.
void hkv_params_layout(unsigned long long* out, unsigned int cap) {
    const unsigned long long v[] = {
        sizeof(HkvParams),
        offsetof(HkvParams, dev_ptrs),
        offsetof(HkvParams, dev_table),
        offsetof(HkvParams, host_base),
        offsetof(HkvParams, item_bytes),
        offsetof(HkvParams, seg_bytes),
        offsetof(HkvParams, dev_pitch),
        offsetof(HkvParams, host_idx),
        offsetof(HkvParams, dev_idx),
        offsetof(HkvParams, n),
        offsetof(HkvParams, host_rows),
        offsetof(HkvParams, dev_rows),
        offsetof(HkvParams, err),
        offsetof(HkvParams, dev_err),
        offsetof(HkvParams, abort_seq),
        offsetof(HkvParams, host_map),
        offsetof(HkvParams, dev_map),
        sizeof(HkvIndexMap),
        offsetof(HkvParams, layers),
        offsetof(HkvParams, layer_begin),
        offsetof(HkvParams, layer_count),
        offsetof(HkvParams, planes),
        offsetof(HkvParams, layout),
        offsetof(HkvParams, to_host),
        offsetof(HkvParams, page_size),
        offsetof(HkvParams, heads),
        offsetof(HkvParams, host_idx_wide),
        offsetof(HkvParams, dev_idx_wide),
        sizeof(HkvErrorRecord),
        sizeof(HkvDeviceRecord),
        offsetof(HkvErrorRecord, aborted),
        offsetof(HkvErrorRecord, ack),
        offsetof(HkvDeviceRecord, abort_ring),
        HKV_INLINE_PTRS,
        HKV_ABORT_RING,
        HKV_BLOCK,
    };
    const unsigned int n = sizeof(v) / sizeof(v[0]);
    for (unsigned int i = 0; i < n && i < cap; ++i) {
        out[i] = v[i];
    }
}

}  // extern "C"
