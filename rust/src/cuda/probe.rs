//! Is CUDA usable here, and why not. Lazy (nothing runs before the first question), cached, and
//! fork-aware: a child of a process that initialised CUDA must not touch it.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::sys;

use super::driver::{self, check, code, guard, lock_cache, may_block, Cu};
use crate::error::{Error, Result};

#[derive(Debug)]
pub(crate) struct Probe {
    /// Process that ran the probe (and, when `init_rc == Some(0)`, initialised CUDA).
    pub pid: u32,
    pub lib_present: bool,
    /// Where libcuda was mapped from (diagnoses a stub or compat library shadowing the driver).
    pub lib_path: Option<String>,
    pub init_rc: Option<i32>,
    pub driver_version: i32,
    pub devices: Vec<DeviceInfo>,
    /// Why CUDA cannot be used, when it cannot.
    pub problem: Option<String>,
}

#[derive(Debug)]
pub(crate) struct DeviceInfo {
    pub name: String,
    pub cc: (i32, i32),
    pub unified_addressing: bool,
}

impl Probe {
    pub fn initialised(&self) -> bool {
        self.init_rc == Some(0)
    }
}

/// Against the GIL: a leaf lock in code that never calls Python, so it is never held while the
/// GIL is waited for (design.md, "Locks and the GIL").
static PROBE: Mutex<Option<Arc<Probe>>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave the data half-updated (every update
    // is a single insert), so a poisoned lock is still good to use.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The cached probe, running it on first use. In a forked child of a process whose probe did
/// not initialise CUDA, the probe runs again (the child may use CUDA itself).
pub(crate) fn probe() -> Arc<Probe> {
    let mut slot = lock(&PROBE);
    let pid = std::process::id();
    if let Some(p) = slot.as_ref() {
        if p.pid == pid || p.initialised() {
            return p.clone();
        }
    }
    let p = Arc::new(run_probe(pid));
    *slot = Some(p.clone());
    p
}

fn forked_error(p: &Probe) -> Error {
    Error::cuda_unavailable(format!(
        "CUDA was initialised in process {} and this is a forked child (pid {}); CUDA cannot be \
         used after fork. Start worker processes with the 'spawn' method instead.",
        p.pid,
        std::process::id()
    ))
}

/// The probe if CUDA is usable by this process, else why not.
pub(crate) fn ready() -> Result<Arc<Probe>> {
    let p = probe();
    if p.initialised() && p.pid != std::process::id() {
        return Err(forked_error(&p));
    }
    match &p.problem {
        None => Ok(p),
        Some(why) => Err(Error::cuda_unavailable(why.clone())),
    }
}

/// True when the probe already ran in this process (so `ready()` will not call the driver).
/// Never waits: a probe running on another thread (holding the lock) counts as "not yet".
pub(crate) fn probed_here() -> bool {
    match PROBE.try_lock() {
        Ok(g) => g
            .as_ref()
            .is_some_and(|p| p.pid == std::process::id() || p.initialised()),
        Err(std::sync::TryLockError::Poisoned(p)) => p
            .into_inner()
            .as_ref()
            .is_some_and(|p| p.pid == std::process::id() || p.initialised()),
        Err(std::sync::TryLockError::WouldBlock) => false,
    }
}

/// True when CUDA state exists in this process (so there may be device errors to report).
pub(crate) fn initialised_here() -> bool {
    lock(&PROBE)
        .as_ref()
        .is_some_and(|p| p.initialised() && p.pid == std::process::id())
}

/// Driver library files mapped in this process (`libcuda.so*` in /proc/self/maps), one path per
/// distinct file (symlinks resolved: (device, inode) identifies a file).
fn mapped_drivers() -> Vec<(String, (u64, u64))> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return Vec::new();
    };
    let mut out: Vec<(String, (u64, u64))> = Vec::new();
    for path in maps.lines().filter_map(|l| l.split_whitespace().nth(5)) {
        let is_driver = path
            .rsplit('/')
            .next()
            .is_some_and(|f| f.starts_with("libcuda.so"));
        if !is_driver {
            continue;
        }
        if let Ok(m) = std::fs::metadata(path) {
            let id = (m.dev(), m.ino());
            if !out.iter().any(|(_, other)| *other == id) {
                out.push((path.to_string(), id));
            }
        }
    }
    out
}

