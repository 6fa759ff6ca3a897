// A stand-in libcuda.so for CPU-only tests of hostkv_rs's CUDA driver code (tests/core/test_cuda_driver.py).
//
// It implements the driver entry points rust/src/cuda calls, with the rules of the real driver
// that our code depends on, and nothing else:
//   * a per-thread context stack (cuCtxSetCurrent/Push/Pop) and primary contexts per device, with
//     a generation that cuDevicePrimaryCtxReset bumps (function handles of an older generation are
//     stale; cuCtxGetId changes); calls that need a current context fail without one, and a
//     primary context made active for the first time is counted (mock_ctx_created);
//   * work is asynchronous: launches and copies are queued per stream and run only when the
//     stream, an event recorded on it, or the context is synchronised (or the test drains them;
//     MOCK_PROGRESS_ON_QUERY=1 also lets cuEventQuery advance a stream up to the event, as a GPU
//     gets there by itself), so a host buffer reused before the queued work ran is caught as
//     wrong bytes; a "hung kernel" (mock_enqueue_hang, an NCCL kernel spinning on a dead peer)
//     never completes, and any wait behind it is a violation (it would hang forever);
//   * kernel launches run the real kernels (hostkv_transfer.cu under the CPU emulation shim) with
//     a copy of the parameter block taken at launch, as the driver does; the block size may not
//     exceed the entry's .maxntid; every address a kernel touches must be registered, allocated or
//     labelled device memory when it runs (else a violation: on a GPU, an illegal-address error
//     that kills the process's CUDA state); kernels reading index arrays or layer tables from
//     host memory are counted;
//   * cuMemHostRegister ranges may not overlap (MOCK_REGISTER_MAX_BYTES: larger ones fail, as on a
//     GPU whose memory is full); only registered or cuMemHostAlloc'd memory has a device pointer;
//     a copy whose host range spans two registrations is rejected (CUDA_ERROR_INVALID_VALUE);
//     a copy from pageable memory is synchronous; unregistering a range that queued work still
//     touches, or running queued work on memory unregistered since it was queued, is a violation;
//   * cuMemcpyBatchAsync (12.8 ABI, with failIdx) and cuMemcpyBatchAsync_v2 (13.0 ABI) check
//     their arguments and refuse the legacy stream, as the driver does;
//   * stream capture (mock_stream_capture, a global-mode capture as torch starts them): work
//     enqueued on a capturing stream is recorded into the graph, not run; a "potentially unsafe"
//     call (allocation, pinning, module loading, event and stream queries and waits) made while
//     any capture runs, by a thread whose capture mode (cuThreadExchangeStreamCaptureMode) is
//     not RELAXED, fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the capture,
//     as the driver does (a violation: it breaks another user's graph); cuCtxSynchronize during
//     a capture is illegal; cuStreamIsCapturing of
//     the legacy stream then answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
//   * blocking calls (JIT, pinning, allocation, synchronisation, pageable copies) made by a
//     thread that holds the Python GIL are violations (unless MOCK_ALLOW_GIL=1).
// Knobs (environment): MOCK_CUDA_VERSION (default 13000), MOCK_DEVICES (1), MOCK_INIT_RC (0),
// MOCK_FAIL_REGISTER_AT (n: the n-th cuMemHostRegister fails), MOCK_REGISTER_DELAY_US (each
// cuMemHostRegister sleeps first), MOCK_REGISTER_MAX_BYTES,
// MOCK_UNREGISTER_WAITS_ALL (cuMemHostUnregister waits for all work, hung kernels included),
// MOCK_SYNC_WAITS_ALL (cuCtxSynchronize blocks behind a hung kernel instead of flagging it),
// MOCK_EVENT_RECORD_FAIL (cuEventRecord fails),
// MOCK_BATCH_UNSUPPORTED, MOCK_JIT_FAIL, MOCK_LAZY_JIT_FAIL (the library loads, the JIT fails in
// cuKernelGetFunction without a log; an eager cuModuleLoadDataEx fails with one), MOCK_PROGRESS_ON_QUERY, MOCK_ENQUEUE_DELAY_US (sleep
// before each launch/copy is queued: widens race windows), MOCK_ALLOW_GIL. The test reads
// counters through the mock_* functions (ctypes).
//
// Build, from the repository root (the kernels and the shim come from rust/kernels):
//   g++ -std=c++17 -shared -fPIC -fvisibility=hidden -I rust/kernels \
//       tests/mock_driver/mock_libcuda.cpp -o <dir>/libcuda.so -ldl
// then run the process under test with LD_LIBRARY_PATH=<dir>.

#include <dlfcn.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace mockmem {
// Every address an emulated kernel loads or stores goes through here (see HKV_LOAD below).
bool check(const void* p, size_t n);
}  // namespace mockmem

template <typename T>
inline T hkv_mock_load(const T* p) {
    T v{};
    if (mockmem::check(p, sizeof(T))) {
        std::memcpy(&v, static_cast<const void*>(p), sizeof(T));
    }
    return v;
}

template <typename T>
inline void hkv_mock_store(T* p, T v) {
    if (mockmem::check(p, sizeof(T))) {
        std::memcpy(static_cast<void*>(p), &v, sizeof(T));
    }
}

#define HKV_LOAD(ptr) hkv_mock_load(ptr)
#define HKV_STORE(ptr, v) hkv_mock_store((ptr), (v))

#include "emu_shim.h"
#include "hostkv_transfer.cu"

#define API extern "C" __attribute__((visibility("default")))

