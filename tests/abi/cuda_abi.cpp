// Compile-time check of the CUDA driver ABI the crate relies on, against NVIDIA's own cuda.h and
// cudaTypedefs.h (the nvidia-cuda-runtime 13.x wheel). Compiled with -fsyntax-only by
// scripts/check_cuda_abi.sh: a wrong size, offset, enum value or function type fails the build.
//
// Each `Ours*` type below spells, in C, a signature the crate declares by hand in Rust
// (rust/src/cuda/direct.rs, driver.rs, probe.rs); each constant is one the crate hard-codes.
// The Rust side of the same numbers is asserted by `abi_constants_match_the_c_probe` in
// rust/src/cuda/driver.rs, so a change on either side is caught.

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

// Two function pointer types are call-compatible here when they take the same number of
// arguments and each argument and the result have the same size and pointer-ness (the x86-64
// SysV ABI passes them the same way).
template <class T>
constexpr bool same_class(std::size_t size, bool ptr) {
    return sizeof(T) == size && std::is_pointer<T>::value == ptr;
}
template <class F, class G>
struct abi_same;
template <class R1, class... A1, class R2, class... A2>
struct abi_same<R1 (*)(A1...), R2 (*)(A2...)> {
    static constexpr bool value = sizeof...(A1) == sizeof...(A2) && sizeof(R1) == sizeof(R2) &&
                                  ((same_class<A2>(sizeof(A1), std::is_pointer<A1>::value)) && ...);
};
#define SAME_ABI(ours, theirs) \
    static_assert(abi_same<ours, theirs>::value, #ours " does not match " #theirs)

// direct.rs: BatchV1 (CUDA 12.8/12.9 drivers) and BatchV2 (13.x).
using OursBatchV1 = int (*)(uint64_t*, uint64_t*, size_t*, size_t, CUmemcpyAttributes*, size_t*,
                            size_t, size_t*, void*);
using OursBatchV2 = int (*)(uint64_t*, uint64_t*, size_t*, size_t, CUmemcpyAttributes*, size_t*,
                            size_t, void*);
SAME_ABI(OursBatchV1, PFN_cuMemcpyBatchAsync_v12080);
SAME_ABI(OursBatchV2, PFN_cuMemcpyBatchAsync_v13000);

// probe.rs: Init, CtxGetId; driver.rs: RawErrFn, ExchangeCaptureMode.
using OursInit = int (*)(unsigned int);
using OursCtxGetId = int (*)(void*, uint64_t*);
using OursErr = int (*)(int, const char**);
using OursExchangeCaptureMode = int (*)(int*);
SAME_ABI(OursInit, PFN_cuInit_v2000);
SAME_ABI(OursCtxGetId, PFN_cuCtxGetId_v12000);
SAME_ABI(OursErr, PFN_cuGetErrorString_v6000);
SAME_ABI(OursErr, PFN_cuGetErrorName_v6000);
SAME_ABI(OursExchangeCaptureMode, PFN_cuThreadExchangeStreamCaptureMode_v10010);

// The kernels are loaded and launched through cudarc's generated bindings (module.rs, launch.rs),
// which spell these types exactly; NVIDIA's must be the same types, not only call-compatible.
#define SAME_TYPE(ours, theirs) \
    static_assert(std::is_same<ours, theirs>::value, #ours " is not " #theirs)
using OursLibraryLoadData = CUresult (*)(CUlibrary*, const void*, CUjit_option*, void**,
                                         unsigned int, CUlibraryOption*, void**, unsigned int);
using OursLibraryGetKernel = CUresult (*)(CUkernel*, CUlibrary, const char*);
using OursKernelGetFunction = CUresult (*)(CUfunction*, CUkernel);
using OursLaunchKernel = CUresult (*)(CUfunction, unsigned int, unsigned int, unsigned int,
                                      unsigned int, unsigned int, unsigned int, unsigned int,
                                      CUstream, void**, void**);
SAME_TYPE(OursLibraryLoadData, PFN_cuLibraryLoadData_v12000);
SAME_TYPE(OursLibraryGetKernel, PFN_cuLibraryGetKernel_v12000);
SAME_TYPE(OursKernelGetFunction, PFN_cuKernelGetFunction_v12000);
SAME_TYPE(OursLaunchKernel, PFN_cuLaunchKernel_v4000);

// A CUkernel is launched cast to CUfunction: the handle types must be pointers of one size.
static_assert(sizeof(CUkernel) == sizeof(CUfunction) && sizeof(CUlibrary) == sizeof(void*), "");
static_assert(sizeof(CUresult) == sizeof(int) && sizeof(CUstreamCaptureMode) == sizeof(int), "");
static_assert(sizeof(CUdeviceptr) == 8 && sizeof(CUstream) == sizeof(void*), "");

// The 24-byte copy-attribute struct the batched copies take.
static_assert(sizeof(CUmemcpyAttributes) == 24, "CUmemcpyAttributes size");
static_assert(offsetof(CUmemcpyAttributes, srcAccessOrder) == 0, "");
static_assert(offsetof(CUmemcpyAttributes, srcLocHint) == 4, "");
static_assert(offsetof(CUmemcpyAttributes, dstLocHint) == 12, "");
static_assert(offsetof(CUmemcpyAttributes, flags) == 20, "");
static_assert(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM == 1, "");
static_assert(CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE == 1, "");

// Constants the crate hard-codes (direct.rs, driver.rs, mod.rs, register.rs).
static_assert(CUDA_ERROR_NOT_SUPPORTED == 801, "");
static_assert(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED == 900, "");
static_assert(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT == 906, "");
static_assert(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED == 712, "");
static_assert(CU_STREAM_CAPTURE_MODE_GLOBAL == 0 && CU_STREAM_CAPTURE_MODE_RELAXED == 2, "");
static_assert(CU_STREAM_CAPTURE_STATUS_NONE == 0, "");
static_assert(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL == 9, "");
static_assert((CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP) == 3, "");
static_assert(CU_EVENT_DISABLE_TIMING == 2, "");
static_assert(CU_STREAM_NON_BLOCKING == 1, "");
// module.rs: the codes after which a lazy-load failure is explained by an eager compile's log.
static_assert(CUDA_ERROR_INVALID_IMAGE == 200 && CUDA_ERROR_NO_BINARY_FOR_GPU == 209 &&
                  CUDA_ERROR_INVALID_PTX == 218 && CUDA_ERROR_JIT_COMPILER_NOT_FOUND == 221 &&
                  CUDA_ERROR_UNSUPPORTED_PTX_VERSION == 222,
              "");