fn file_id(path: &str) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// The file the driver library cudarc loaded was mapped from (`dladdr` of its `cuInit`).
fn loaded_driver_path() -> Option<String> {
    type Init = unsafe extern "C" fn(c_uint) -> c_int;
    // SAFETY: only called once the library was found; `cuInit` has this signature, and only
    // its address is used.
    let f = unsafe { driver::symbol::<Init>(b"cuInit\0") }?;
    // SAFETY: Dl_info is plain data; dladdr fills it for an address inside a loaded object.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(f as *const c_void, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        Some(
            CStr::from_ptr(info.dli_fname)
                .to_string_lossy()
                .into_owned(),
        )
    }
}

/// The file `libcuda.so.1` resolves to: the name the dynamic loader, the CUDA runtime and torch
/// load the driver by. Looked up before cudarc loads its library (cudarc tries `libcuda.so`
/// first, which on some machines is a toolkit stub or a compat copy, not the driver), and
/// unloaded again unless something else holds it.
fn system_driver_path() -> Option<String> {
    // SAFETY: dlopen/dlsym/dladdr/dlclose with NUL-terminated names; Dl_info is plain data and
    // only read when dladdr succeeded; the handle is closed once, after its last use.
    unsafe {
        let h = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if h.is_null() {
            return None;
        }
        let sym = libc::dlsym(h, c"cuInit".as_ptr());
        let mut info: libc::Dl_info = std::mem::zeroed();
        let path =
            (!sym.is_null() && libc::dladdr(sym, &mut info) != 0 && !info.dli_fname.is_null())
                .then(|| {
                    CStr::from_ptr(info.dli_fname)
                        .to_string_lossy()
                        .into_owned()
                });
        libc::dlclose(h);
        path
    }
}

/// The library cudarc loaded must be the file `libcuda.so.1` names, when that exists.
fn check_system_driver(system: Option<&str>, ours: &str) -> Option<String> {
    let system = system?;
    if file_id(system)? == file_id(ours)? {
        return None;
    }
    Some(format!(
        "hostkv_rs's CUDA binding loaded {ours} (it tries libcuda.so first), but libcuda.so.1, \
         the driver the CUDA runtime and torch load, is {system}: a different file. Two driver \
         libraries in one process would make each one's contexts and pointers invalid in the \
         other, so hostkv_rs refuses to use CUDA. Usually a toolkit stub libcuda.so or a \
         cuda-compat directory on LD_LIBRARY_PATH shadows the real driver: remove it, or put the \
         driver's directory first"
    ))
}

/// One driver per process: the library cudarc loaded must be the one already mapped (torch's, or
/// any other user's), else contexts, streams and pointers of one are meaningless to the other.
/// `before` is what was mapped before cudarc loaded its library.
fn check_one_driver(before: &[(String, (u64, u64))], ours: &str) -> Option<String> {
    let our_id = file_id(ours)?;
    let other = before
        .iter()
        .chain(mapped_drivers().iter())
        .find(|(_, id)| *id != our_id)
        .map(|(path, _)| path.clone())?;
    Some(format!(
        "two different CUDA driver libraries in one process: hostkv_rs loaded {ours}, but {other} \
         is mapped too (loaded by torch or another library). Objects of one driver are invalid \
         in the other, so hostkv_rs refuses to use CUDA. Usually a toolkit stub libcuda.so or a \
         cuda-compat directory on LD_LIBRARY_PATH shadows the real driver: remove it, or put the \
         driver's directory first"
    ))
}