namespace {

enum : int {
    OK = 0,
    E_INVALID_VALUE = 1,
    E_OUT_OF_MEMORY = 2,
    E_NOT_INITIALIZED = 3,
    E_INVALID_DEVICE = 101,
    E_INVALID_CONTEXT = 201,
    E_INVALID_PTX = 218,
    E_INVALID_HANDLE = 400,
    E_NOT_FOUND = 500,
    E_NOT_READY = 600,
    E_LAUNCH_TIMEOUT = 702,
    E_ALREADY_REGISTERED = 712,
    E_NOT_REGISTERED = 713,
    E_NOT_SUPPORTED = 801,
    E_CAPTURE_UNSUPPORTED = 900,
    E_CAPTURE_IMPLICIT = 906,
};

constexpr int kMaxDevices = 8;
constexpr uint32_t kKernelMagic = 0x4b524e4c;  // "KRNL"
constexpr uint32_t kFuncMagic = 0x46554e43;    // "FUNC"

struct Ctx {
    int device;
    int refs;
    bool active;
    unsigned gen;
};

struct Module {
    Ctx* ctx;
    unsigned gen;
};

// cuModuleGetFunction / cuKernelGetFunction handles: bound to one context generation.
struct Func {
    uint32_t magic;
    Ctx* ctx;
    unsigned gen;
    int kernel;  // 0 = hkv_check_indices, 1 = hkv_transfer
};

// cuLibraryGetKernel handles: context-independent.
struct Kernel {
    uint32_t magic;
    int kernel;
};

struct Library {
    unsigned maxntid[2];
};

struct Event {
    Ctx* ctx;
    bool pending;
    unsigned seq;
    int device;
    uint64_t stream;
};

enum Side { DEVICE_MEM, PINNED, PAGEABLE };

struct Copy {
    uint64_t dst, src;
    size_t n;
};

struct Op {
    int kind;  // 0 kernel, 1 copies, 2 event marker, 3 hung kernel, 4 memset
    int kernel;
    unsigned grid, block;
    HkvParams params;
    std::vector<Copy> copies;
    Event* event;
    unsigned seq;
    uint64_t dst;
    size_t n;
    unsigned char value;
};

struct Range {
    uint64_t base, len;
    int device;  // registered / allocated / labelled against this device
    unsigned flags;
};

std::recursive_mutex mu;
bool inited = false;
Ctx ctxs[kMaxDevices];
long created[kMaxDevices];
thread_local std::vector<Ctx*> stack;
std::vector<Range> registered, host_allocs, labels, dev_allocs;
std::map<uint64_t, int> stream_device;  // stream handles -> device
std::map<uint64_t, bool> capturing;     // stream handle -> capture active
std::map<std::pair<int, uint64_t>, std::deque<Op>> queues;  // (device, stream) -> work
std::map<std::pair<Ctx*, unsigned>, bool> warm;             // per-context library loads
int register_calls = 0;
long counters[16];  // see mock_counter
int last_launch_device = -1;
std::string violation;
int violations = 0;
bool kernel_fault_reported = false;

int env_int(const char* name, int dflt) {
    const char* v = std::getenv(name);
    return v && *v ? std::atoi(v) : dflt;
}

long long env_ll(const char* name, long long dflt) {
    const char* v = std::getenv(name);
    return v && *v ? std::atoll(v) : dflt;
}

int device_count() { return env_int("MOCK_DEVICES", 1); }

void violate(const std::string& what) {
    ++violations;
    violation = what;
    std::fprintf(stderr, "mock libcuda: violation: %s\n", what.c_str());
}

// A blocking driver call: the calling thread must not hold the Python GIL.
void blocking(const char* what) {
    if (env_int("MOCK_ALLOW_GIL", 0)) {
        return;
    }
    using Check = int (*)();
    static Check gil = reinterpret_cast<Check>(dlsym(RTLD_DEFAULT, "PyGILState_Check"));
    if (gil && gil() == 1) {
        violate(std::string(what) + " (a blocking driver call) with the Python GIL held");
    }
}

Ctx* current() { return stack.empty() ? nullptr : stack.back(); }

// The latest range containing p (a test may relabel memory).
const Range* find(const std::vector<Range>& v, uint64_t p) {
    for (auto it = v.rbegin(); it != v.rend(); ++it) {
        if (p >= it->base && p < it->base + it->len) {
            return &*it;
        }
    }
    return nullptr;
}

bool is_device(uint64_t p) { return find(labels, p) || find(dev_allocs, p); }

Side side_of(uint64_t p) {
    if (is_device(p)) {
        return DEVICE_MEM;
    }
    if (find(registered, p) || find(host_allocs, p)) {
        return PINNED;
    }
    return PAGEABLE;
}

// Whether [p, p+n) lies in one range of kind `side` now.
bool covered(uint64_t p, size_t n, Side side) {
    const Range* r = nullptr;
    if (side == DEVICE_MEM) {
        r = find(labels, p);
        if (!r || p + n > r->base + r->len) {
            r = find(dev_allocs, p);
        }
    } else {
        r = find(registered, p);
        if (!r) {
            r = find(host_allocs, p);
        }
    }
    return r && p + n <= r->base + r->len;
}

// Host bytes of plane p of a kernel's parameter block (every layout: layers * rows * item).
uint64_t plane_bytes(const HkvParams& p, unsigned plane) {
    return static_cast<uint64_t>(p.layers) * p.host_rows * p.item_bytes[plane];
}

bool overlaps(uint64_t a, uint64_t alen, uint64_t b, uint64_t blen) {
    return a < b + blen && b < a + alen;
}

bool op_touches(const Op& op, uint64_t base, uint64_t len) {
    if (op.kind == 0) {
        for (unsigned k = 0; k < op.params.planes && k < 2; ++k) {
            if (overlaps(op.params.host_base[k], plane_bytes(op.params, k), base, len)) {
                return true;
            }
        }
    } else if (op.kind == 1) {
        for (const Copy& c : op.copies) {
            if (overlaps(c.src, c.n, base, len) || overlaps(c.dst, c.n, base, len)) {
                return true;
            }
        }
    }
    return false;
}

void run_kernel(const Op& op);

void run(Op& op) {
    switch (op.kind) {
        case 0:
            run_kernel(op);
            break;
        case 1:
            for (const Copy& c : op.copies) {
                // Pinned host memory queued for DMA must still be pinned when the copy runs.
                bool ok = true;
                for (uint64_t a : {c.src, c.dst}) {
                    Side s = side_of(a);
                    if (s == PAGEABLE || !covered(a, c.n, s)) {
                        violate("a queued copy ran on memory that is no longer registered or "
                                "allocated (an illegal address on a GPU)");
                        ok = false;
                    }
                }
                if (ok) {
                    std::memmove(reinterpret_cast<void*>(c.dst),
                                 reinterpret_cast<const void*>(c.src), c.n);
                }
            }
            break;
        case 2:
            if (op.event->seq == op.seq) {
                op.event->pending = false;
            }
            break;
        case 4:
            std::memset(reinterpret_cast<void*>(op.dst), op.value, op.n);
            break;
        default:
            break;
    }
}

// Runs queued work until `stop` (if given) has run; stops at a hung kernel. Returns false if it
// stopped at a hung kernel before reaching `stop` (or the end).
bool drain(std::deque<Op>& q, const Event* stop = nullptr, unsigned stop_seq = 0) {
    while (!q.empty()) {
        if (q.front().kind == 3) {
            return false;
        }
        Op op = std::move(q.front());
        q.pop_front();
        bool done = stop && op.kind == 2 && op.event == stop && op.seq == stop_seq;
        run(op);
        if (done) {
            return true;
        }
    }
    return true;
}

bool drain_device(int device) {
    bool ok = true;
    for (auto& [key, q] : queues) {
        if (key.first == device) {
            ok = drain(q) && ok;
        }
    }
    return ok;
}

bool any_capture() {
    for (auto& [s, on] : capturing) {
        if (on) {
            return true;
        }
    }
    return false;
}

// CU_STREAM_CAPTURE_MODE_{GLOBAL, THREAD_LOCAL, RELAXED} = 0, 1, 2; per thread.
thread_local int capture_mode = 0;
std::map<uint64_t, bool> invalidated;  // stream handle -> its capture was invalidated
long invalidations = 0;

// A potentially unsafe call during a global-mode capture: true when it must fail (and the
// captures are then invalidated). Called with the lock held.
bool unsafe_in_capture(const char* what) {
    if (capture_mode == 2 || !any_capture()) {
        return false;
    }
    for (auto& [s, on] : capturing) {
        if (on) {
            invalidated[s] = true;
        }
    }
    ++invalidations;
    violate(std::string(what) + " while another thread captures a CUDA graph in global mode, "
            "outside relaxed capture mode: the capture is invalidated");
    return true;
}

// The queue a stream handle names in the current context; nullptr if the handle is foreign.
std::deque<Op>* queue_of(uint64_t stream, bool* legacy) {
    Ctx* c = current();
    *legacy = stream <= 1;
    if (*legacy) {
        // The legacy default stream waits for every other stream of its context first.
        drain_device(c->device);
        return &queues[{c->device, 0}];
    }
    auto it = stream_device.find(stream);
    if (it == stream_device.end() || it->second != c->device) {
        return nullptr;
    }
    return &queues[{c->device, stream}];
}

// Appends work to a stream: captured into a graph when the stream is capturing.
void push(std::deque<Op>* q, uint64_t stream, Op&& op) {
    if (capturing[stream]) {
        ++counters[8];
        return;
    }
    q->push_back(std::move(op));
}

size_t pending_ops() {
    size_t n = 0;
    for (auto& [key, q] : queues) {
        n += q.size();
    }
    return n;
}

void enqueue_delay() {
    long long us = env_ll("MOCK_ENQUEUE_DELAY_US", 0);
    if (us > 0) {
        usleep(static_cast<useconds_t>(us));
    }
}

thread_local const Range* last_hit = nullptr;

}  // namespace

