// A stand-in libcuda.so for CPU-only tests of hostkv_rs's CUDA driver code (tests/test_mock_driver.py).
//
// It implements the driver entry points rust/src/cuda calls, with the rules of the real driver
// that our code depends on, and nothing else:
//   * a per-thread context stack (cuCtxSetCurrent/Push/Pop) and primary contexts per device;
//     calls that need a current context fail with CUDA_ERROR_INVALID_CONTEXT without one;
//   * work is asynchronous: launches and copies are queued per stream and run only when the
//     stream, an event recorded on it, or the context is synchronised (or the test drains them),
//     so a host buffer reused before the queued work ran is caught as wrong bytes;
//   * kernel launches run the real kernels (hostkv_transfer.cu under the CPU emulation shim)
//     with a copy of the parameter block taken at launch, as the driver does;
//   * cuMemHostRegister ranges may not overlap; only registered or cuMemHostAlloc'd memory has a
//     device pointer; unregistering while work is queued is recorded as a violation;
//   * cuMemcpyBatchAsync (12.8 ABI, with failIdx) and cuMemcpyBatchAsync_v2 (13.0 ABI) check
//     their arguments and refuse the legacy stream, as the driver does.
// Knobs (environment): MOCK_CUDA_VERSION (default 13000), MOCK_DEVICES (1), MOCK_INIT_RC (0),
// MOCK_FAIL_REGISTER_AT (n: the n-th cuMemHostRegister fails), MOCK_BATCH_UNSUPPORTED,
// MOCK_JIT_FAIL. The test reads counters through the mock_* functions (ctypes).
//
// Build: g++ -std=c++17 -shared -fPIC -fvisibility=hidden -I rust/kernels mock_libcuda.cpp
//        -o <dir>/libcuda.so, then run the process under test with LD_LIBRARY_PATH=<dir>.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "emu_shim.h"
#include "hostkv_transfer.cu"

#define API extern "C" __attribute__((visibility("default")))

void hkv_emu_launch_kernel(int kernel, const HkvParams& p, unsigned grid);

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
    E_ALREADY_REGISTERED = 712,
    E_NOT_REGISTERED = 713,
    E_NOT_SUPPORTED = 801,
};

constexpr int kMaxDevices = 8;

struct Ctx {
    int device;
    int refs;
    bool active;
};

struct Module {
    Ctx* ctx;
};

struct Func {
    Ctx* ctx;
    int kernel;  // 0 = hkv_check_indices, 1 = hkv_transfer
};

struct Event {
    Ctx* ctx;
    bool pending;
};

struct Copy {
    uint64_t dst, src;
    size_t n;
};

struct Op {
    int kind;  // 0 kernel, 1 copies, 2 event marker
    int kernel;
    unsigned grid;
    HkvParams params;
    std::vector<Copy> copies;
    Event* event;
};

struct Range {
    uint64_t base, len;
    int device;  // registered / labelled against this device
    unsigned flags;
};

std::recursive_mutex mu;
bool inited = false;
Ctx ctxs[kMaxDevices];
thread_local std::vector<Ctx*> stack;
std::vector<Range> registered, host_allocs, labels;
std::map<uint64_t, int> stream_device;  // mock_stream_create handles -> device
std::map<std::pair<int, uint64_t>, std::deque<Op>> queues;  // (device, stream) -> work
int register_calls = 0;
long counters[8];  // see mock_counter
int last_launch_device = -1;
std::string violation;
int violations = 0;

int env_int(const char* name, int dflt) {
    const char* v = std::getenv(name);
    return v && *v ? std::atoi(v) : dflt;
}

int device_count() { return env_int("MOCK_DEVICES", 1); }