fn run_probe(pid: u32) -> Probe {
    let mut p = Probe {
        pid,
        lib_present: false,
        lib_path: None,
        init_rc: None,
        driver_version: 0,
        devices: Vec::new(),
        problem: None,
    };
    let before = mapped_drivers();
    let system = system_driver_path();
    // SAFETY: a pure dlopen probe (cudarc >= 0.19.5); it never panics.
    p.lib_present = unsafe { sys::is_culib_present() };
    if !p.lib_present {
        p.problem = Some(
            "CUDA driver library (libcuda.so) not found: no NVIDIA driver on this machine".into(),
        );
        return p;
    }
    // Before cuInit: never initialise a second driver next to the process's own.
    let ours = guard("CUDA probe", || Ok(loaded_driver_path()))
        .ok()
        .flatten();
    p.lib_path = ours
        .clone()
        .or_else(|| mapped_drivers().first().map(|(path, _)| path.clone()));
    let why = ours.as_deref().and_then(|o| {
        check_system_driver(system.as_deref(), o).or_else(|| check_one_driver(&before, o))
    });
    if let Some(why) = why {
        p.problem = Some(why);
        return p;
    }
    if let Err(e) = guard("CUDA probe", || {
        query_driver(&mut p);
        Ok(())
    }) {
        p.problem = Some(e.to_string());
    }
    p
}

fn query_driver(p: &mut Probe) {
    // SAFETY: plain driver queries with valid out-pointers, after the library was found.
    unsafe {
        let mut v: c_int = 0;
        if sys::cuDriverGetVersion(&mut v) == Cu::CUDA_SUCCESS {
            p.driver_version = v;
        }
        let rc = code(sys::cuInit(0));
        p.init_rc = Some(rc);
        if rc != 0 {
            p.problem = Some(format!("cuInit failed: {}", driver::describe(rc)));
            return;
        }
        let mut n: c_int = 0;
        let rc = code(sys::cuDeviceGetCount(&mut n));
        if rc != 0 {
            p.problem = Some(format!("cuDeviceGetCount failed: {}", driver::describe(rc)));
            return;
        }
        for ordinal in 0..n {
            let mut dev: sys::CUdevice = 0;
            if sys::cuDeviceGet(&mut dev, ordinal) != Cu::CUDA_SUCCESS {
                continue;
            }
            let mut name = [0 as c_char; 256];
            let name = if sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev)
                == Cu::CUDA_SUCCESS
            {
                std::ffi::CStr::from_ptr(name.as_ptr())
                    .to_string_lossy()
                    .into_owned()
            } else {
                "?".into()
            };
            let attr = |a| {
                let mut x: c_int = 0;
                if sys::cuDeviceGetAttribute(&mut x, a, dev) == Cu::CUDA_SUCCESS {
                    x
                } else {
                    0
                }
            };
            use sys::CUdevice_attribute_enum as A;
            p.devices.push(DeviceInfo {
                name,
                cc: (
                    attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                    attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
                ),
                unified_addressing: attr(A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING) != 0,
            });
        }
        if p.devices.is_empty() {
            p.problem = Some("the CUDA driver reports no usable device".into());
        }
    }
}

fn fmt_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

pub(crate) fn describe(p: &Probe) -> String {
    let mut s = String::new();
    if p.initialised() && p.pid != std::process::id() {
        s.push_str(&forked_error(p).to_string());
        return s;
    }
    match &p.problem {
        None => s.push_str("CUDA available"),
        Some(why) => {
            s.push_str("CUDA unavailable: ");
            s.push_str(why);
        }
    }
    if p.lib_present {
        s.push_str(&format!(
            "; driver {} ({})",
            fmt_version(p.driver_version),
            p.driver_version
        ));
        if let Some(path) = &p.lib_path {
            s.push_str(&format!("; libcuda: {path}"));
        }
        if let Some(rc) = p.init_rc {
            s.push_str(&format!("; cuInit rc={rc}"));
        }
        s.push_str(&format!("; {} device(s)", p.devices.len()));
        for (i, d) in p.devices.iter().enumerate() {
            s.push_str(&format!(
                "; [{i}] {} (sm_{}{}{})",
                d.name,
                d.cc.0,
                d.cc.1,
                if d.unified_addressing {
                    ""
                } else {
                    ", no unified addressing"
                }
            ));
        }
    }
    s
}

/// Primary contexts we retained, per device ordinal (kept for the life of the process, like
/// the CUDA runtime does). A leaf lock in code that never calls Python, as `PROBE`.
static PRIMARY: Mutex<Option<HashMap<i32, usize>>> = Mutex::new(None);