bool mockmem::check(const void* ptr, size_t n) {
    uint64_t p = reinterpret_cast<uint64_t>(ptr);
    if (last_hit && p >= last_hit->base && p + n <= last_hit->base + last_hit->len) {
        return true;
    }
    for (const std::vector<Range>* v : {&registered, &host_allocs, &labels, &dev_allocs}) {
        const Range* r = find(*v, p);
        if (r && p + n <= r->base + r->len) {
            last_hit = r;
            return true;
        }
    }
    if (!kernel_fault_reported) {
        kernel_fault_reported = true;
        char buf[160];
        std::snprintf(buf, sizeof buf,
                      "a kernel touched 0x%llx, which is not registered, allocated or device "
                      "memory (an illegal address on a GPU)",
                      static_cast<unsigned long long>(p));
        violate(buf);
    }
    return false;
}

namespace {

void run_kernel(const Op& op) {
    const HkvParams& p = op.params;
    // Index arrays and layer tables the kernels read from host memory: every warp reads them over
    // PCIe on a GPU.
    for (uint64_t a : {p.host_idx, p.dev_idx, p.dev_table}) {
        if (a && side_of(a) == PINNED) {
            ++counters[6];
        }
    }
    last_hit = nullptr;
    kernel_fault_reported = false;
    gridDim = dim3{op.grid, 1, 1};
    blockDim = dim3{op.block, 1, 1};
    for (unsigned b = 0; b < op.grid; ++b) {
        blockIdx = dim3{b, 0, 0};
        for (unsigned t = 0; t < op.block; ++t) {
            threadIdx = dim3{t, 0, 0};
            if (op.kernel == 0) {
                hkv_check_indices(p);
            } else {
                hkv_transfer(p);
            }
        }
    }
    last_hit = nullptr;
}

}  // namespace

#define LOCK std::lock_guard<std::recursive_mutex> lock(mu)
#define NEED_INIT \
    if (!inited) {  \
        violate(std::string(__func__) + " before cuInit"); \
        return E_NOT_INITIALIZED; \
    }
#define NEED_CTX \
    NEED_INIT;  \
    if (!current()) { \
        violate(std::string(__func__) + " without a current context"); \
        return E_INVALID_CONTEXT; \
    }

// ---------------------------------------------------------------- init, devices, errors

API int cuDriverGetVersion(int* v) {
    *v = env_int("MOCK_CUDA_VERSION", 13000);
    return OK;
}

API int cuInit(unsigned flags) {
    blocking("cuInit");
    LOCK;
    if (flags != 0) {
        return E_INVALID_VALUE;
    }
    int rc = env_int("MOCK_INIT_RC", 0);
    inited = rc == 0;
    return rc;
}

API int cuDeviceGetCount(int* n) {
    LOCK;
    NEED_INIT;
    *n = device_count();
    return OK;
}

API int cuDeviceGet(int* dev, int ordinal) {
    LOCK;
    NEED_INIT;
    if (ordinal < 0 || ordinal >= device_count()) {
        return E_INVALID_DEVICE;
    }
    *dev = ordinal;
    return OK;
}

API int cuDeviceGetName(char* name, int len, int dev) {
    LOCK;
    NEED_INIT;
    std::snprintf(name, static_cast<size_t>(len), "Mock GPU %d", dev);
    return OK;
}

API int cuDeviceGetAttribute(int* v, int attr, int dev) {
    LOCK;
    NEED_INIT;
    (void)dev;
    switch (attr) {
        case 75:  // compute capability major
            *v = 9;
            return OK;
        case 76:
            *v = 0;
            return OK;
        case 41:  // unified addressing
            *v = 1;
            return OK;
        default:
            return E_INVALID_VALUE;
    }
}