void violate(const std::string& what) {
    ++violations;
    violation = what;
    std::fprintf(stderr, "mock libcuda: violation: %s\n", what.c_str());
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

void run(Op& op) {
    switch (op.kind) {
        case 0:
            hkv_emu_launch_kernel(op.kernel, op.params, op.grid);
            break;
        case 1:
            for (const Copy& c : op.copies) {
                std::memmove(reinterpret_cast<void*>(c.dst), reinterpret_cast<const void*>(c.src),
                             c.n);
            }
            break;
        default:
            op.event->pending = false;
    }
}

void drain(std::deque<Op>& q) {
    while (!q.empty()) {
        Op op = std::move(q.front());
        q.pop_front();
        run(op);
    }
}

void drain_device(int device) {
    for (auto& [key, q] : queues) {
        if (key.first == device) {
            drain(q);
        }
    }
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

size_t pending_ops() {
    size_t n = 0;
    for (auto& [key, q] : queues) {
        n += q.size();
    }
    return n;
}

}  // namespace

// The emulated grid (the same loop as emu_runner.cpp, kept here so this library stands alone).
void hkv_emu_launch_kernel(int kernel, const HkvParams& p, unsigned grid) {
    gridDim = dim3{grid, 1, 1};
    blockDim = dim3{1024, 1, 1};
    for (unsigned b = 0; b < grid; ++b) {
        blockIdx = dim3{b, 0, 0};
        for (unsigned t = 0; t < 1024; ++t) {
            threadIdx = dim3{t, 0, 0};
            if (kernel == 0) {
                hkv_check_indices(p);
            } else {
                hkv_transfer(p);
            }
        }
    }
}

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
        {712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"},
        {713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"},
        {801, "CUDA_ERROR_NOT_SUPPORTED"},
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

API int cuCtxSynchronize() {
    LOCK;
    NEED_CTX;
    drain_device(current()->device);
    return OK;
}

// ---------------------------------------------------------------- host memory

API int cuMemHostRegister_v2(void* p, size_t n, unsigned flags) {
    LOCK;
    NEED_CTX;
    ++register_calls;
    if (register_calls == env_int("MOCK_FAIL_REGISTER_AT", 0)) {
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

API int cuMemHostUnregister(void* p) {
    LOCK;
    NEED_CTX;
    uint64_t b = reinterpret_cast<uint64_t>(p);
    for (size_t i = 0; i < registered.size(); ++i) {
        if (registered[i].base == b) {
            if (pending_ops() > 0) {
                violate("cuMemHostUnregister while copies or kernels are still queued");
            }
            registered.erase(registered.begin() + static_cast<long>(i));
            return OK;
        }
    }
    return E_NOT_REGISTERED;
}

API int cuMemHostAlloc(void** p, size_t n, unsigned flags) {
    LOCK;
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

// ---------------------------------------------------------------- modules and launches

API int cuModuleLoadDataEx(Module** out, const void* image, unsigned nopts, int* opts,
                           void** vals) {
    LOCK;
    NEED_CTX;
    const char* text = static_cast<const char*>(image);
    char* err_log = nullptr;
    size_t err_cap = 0;
    for (unsigned i = 0; i < nopts; ++i) {
        if (opts[i] == 5) {
            err_log = static_cast<char*>(vals[i]);
        } else if (opts[i] == 6) {
            err_cap = reinterpret_cast<size_t>(vals[i]);
        }
    }
    bool ok = std::strstr(text, "\n.version 8.0\n") && std::strstr(text, "\n.target sm_80\n") &&
              std::strstr(text, ".entry hkv_check_indices(") &&
              std::strstr(text, ".entry hkv_transfer(");
    if (!ok || env_int("MOCK_JIT_FAIL", 0)) {
        if (err_log && err_cap > 0) {
            std::snprintf(err_log, err_cap, "mock ptxas: rejected the module");
        }
        return E_INVALID_PTX;
    }
    *out = new Module{current()};
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
    *out = new Func{m->ctx, k};
    return OK;
}

API int cuLaunchKernel(Func* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                       unsigned bz, unsigned smem, uint64_t stream, void** params, void** extra) {
    LOCK;
    NEED_CTX;
    if (f->ctx != current()) {
        violate("cuLaunchKernel of a function loaded in another context");
        return E_INVALID_HANDLE;
    }
    if (gx < 1 || gx > 65535 || gy != 1 || gz != 1 || bx != 1024 || by != 1 || bz != 1 ||
        smem != 0 || !params || extra) {
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
    op.kernel = f->kernel;
    op.grid = gx;
    std::memcpy(&op.params, params[0], sizeof(HkvParams));  // by value, at launch
    q->push_back(std::move(op));
    last_launch_device = current()->device;
    ++counters[0];
    return OK;
}

// ---------------------------------------------------------------- events and streams

API int cuEventCreate(Event** out, unsigned flags) {
    LOCK;
    NEED_CTX;
    (void)flags;
    *out = new Event{current(), false};
    return OK;
}

API int cuEventRecord(Event* e, uint64_t stream) {
    LOCK;
    NEED_CTX;
    if (e->ctx != current()) {
        violate("cuEventRecord of an event of another context");
        return E_INVALID_HANDLE;
    }
    bool legacy = false;
    std::deque<Op>* q = queue_of(stream, &legacy);
    if (!q) {
        return E_INVALID_HANDLE;
    }
    e->pending = true;
    Op op{};
    op.kind = 2;
    op.event = e;
    q->push_back(std::move(op));
    return OK;
}

API int cuEventQuery(Event* e) {
    LOCK;
    NEED_INIT;
    return e->pending ? E_NOT_READY : OK;
}

API int cuEventSynchronize(Event* e) {
    LOCK;
    NEED_INIT;
    if (e->pending) {
        drain_device(e->ctx->device);
    }
    return OK;
}

API int cuStreamSynchronize(uint64_t stream) {
    LOCK;
    NEED_CTX;
    bool legacy = false;
    std::deque<Op>* q = queue_of(stream, &legacy);
    if (!q) {
        return E_INVALID_HANDLE;
    }
    drain(*q);
    return OK;
}

// ---------------------------------------------------------------- copies

static int enqueue_copies(uint64_t stream, std::vector<Copy> copies) {
    bool legacy = false;
    std::deque<Op>* q = queue_of(stream, &legacy);
    if (!q) {
        return E_INVALID_HANDLE;
    }
    Op op{};
    op.kind = 1;
    op.copies = std::move(copies);
    q->push_back(std::move(op));
    return OK;
}

API int cuMemcpyAsync(uint64_t dst, uint64_t src, size_t n, uint64_t stream) {
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

// Runs every queued copy and kernel.
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

// 0 launches, 1 cuMemcpyAsync, 2 batch (12.8 ABI), 3 batch _v2, 4 DtoH.
API long mock_counter(int which) {
    LOCK;
    return counters[which];
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