/// The primary context of device `ordinal` (the one torch and every CUDA runtime user share),
/// retained on first use.
fn primary(ordinal: c_int) -> Result<sys::CUcontext> {
    let mut guard = lock_cache(&PRIMARY)?;
    let map = guard.get_or_insert_with(HashMap::new);
    if let Some(&c) = map.get(&ordinal) {
        return Ok(c as sys::CUcontext);
    }
    // Retaining may create the context (hundreds of milliseconds).
    may_block()?;
    let mut dev: sys::CUdevice = 0;
    let mut c: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointers.
    unsafe {
        check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
        check(
            sys::cuDevicePrimaryCtxRetain(&mut c, dev),
            "cuDevicePrimaryCtxRetain",
        )?;
    }
    map.insert(ordinal, c as usize);
    Ok(c)
}

/// The device ordinal owning `ptr` (device memory, or memory the driver maps), when the driver
/// can tell.
pub(crate) fn pointer_device(ptr: u64) -> Option<c_int> {
    let mut o: c_int = -1;
    // SAFETY: valid out-pointer for a 32-bit attribute; the driver only looks the address up.
    let rc = unsafe {
        sys::cuPointerGetAttribute(
            (&mut o as *mut c_int).cast(),
            sys::CUpointer_attribute_enum::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    };
    (rc == Cu::CUDA_SUCCESS && o >= 0).then_some(o)
}

/// A context made current on this thread for the length of one call. When it had to be pushed
/// (the thread had no context, or another device's), the thread's previous context is restored
/// on drop, so torch's notion of the current device is never changed behind its back.
pub(crate) struct CtxScope {
    ctx: sys::CUcontext,
    pushed: bool,
}

impl CtxScope {
    pub(crate) fn ctx(&self) -> sys::CUcontext {
        self.ctx
    }

    fn push(ctx: sys::CUcontext) -> Result<Self> {
        // SAFETY: a live (retained primary) context.
        check(unsafe { sys::cuCtxPushCurrent_v2(ctx) }, "cuCtxPushCurrent")?;
        Ok(CtxScope { ctx, pushed: true })
    }
}

impl Drop for CtxScope {
    fn drop(&mut self) {
        if self.pushed {
            let mut prev: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: pops exactly the context `push` made current on this thread.
            let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut prev) };
        }
    }
}

/// Makes the right context current on this thread for one call.
///
/// With `hint` (a device pointer of the transfer): the primary context of the device owning it,
/// which is the context torch allocated it in and the one torch's streams for that device
/// belong to, whatever device is current on this thread. Without: the thread's current context
/// if it has one, else device 0's primary context.
pub(crate) fn bind_context(hint: Option<u64>) -> Result<CtxScope> {
    let mut cur: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; called only when `ready()` succeeded.
    check(unsafe { sys::cuCtxGetCurrent(&mut cur) }, "cuCtxGetCurrent")?;
    let keep_or_push = |target: sys::CUcontext| -> Result<CtxScope> {
        if target == cur {
            Ok(CtxScope {
                ctx: cur,
                pushed: false,
            })
        } else {
            CtxScope::push(target)
        }
    };
    match hint.map(|p| (p, pointer_device(p))) {
        Some((_, Some(ordinal))) => keep_or_push(primary(ordinal)?),
        _ if !cur.is_null() => Ok(CtxScope {
            ctx: cur,
            pushed: false,
        }),
        None => CtxScope::push(primary(0)?),
        Some((ptr, None)) => {
            // No context on this thread, and the driver could not place the pointer without
            // one: ask again with device 0's primary context current.
            let first = CtxScope::push(primary(0)?)?;
            match pointer_device(ptr) {
                Some(o) if o != 0 => {
                    let target = primary(o)?;
                    drop(first);
                    CtxScope::push(target)
                }
                _ => Ok(first),
            }
        }
    }
}

/// Ordinal of the device of the current context.
pub(crate) fn current_device() -> Result<c_int> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: valid out-pointer; a context is current (bind_context ran).
    check(unsafe { sys::cuCtxGetDevice(&mut dev) }, "cuCtxGetDevice")?;
    Ok(dev)
}