API int cuGetErrorName(int rc, const char** s) {
    static std::map<int, std::string> names = {
        {0, "CUDA_SUCCESS"},
        {1, "CUDA_ERROR_INVALID_VALUE"},
        {2, "CUDA_ERROR_OUT_OF_MEMORY"},
        {3, "CUDA_ERROR_NOT_INITIALIZED"},
        {100, "CUDA_ERROR_NO_DEVICE"},
        {201, "CUDA_ERROR_INVALID_CONTEXT"},
        {218, "CUDA_ERROR_INVALID_PTX"},
        {400, "CUDA_ERROR_INVALID_HANDLE"},
        {600, "CUDA_ERROR_NOT_READY"},
        {702, "CUDA_ERROR_LAUNCH_TIMEOUT"},
        {712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"},
        {713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"},
        {801, "CUDA_ERROR_NOT_SUPPORTED"},
        {900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"},
        {906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"},
    };
    auto it = names.find(rc);
    if (it == names.end()) {
        return E_INVALID_VALUE;
    }
    *s = it->second.c_str();
    return OK;
}

API int cuGetErrorString(int rc, const char** s) {
    const char* name = nullptr;
    if (cuGetErrorName(rc, &name) != OK) {
        return E_INVALID_VALUE;
    }
    *s = "mock driver error";
    return OK;
}

// ---------------------------------------------------------------- contexts

API int cuDevicePrimaryCtxRetain(Ctx** out, int dev) {
    LOCK;
    NEED_INIT;
    if (dev < 0 || dev >= device_count()) {
        return E_INVALID_DEVICE;
    }
    Ctx* c = &ctxs[dev];
    c->device = dev;
    if (!c->active) {
        blocking("cuDevicePrimaryCtxRetain (creating a context)");
        ++created[dev];
    }
    c->refs += 1;
    c->active = true;
    *out = c;
    return OK;
}

API int cuDevicePrimaryCtxRelease_v2(int dev) {
    LOCK;
    NEED_INIT;
    Ctx* c = &ctxs[dev];
    if (c->refs <= 0) {
        violate("cuDevicePrimaryCtxRelease without a matching retain");
        return E_INVALID_CONTEXT;
    }
    if (--c->refs == 0) {
        c->active = false;
    }
    return OK;
}

API int cuDevicePrimaryCtxGetState(int dev, unsigned* flags, int* active) {
    LOCK;
    NEED_INIT;
    *flags = 0;
    *active = ctxs[dev].active ? 1 : 0;
    return OK;
}

// Destroys the primary context's state (its allocations and loaded modules); the context is
// re-created at the same handle with a new id on next use.
API int cuDevicePrimaryCtxReset_v2(int dev) {
    LOCK;
    NEED_INIT;
    if (dev < 0 || dev >= device_count()) {
        return E_INVALID_DEVICE;
    }
    for (auto& [key, q] : queues) {
        if (key.first == dev && !q.empty()) {
            violate("cuDevicePrimaryCtxReset with work queued");
        }
    }
    ctxs[dev].gen += 1;
    for (size_t i = dev_allocs.size(); i-- > 0;) {
        if (dev_allocs[i].device == dev) {
            dev_allocs.erase(dev_allocs.begin() + static_cast<long>(i));
        }
    }
    return OK;
}

API int cuCtxGetId(Ctx* c, unsigned long long* id) {
    LOCK;
    NEED_INIT;
    if (!c) {
        return E_INVALID_CONTEXT;
    }
    *id = (static_cast<unsigned long long>(c->device + 1) << 32) | c->gen;
    return OK;
}

static bool usable(Ctx* c) {
    if (c && !c->active) {
        violate("a released primary context was made current");
        return false;
    }
    return true;
}

API int cuCtxGetCurrent(Ctx** out) {
    LOCK;
    NEED_INIT;
    *out = current();
    return OK;
}

API int cuCtxSetCurrent(Ctx* c) {
    LOCK;
    NEED_INIT;
    if (!usable(c)) {
        return E_INVALID_CONTEXT;
    }
    if (stack.empty()) {
        if (c) {
            stack.push_back(c);
        }
    } else if (!c) {
        stack.pop_back();
    } else {
        stack.back() = c;
    }
    return OK;
}

API int cuCtxPushCurrent_v2(Ctx* c) {
    LOCK;
    NEED_INIT;
    if (!c || !usable(c)) {
        return E_INVALID_CONTEXT;
    }
    stack.push_back(c);
    return OK;
}

API int cuCtxPopCurrent_v2(Ctx** out) {
    LOCK;
    NEED_INIT;
    if (stack.empty()) {
        violate("cuCtxPopCurrent with an empty context stack");
        return E_INVALID_CONTEXT;
    }
    if (out) {
        *out = stack.back();
    }
    stack.pop_back();
    return OK;
}

API int cuCtxGetDevice(int* dev) {
    LOCK;
    NEED_CTX;
    *dev = current()->device;
    return OK;
}

bool any_hung();

API int cuCtxSynchronize() {
    blocking("cuCtxSynchronize");
    if (env_int("MOCK_SYNC_WAITS_ALL", 0)) {
        // As a driver does: the call blocks for as long as a hung kernel anywhere does (the lock
        // is not held, so mock_unhang can end it).
        for (;;) {
            {
                LOCK;
                if (!any_hung()) {
                    break;
                }
            }
            usleep(1000);
        }
    }
    LOCK;
    NEED_CTX;
    if (any_capture()) {
        violate("cuCtxSynchronize while a stream is capturing a CUDA graph (illegal)");
        return E_CAPTURE_UNSUPPORTED;
    }
    if (!drain_device(current()->device)) {
        violate("cuCtxSynchronize waits for every stream, including a hung kernel: it would "
                "never return");
        return E_LAUNCH_TIMEOUT;
    }
    return OK;
}

// ---------------------------------------------------------------- host memory

API int cuMemHostRegister_v2(void* p, size_t n, unsigned flags) {
    blocking("cuMemHostRegister");
    // MOCK_REGISTER_DELAY_US: a slow pin (a real one takes about a second per 10 GiB).
    long long delay_us = env_ll("MOCK_REGISTER_DELAY_US", 0);
    if (delay_us > 0) {
        usleep(static_cast<useconds_t>(delay_us));
    }
    LOCK;
    if (unsafe_in_capture("cuMemHostRegister")) {
        return E_CAPTURE_UNSUPPORTED;
    }
    NEED_CTX;
    ++register_calls;
    if (register_calls == env_int("MOCK_FAIL_REGISTER_AT", 0)) {
        return E_OUT_OF_MEMORY;
    }
    long long cap = env_ll("MOCK_REGISTER_MAX_BYTES", 0);
    if (cap > 0 && static_cast<long long>(n) > cap) {
        return E_OUT_OF_MEMORY;
    }
    if (!p || n == 0) {
        return E_INVALID_VALUE;
    }
    if (flags != 3) {
        violate("cuMemHostRegister flags are not PORTABLE | DEVICEMAP");
    }
    uint64_t b = reinterpret_cast<uint64_t>(p);
    for (const Range& r : registered) {
        if (b < r.base + r.len && r.base < b + n) {
            return E_ALREADY_REGISTERED;
        }
    }
    registered.push_back({b, n, current()->device, flags});
    return OK;
}

bool any_hung() {
    for (auto& [key, q] : queues) {
        for (const Op& op : q) {
            if (op.kind == 3) {
                return true;
            }
        }
    }
    return false;
}

API int cuMemHostUnregister(void* p) {
    blocking("cuMemHostUnregister");
    if (env_int("MOCK_UNREGISTER_WAITS_ALL", 0)) {
        // Drivers may wait for all work on the device before unpinning, whoever queued it: this
        // call then blocks for as long as a hung kernel anywhere does (the lock is not held, so
        // mock_unhang can end it).
        for (;;) {
            {
                LOCK;
                if (!any_hung()) {
                    for (auto& [key, q] : queues) {
                        drain(q);
                    }
                    break;
                }
            }
            usleep(1000);
        }
    }
    LOCK;
    if (unsafe_in_capture("cuMemHostUnregister")) {
        return E_CAPTURE_UNSUPPORTED;
    }
    NEED_CTX;
    uint64_t b = reinterpret_cast<uint64_t>(p);
    for (size_t i = 0; i < registered.size(); ++i) {
        if (registered[i].base == b) {
            for (auto& [key, q] : queues) {
                for (const Op& op : q) {
                    if (op_touches(op, b, registered[i].len)) {
                        violate("cuMemHostUnregister while queued work still touches the range");
                        break;
                    }
                }
            }
            registered.erase(registered.begin() + static_cast<long>(i));
            return OK;
        }
    }
    return E_NOT_REGISTERED;
}

API int cuMemHostAlloc(void** p, size_t n, unsigned flags) {
    blocking("cuMemHostAlloc");
    LOCK;
    if (unsafe_in_capture("cuMemHostAlloc")) {
        return E_CAPTURE_UNSUPPORTED;
    }
    NEED_CTX;
    if (flags != 3) {
        violate("cuMemHostAlloc flags are not PORTABLE | DEVICEMAP");
    }
    size_t rounded = (n + 63) / 64 * 64;
    *p = std::aligned_alloc(64, rounded);
    if (!*p) {
        return E_OUT_OF_MEMORY;
    }
    std::memset(*p, 0xA5, rounded);  // the driver does not zero it either
    host_allocs.push_back({reinterpret_cast<uint64_t>(*p), n, current()->device, flags});
    return OK;
}

API int cuMemFreeHost(void* p) {
    blocking("cuMemFreeHost");
    LOCK;
    NEED_CTX;
    uint64_t b = reinterpret_cast<uint64_t>(p);
    for (size_t i = 0; i < host_allocs.size(); ++i) {
        if (host_allocs[i].base == b) {
            host_allocs.erase(host_allocs.begin() + static_cast<long>(i));
            std::free(p);
            return OK;
        }
    }
    return E_INVALID_VALUE;
}

API int cuMemHostGetDevicePointer_v2(uint64_t* d, void* p, unsigned flags) {
    LOCK;
    NEED_CTX;
    uint64_t b = reinterpret_cast<uint64_t>(p);
    if (flags != 0 || !(find(host_allocs, b) || find(registered, b))) {
        return E_INVALID_VALUE;
    }
    *d = b;
    return OK;
}

API int cuPointerGetAttribute(void* data, int attr, uint64_t p) {
    LOCK;
    NEED_INIT;
    const Range* dev = find(labels, p);
    if (!dev) {
        dev = find(dev_allocs, p);
    }
    if (attr == 9) {  // DEVICE_ORDINAL: needs no current context
        const Range* r = dev ? dev : find(registered, p);
        if (!r) {
            return E_INVALID_VALUE;
        }
        *static_cast<int*>(data) = r->device;
        return OK;
    }
    if (attr == 3) {  // DEVICE_POINTER
        if (!current()) {
            return E_INVALID_CONTEXT;
        }
        if (!(dev || find(registered, p) || find(host_allocs, p))) {
            return E_INVALID_VALUE;
        }
        *static_cast<uint64_t*>(data) = p;
        return OK;
    }
    return E_INVALID_VALUE;
}

// ---------------------------------------------------------------- device memory

API int cuMemAlloc_v2(uint64_t* d, size_t n) {
    blocking("cuMemAlloc");
    LOCK;
    if (unsafe_in_capture("cuMemAlloc_v2")) {
        return E_CAPTURE_UNSUPPORTED;
    }
    NEED_CTX;
    size_t rounded = (n + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, rounded);
    if (!p) {
        return E_OUT_OF_MEMORY;
    }
    std::memset(p, 0x5A, rounded);  // device memory is not zeroed
    *d = reinterpret_cast<uint64_t>(p);
    dev_allocs.push_back({*d, n, current()->device, 0});
    return OK;
}

API int cuMemFree_v2(uint64_t d) {
    blocking("cuMemFree");
    LOCK;
    NEED_CTX;
    for (size_t i = 0; i < dev_allocs.size(); ++i) {
        if (dev_allocs[i].base == d) {
            dev_allocs.erase(dev_allocs.begin() + static_cast<long>(i));
            std::free(reinterpret_cast<void*>(d));
            return OK;
        }
    }
    return E_INVALID_VALUE;
}

// ---------------------------------------------------------------- modules and launches

static bool ptx_ok(const char* text) {
    return std::strstr(text, "\n.version 8.0\n") && std::strstr(text, "\n.target sm_80\n") &&
           std::strstr(text, ".entry hkv_check_indices(") && std::strstr(text, ".entry hkv_transfer(");
}

// The .maxntid of an entry (0: none declared).
static unsigned maxntid(const char* text, const char* entry) {
    std::string want = std::string(".entry ") + entry + "(";
    const char* at = std::strstr(text, want.c_str());
    const char* body = at ? std::strchr(at, '{') : nullptr;
    const char* m = at ? std::strstr(at, ".maxntid ") : nullptr;
    if (!m || (body && m > body)) {
        return 0;
    }
    return static_cast<unsigned>(std::strtoul(m + 9, nullptr, 10));
}

static void jit_log(unsigned nopts, int* opts, void** vals) {
    char* err_log = nullptr;
    size_t err_cap = 0;
    for (unsigned i = 0; i < nopts; ++i) {
        if (opts[i] == 5) {
            err_log = static_cast<char*>(vals[i]);
        } else if (opts[i] == 6) {
            err_cap = reinterpret_cast<size_t>(vals[i]);
        }
    }
    if (err_log && err_cap > 0) {
        std::snprintf(err_log, err_cap, "mock ptxas: rejected the module");
    }
}

static Library* last_library = nullptr;

API int cuModuleLoadDataEx(Module** out, const void* image, unsigned nopts, int* opts,
                           void** vals) {
    blocking("cuModuleLoadDataEx (JIT)");
    LOCK;
    if (unsafe_in_capture("cuModuleLoadDataEx")) {
        return E_CAPTURE_UNSUPPORTED;
    }
    NEED_CTX;
    const char* text = static_cast<const char*>(image);
    if (!ptx_ok(text) || env_int("MOCK_JIT_FAIL", 0) || env_int("MOCK_LAZY_JIT_FAIL", 0)) {
        jit_log(nopts, opts, vals);
        return E_INVALID_PTX;
    }
    last_library = new Library{{maxntid(text, "hkv_check_indices"), maxntid(text, "hkv_transfer")}};
    *out = new Module{current(), current()->gen};
    return OK;
}

API int cuModuleUnload(Module* m) {
    LOCK;
    NEED_INIT;
    delete m;
    return OK;
}

API int cuModuleGetFunction(Func** out, Module* m, const char* name) {
    LOCK;
    NEED_CTX;
    int k = std::strcmp(name, "hkv_check_indices") == 0 ? 0
            : std::strcmp(name, "hkv_transfer") == 0    ? 1
                                                        : -1;
    if (!m || k < 0) {
        return E_NOT_FOUND;
    }
    *out = new Func{kFuncMagic, m->ctx, m->gen, k};
    return OK;
}

// Context-independent loading (CUDA 12.0): no context needed.
API int cuLibraryLoadData(Library** out, const void* image, int* opts, void** vals,
                          unsigned nopts, void* lib_opts, void* lib_vals, unsigned nlib) {
    blocking("cuLibraryLoadData (JIT)");
    LOCK;
    if (unsafe_in_capture("cuLibraryLoadData")) {
        return E_CAPTURE_UNSUPPORTED;
    }
    NEED_INIT;
    (void)lib_opts;
    (void)lib_vals;
    if (nlib != 0) {
        return E_INVALID_VALUE;
    }
    const char* text = static_cast<const char*>(image);
    if (!ptx_ok(text) || env_int("MOCK_JIT_FAIL", 0)) {
        jit_log(nopts, opts, vals);
        return E_INVALID_PTX;
    }
    *out = new Library{{maxntid(text, "hkv_check_indices"), maxntid(text, "hkv_transfer")}};
    last_library = *out;
    return OK;
}

API int cuLibraryGetKernel(Kernel** out, Library* lib, const char* name) {
    LOCK;
    NEED_INIT;
    int k = std::strcmp(name, "hkv_check_indices") == 0 ? 0
            : std::strcmp(name, "hkv_transfer") == 0    ? 1
                                                        : -1;
    if (!lib || k < 0) {
        return E_NOT_FOUND;
    }
    *out = new Kernel{kKernelMagic, k};
    return OK;
}

// Loads the library into the current context (the per-context JIT on a real driver).
API int cuKernelGetFunction(Func** out, Kernel* k) {
    LOCK;
    NEED_CTX;
    if (!k || k->magic != kKernelMagic) {
        return E_INVALID_HANDLE;
    }
    Ctx* c = current();
    if (!warm[{c, c->gen}]) {
        blocking("cuKernelGetFunction (loading into a context)");
        if (env_int("MOCK_LAZY_JIT_FAIL", 0)) {
            // Lazy loading: the JIT runs here, and its log has nowhere to go.
            return E_INVALID_PTX;
        }
        warm[{c, c->gen}] = true;
    }
    *out = new Func{kFuncMagic, c, c->gen, k->kernel};
    return OK;
}

API int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                       unsigned bz, unsigned smem, uint64_t stream, void** params, void** extra) {
    enqueue_delay();
    LOCK;
    NEED_CTX;
    int kernel = -1;
    if (f && *static_cast<uint32_t*>(f) == kKernelMagic) {
        kernel = static_cast<Kernel*>(f)->kernel;  // context-independent handle
    } else if (f && *static_cast<uint32_t*>(f) == kFuncMagic) {
        Func* fn = static_cast<Func*>(f);
        if (fn->ctx != current()) {
            violate("cuLaunchKernel of a function loaded in another context");
            return E_INVALID_HANDLE;
        }
        if (fn->gen != current()->gen) {
            violate("cuLaunchKernel of a stale function handle (its context was reset)");
            return E_INVALID_HANDLE;
        }
        kernel = fn->kernel;
    } else {
        return E_INVALID_HANDLE;
    }
    unsigned limit = last_library ? last_library->maxntid[kernel] : 0;
    if (limit && bx > limit) {
        return E_INVALID_VALUE;  // more threads than the entry's .maxntid
    }
    if (gx < 1 || gx > 0x7fffffffu || gy != 1 || gz != 1 || bx < 32 || bx % 32 != 0 || by != 1 ||
        bz != 1 || smem != 0 || !params || extra) {
        violate("cuLaunchKernel with unexpected dimensions or arguments");
        return E_INVALID_VALUE;
    }
    bool legacy = false;
    std::deque<Op>* q = queue_of(stream, &legacy);
    if (!q) {
        return E_INVALID_HANDLE;
    }
    Op op{};
    op.kind = 0;
    op.kernel = kernel;
    op.grid = gx;
    op.block = bx;
    std::memcpy(&op.params, params[0], sizeof(HkvParams));  // by value, at launch
    push(q, stream, std::move(op));
    last_launch_device = current()->device;
    ++counters[0];
    return OK;
}

// ---------------------------------------------------------------- events and streams

API int cuEventCreate(Event** out, unsigned flags) {
    LOCK;
    NEED_CTX;
    (void)flags;
    *out = new Event{current(), false, 0, current()->device, 0};
    return OK;
}

API int cuEventDestroy_v2(Event* e) {
    LOCK;
    NEED_INIT;
    (void)e;  // leaked on purpose: a queued marker may still point at it
    return OK;
}

API int cuEventRecord(Event* e, uint64_t stream) {
    LOCK;
    NEED_CTX;
    if (env_int("MOCK_EVENT_RECORD_FAIL", 0)) {
        return E_INVALID_VALUE;
    }
    if (e->ctx != current()) {
        violate("cuEventRecord of an event of another context");
        return E_INVALID_HANDLE;
    }
    bool legacy = false;
    std::deque<Op>* q = queue_of(stream, &legacy);
    if (!q) {
        return E_INVALID_HANDLE;
    }
    if (capturing[stream]) {
        ++counters[8];
        return OK;
    }
    e->pending = true;
    e->seq += 1;
    e->device = current()->device;
    e->stream = legacy ? 0 : stream;
    Op op{};
    op.kind = 2;
    op.event = e;
    op.seq = e->seq;
    q->push_back(std::move(op));
    return OK;
}

API int cuEventQuery(Event* e) {
    LOCK;
    if (unsafe_in_capture("cuEventQuery")) {
        return E_CAPTURE_UNSUPPORTED;
    }
    NEED_INIT;
    if (e->pending && env_int("MOCK_PROGRESS_ON_QUERY", 0)) {
        drain(queues[{e->device, e->stream}], e, e->seq);
    }
    return e->pending ? E_NOT_READY : OK;
}

API int cuEventSynchronize(Event* e) {
    blocking("cuEventSynchronize");
    LOCK;
    if (unsafe_in_capture("cuEventSynchronize")) {
        return E_CAPTURE_UNSUPPORTED;
    }
    NEED_INIT;
    if (e->pending) {
        drain(queues[{e->device, e->stream}], e, e->seq);
        if (e->pending) {
            violate("cuEventSynchronize behind a hung kernel: it would never return");
            return E_LAUNCH_TIMEOUT;
        }
    }
    return OK;
}

API int cuStreamCreate(uint64_t* out, unsigned flags) {
    LOCK;
    NEED_CTX;
    (void)flags;
    static uint64_t next = 0x9000;
    next += 0x10;
    stream_device[next] = current()->device;
    *out = next;
    return OK;
}

API int cuStreamDestroy_v2(uint64_t s) {
    LOCK;
    NEED_INIT;
    stream_device.erase(s);
    return OK;
}

API int cuStreamSynchronize(uint64_t stream) {
    blocking("cuStreamSynchronize");
    LOCK;
    if (unsafe_in_capture("cuStreamSynchronize")) {
        return E_CAPTURE_UNSUPPORTED;
    }
    NEED_CTX;
    bool legacy = false;
    std::deque<Op>* q = queue_of(stream, &legacy);
    if (!q) {
        return E_INVALID_HANDLE;
    }
    if (!drain(*q)) {
        violate("cuStreamSynchronize behind a hung kernel: it would never return");
        return E_LAUNCH_TIMEOUT;
    }
    return OK;
}

API int cuStreamIsCapturing(uint64_t stream, int* status) {
    LOCK;
    NEED_CTX;
    if (stream <= 1) {
        if (any_capture()) {
            return E_CAPTURE_IMPLICIT;
        }
        *status = 0;
        return OK;
    }
    if (stream_device.find(stream) == stream_device.end()) {
        return E_INVALID_HANDLE;
    }
    *status = capturing[stream] ? 1 : 0;
    return OK;
}

// ---------------------------------------------------------------- copies

// Queues `copies` (or runs them at once when a host side is pageable, as the driver does).
static int enqueue_copies(uint64_t stream, std::vector<Copy> copies) {
    bool legacy = false;
    std::deque<Op>* q = queue_of(stream, &legacy);
    if (!q) {
        return E_INVALID_HANDLE;
    }
    bool pageable = false;
    for (const Copy& c : copies) {
        for (uint64_t a : {c.src, c.dst}) {
            Side s = side_of(a);
            if (s == PAGEABLE) {
                pageable = true;
            } else if (!covered(a, c.n, s)) {
                // Registered memory: the whole host range must lie in one registration.
                ++counters[9];
                return E_INVALID_VALUE;
            }
        }
    }
    if (pageable) {
        blocking("a copy from/to pageable memory (synchronous)");
        ++counters[5];
        if (!drain(*q)) {
            violate("a synchronous pageable copy behind a hung kernel: it would never return");
            return E_LAUNCH_TIMEOUT;
        }
        for (const Copy& c : copies) {
            std::memmove(reinterpret_cast<void*>(c.dst), reinterpret_cast<const void*>(c.src),
                         c.n);
        }
        return OK;
    }
    Op op{};
    op.kind = 1;
    op.copies = std::move(copies);
    push(q, stream, std::move(op));
    return OK;
}

API int cuMemcpyAsync(uint64_t dst, uint64_t src, size_t n, uint64_t stream) {
    enqueue_delay();
    LOCK;
    NEED_CTX;
    ++counters[1];
    return enqueue_copies(stream, {{dst, src, n}});
}

API int cuMemcpyDtoHAsync_v2(void* dst, uint64_t src, size_t n, uint64_t stream) {
    LOCK;
    NEED_CTX;
    ++counters[4];
    return enqueue_copies(stream, {{reinterpret_cast<uint64_t>(dst), src, n}});
}

API int cuMemcpyHtoDAsync_v2(uint64_t dst, const void* src, size_t n, uint64_t stream) {
    LOCK;
    NEED_CTX;
    ++counters[7];
    if (!is_device(dst)) {
        violate("cuMemcpyHtoDAsync to memory that is not device memory");
        return E_INVALID_VALUE;
    }
    return enqueue_copies(stream, {{dst, reinterpret_cast<uint64_t>(src), n}});
}

API int cuMemsetD8Async(uint64_t dst, unsigned char value, size_t n, uint64_t stream) {
    LOCK;
    NEED_CTX;
    bool legacy = false;
    std::deque<Op>* q = queue_of(stream, &legacy);
    if (!q) {
        return E_INVALID_HANDLE;
    }
    if (!is_device(dst)) {
        return E_INVALID_VALUE;
    }
    Op op{};
    op.kind = 4;
    op.dst = dst;
    op.n = n;
    op.value = value;
    push(q, stream, std::move(op));
    return OK;
}

struct MockLocation {
    int type;
    int id;
};
struct MockMemcpyAttributes {
    int srcAccessOrder;
    MockLocation srcLocHint;
    MockLocation dstLocHint;
    unsigned flags;
};
static_assert(sizeof(MockMemcpyAttributes) == 24, "CUmemcpyAttributes is 24 bytes");

static int batch(uint64_t* dsts, uint64_t* srcs, size_t* sizes, size_t count,
                 MockMemcpyAttributes* attrs, size_t* attr_idx, size_t nattrs, uint64_t stream) {
    if (env_int("MOCK_BATCH_UNSUPPORTED", 0)) {
        return E_NOT_SUPPORTED;
    }
    if (stream <= 1) {
        return E_INVALID_VALUE;  // the legacy stream is refused
    }
    if (count == 0 || nattrs != 1 || attr_idx[0] != 0 || attrs[0].srcAccessOrder != 1 ||
        attrs[0].flags > 1 || attrs[0].srcLocHint.type < 1 || attrs[0].srcLocHint.type > 2 ||
        attrs[0].dstLocHint.type < 1 || attrs[0].dstLocHint.type > 2) {
        violate("cuMemcpyBatchAsync with unexpected attributes");
        return E_INVALID_VALUE;
    }
    std::vector<Copy> copies;
    for (size_t i = 0; i < count; ++i) {
        copies.push_back({dsts[i], srcs[i], sizes[i]});  // the lists are read during the call
    }
    return enqueue_copies(stream, std::move(copies));
}

API int cuMemcpyBatchAsync(uint64_t* dsts, uint64_t* srcs, size_t* sizes, size_t count,
                           MockMemcpyAttributes* attrs, size_t* attr_idx, size_t nattrs,
                           size_t* fail_idx, uint64_t stream) {
    enqueue_delay();
    LOCK;
    NEED_CTX;
    ++counters[2];
    if (!fail_idx) {
        violate("cuMemcpyBatchAsync (12.8 ABI) without failIdx");
        return E_INVALID_VALUE;
    }
    *fail_idx = SIZE_MAX;
    return batch(dsts, srcs, sizes, count, attrs, attr_idx, nattrs, stream);
}

API int cuMemcpyBatchAsync_v2(uint64_t* dsts, uint64_t* srcs, size_t* sizes, size_t count,
                              MockMemcpyAttributes* attrs, size_t* attr_idx, size_t nattrs,
                              uint64_t stream) {
    enqueue_delay();
    LOCK;
    NEED_CTX;
    ++counters[3];
    return batch(dsts, srcs, sizes, count, attrs, attr_idx, nattrs, stream);
}

// ---------------------------------------------------------------- test controls

// Marks [ptr, ptr+len) as memory of `device` (stands for a torch CUDA tensor).
API void mock_label(uint64_t ptr, uint64_t len, int device) {
    LOCK;
    labels.push_back({ptr, len, device, 0});
}

API uint64_t mock_stream_create(int device) {
    LOCK;
    static uint64_t next = 0x5000;
    next += 0x10;
    stream_device[next] = device;
    return next;
}

API int cuThreadExchangeStreamCaptureMode(int* mode) {
    if (!mode || *mode < 0 || *mode > 2) {
        return E_INVALID_VALUE;
    }
    int previous = capture_mode;
    capture_mode = *mode;
    *mode = previous;
    return OK;
}

// Captures invalidated so far by potentially unsafe calls.
API long mock_capture_invalidations() {
    LOCK;
    return invalidations;
}

// This thread's capture mode (0 global, 1 thread-local, 2 relaxed).
API int mock_thread_capture_mode() { return capture_mode; }

// Starts (on != 0) or ends a CUDA graph capture on `stream`.
API void mock_stream_capture(uint64_t stream, int on) {
    LOCK;
    capturing[stream] = on != 0;
}

// Queues a kernel that never finishes (an NCCL kernel spinning on a dead peer).
API void mock_enqueue_hang(uint64_t stream) {
    LOCK;
    int device = stream_device.count(stream) ? stream_device[stream] : 0;
    Op op{};
    op.kind = 3;
    queues[{device, stream}].push_back(std::move(op));
}

// The hung kernels finish (the peer came back).
API void mock_unhang() {
    LOCK;
    for (auto& [key, q] : queues) {
        for (auto it = q.begin(); it != q.end();) {
            it = it->kind == 3 ? q.erase(it) : it + 1;
        }
    }
}

// Runs every queued copy and kernel (up to a hung kernel).
API void mock_sync_all() {
    LOCK;
    for (auto& [key, q] : queues) {
        drain(q);
    }
}

API long mock_pending_ops() {
    LOCK;
    return static_cast<long>(pending_ops());
}

API long mock_registrations() {
    LOCK;
    return static_cast<long>(registered.size());
}

// Bytes of registration `i` (in registration order), or -1.
API long long mock_registration_size(int i) {
    LOCK;
    return i >= 0 && static_cast<size_t>(i) < registered.size()
               ? static_cast<long long>(registered[static_cast<size_t>(i)].len)
               : -1;
}

// Device whose context registration `i` was made in (in registration order), or -1.
API int mock_registration_device(int i) {
    LOCK;
    return i >= 0 && static_cast<size_t>(i) < registered.size()
               ? registered[static_cast<size_t>(i)].device
               : -1;
}

// 0 launches, 1 cuMemcpyAsync, 2 batch (12.8 ABI), 3 batch _v2, 4 DtoH, 5 pageable (synchronous)
// copies, 6 kernels reading indices or layer tables from host memory, 7 HtoD copies, 8 work
// captured into a graph, 9 copies refused for spanning two registrations.
API long mock_counter(int which) {
    LOCK;
    return counters[which];
}

// Times device `device`'s primary context was created (made active from inactive).
API long mock_ctx_created(int device) {
    LOCK;
    return created[device];
}

API int mock_last_launch_device() {
    LOCK;
    return last_launch_device;
}

API uint64_t mock_current_ctx() { return reinterpret_cast<uint64_t>(current()); }

API uint64_t mock_primary_ctx(int device) { return reinterpret_cast<uint64_t>(&ctxs[device]); }

API int mock_violations() {
    LOCK;
    return violations;
}

API const char* mock_violation_text() {
    LOCK;
    return violation.c_str();
}