/// Makes device `ordinal`'s primary context current for one call (retained once, as above).
/// Used where the device is known from a record (unregistering a range on the device it was
/// registered on), so a thread with no context never falls back to another GPU.
pub(crate) fn bind_device(ordinal: c_int) -> Result<CtxScope> {
    let target = primary(ordinal)?;
    let mut cur: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    check(unsafe { sys::cuCtxGetCurrent(&mut cur) }, "cuCtxGetCurrent")?;
    if cur == target {
        Ok(CtxScope {
            ctx: cur,
            pushed: false,
        })
    } else {
        CtxScope::push(target)
    }
}

type CtxGetId = unsafe extern "C" fn(sys::CUcontext, *mut u64) -> c_int;

/// A key for per-context caches (modules, staging, error records): the context's unique id
/// (`cuCtxGetId`, CUDA 12.0+), which changes when a primary context is reset and re-created at
/// the same address; the handle itself where the driver has no ids.
pub(crate) fn ctx_key(ctx: sys::CUcontext) -> u64 {
    static GET_ID: OnceLock<Option<CtxGetId>> = OnceLock::new();
    // SAFETY: the symbol has this C signature (CUDA 12.0+).
    let f = GET_ID.get_or_init(|| unsafe { driver::symbol::<CtxGetId>(b"cuCtxGetId\0") });
    if let Some(f) = f {
        let mut id = 0u64;
        // SAFETY: valid out-pointer; `ctx` is a live context.
        if unsafe { f(ctx, &mut id) } == 0 {
            return id;
        }
    }
    ctx as usize as u64
}

/// `bytes` of zeroed device memory in the current context. Zeroed on a private non-blocking
/// stream that only this call waits for, so nothing else queued in the context (torch's work,
/// an NCCL kernel) is waited for.
pub(crate) fn device_alloc_zeroed(bytes: usize, what: &str) -> Result<u64> {
    may_block()?;
    let mut d: sys::CUdeviceptr = 0;
    // SAFETY: valid out-pointers; the stream is created, used and destroyed here, and the
    // allocation is freed on any error.
    unsafe {
        check(
            sys::cuMemAlloc_v2(&mut d, bytes),
            &format!("cuMemAlloc ({what})"),
        )?;
        let mut s: sys::CUstream = std::ptr::null_mut();
        let r = check(
            sys::cuStreamCreate(
                &mut s,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint,
            ),
            "cuStreamCreate",
        )
        .and_then(|_| {
            let r = check(
                sys::cuMemsetD8Async(d, 0, bytes, s),
                &format!("cuMemsetD8Async ({what})"),
            )
            .and_then(|_| check(sys::cuStreamSynchronize(s), "cuStreamSynchronize"));
            let _ = sys::cuStreamDestroy_v2(s);
            r
        });
        if let Err(e) = r {
            let _ = sys::cuMemFree_v2(d);
            return Err(e);
        }
    }
    Ok(d)
}

/// Waits for everything queued on device `ordinal` (its primary context). Only a fallback for
/// memory whose queued work could not be tracked by an event (see `registry`): it also waits for
/// other users' streams.
pub(crate) fn synchronize_device(ordinal: c_int) -> Result<()> {
    let _scope = bind_device(ordinal)?;
    // SAFETY: a context is current.
    check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
}

#[cfg(test)]
mod tests {
    use crate::cuda;
    use crate::error::Error;

    #[test]
    fn probe_never_panics_and_explains_itself() {
        let info = cuda::runtime_info();
        assert!(
            info.starts_with("CUDA available") || info.starts_with("CUDA unavailable"),
            "{info}"
        );
        assert_eq!(cuda::available(), info.starts_with("CUDA available"));
        if !cuda::available() {
            assert!(cuda::check_device_errors().is_ok());
            // SAFETY: CUDA is unavailable, so nothing is registered (the address is never used).
            let e = unsafe { cuda::register_host(4096, 4096, 0, 1 << 30, None) }.unwrap_err();
            assert!(
                matches!(e, Error::Cuda(crate::error::CudaError::Unavailable(_))),
                "{e}"
            );
        }
    }
}
