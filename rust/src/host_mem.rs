//! Host memory for the pools: an exact-size anonymous mapping, optionally on hugepages and bound
//! to a NUMA node, pre-faulted in parallel so that CUDA registration pins real pages, and unmapped
//! on drop.
//!
//! Never torch's pinned allocator: it rounds blocks up to a power of two.
//!
//! Departure from SGLang: its `alloc_mmap` maps `MAP_SHARED|MAP_ANONYMOUS` (shmem). Without an
//! explicit hugetlb size we map `MAP_PRIVATE|MAP_ANONYMOUS` instead, because private anonymous
//! memory faults in ~1.5x faster than shmem and can get transparent hugepages (`MADV_HUGEPAGE`,
//! THP `madvise`/`always`), where shmem THP is usually `never`: 3.5x faster to populate on the
//! development VM. Nothing shares the pool with another process (the pools hand out no file
//! descriptor, `pool.fd` is None), so the only observable difference is at `fork`: an unpinned
//! region is inherited copy-on-write (the child reads the parent's bytes; writes are not shared),
//! and a region registered with CUDA is `MADV_DONTFORK` while registered (see `set_dontfork`), so
//! a child does not have it at all. The explicit hugetlb ladder
//! (`hugepage="2MB"/"1GB"`) keeps SGLang's shared mapping.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::error::{Error, MemError, Result};

const BASE_PAGE: usize = 4096;
const MB2: usize = 2 << 20;
const GB1: usize = 1 << 30;
/// `MADV_POPULATE_WRITE` (Linux >= 5.14); not in every libc crate version.
const MADV_POPULATE_WRITE: libc::c_int = 23;
const MPOL_BIND: libc::c_long = 2;
/// Bytes each pre-touch thread should get at least. A thread costs tens of microseconds to start;
/// 4 MiB takes ~0.4-1.5 ms to fault in, so splitting pays from about twice this size (measured:
/// docs/benchmarks.md, pool creation).
const PRETOUCH_BYTES_PER_THREAD: usize = 4 << 20;
/// What a pre-touch thread claims at a time.
const PRETOUCH_CHUNK: usize = 2 << 20;

/// Hugepage size asked for (`SGLANG_HUGEPAGE_SIZE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HugePage {
    None,
    Size2M,
    Size1G,
}

impl HugePage {
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "" => Ok(Self::None),
            "2MB" | "2M" | "2mb" => Ok(Self::Size2M),
            "1GB" | "1G" | "1gb" => Ok(Self::Size1G),
            other => Err(Error::unsupported(format!(
                "Unsupported hugepage size: {other:?}; expected '', '2MB' or '1GB'"
            ))),
        }
    }
}

/// `prefer` falls back down the ladder; `required` fails unless the hugetlb pages were obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HugePageMode {
    Prefer,
    Required,
}

impl HugePageMode {
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "prefer" | "" | "off" => Ok(Self::Prefer),
            "required" | "strict" => Ok(Self::Required),
            other => Err(Error::unsupported(format!(
                "Unsupported hugepage mode: {other:?}; expected 'prefer' or 'required'"
            ))),
        }
    }
}

/// The kind of pages a region actually got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Huge1G,
    Huge2M,
    Thp,
    Base,
    /// Memory someone else allocated (a storage backend's segment): never mapped or unmapped
    /// here.
    Adopted,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Self::Huge1G => "1GB",
            Self::Huge2M => "2MB",
            Self::Thp => "thp",
            Self::Base => "base",
            Self::Adopted => "adopted",
        }
    }

    fn page_bytes(self) -> usize {
        match self {
            Self::Huge1G => GB1,
            Self::Huge2M | Self::Thp => MB2,
            Self::Base | Self::Adopted => BASE_PAGE,
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct RegionOptions {
    pub hugepage: HugePage,
    pub mode: HugePageMode,
    pub numa_node: Option<u32>,
    /// 0 = choose from the region size and the CPU count.
    pub pretouch_threads: usize,
}

impl Default for RegionOptions {
    fn default() -> Self {
        Self {
            hugepage: HugePage::None,
            mode: HugePageMode::Prefer,
            numa_node: None,
            pretouch_threads: 0,
        }
    }
}

/// A page-aligned host mapping of exactly `len()` usable bytes.
pub struct HostRegion {
    ptr: *mut u8,
    nbytes: usize,
    /// Bytes actually mapped (rounded up to the page size of the tier, plus nothing else).
    map_len: usize,
    /// The tier mapped for; `Thp` means "advised for THP", resolved by `tier()`.
    tier: Tier,
    /// What the kernel actually gave a THP-advised region, read from smaps on first request
    /// (reading smaps walks every mapping of the process: too slow for every creation).
    thp_obtained: OnceLock<Tier>,
    /// Private mapping (not the hugetlb tiers): `MADV_DONTFORK` while registered with CUDA.
    private: bool,
    owner_pid: libc::pid_t,
    numa_node: Option<u32>,
    registered: Mutex<Vec<(u64, usize)>>,
    /// Given up on (its unpin timed out once already): dropping it neither waits again nor
    /// frees anything.
    leaked: std::sync::atomic::AtomicBool,
}

// SAFETY: the only non-Send field is the raw pointer to the mapping this value owns (unmapped
// once, by `Drop`); no Rust reference into it is ever handed out, so moving the owner to another
// thread moves nothing that is tied to this one.
unsafe impl Send for HostRegion {}
// SAFETY: shared access reads plain fields and the registration list behind its mutex; the
// mapped bytes are reached only through raw pointers (the engines, Python's buffer), whose users
// synchronise among themselves.
unsafe impl Sync for HostRegion {}

fn errno_text() -> String {
    std::io::Error::last_os_error().to_string()
}

fn round_up(n: usize, to: usize) -> Option<usize> {
    n.checked_add(to - 1).map(|v| v / to * to)
}

/// `mmap(MAP_SHARED|MAP_ANONYMOUS|extra)` of `len` bytes, or the errno text (the hugetlb tiers).
fn map(len: usize, extra: libc::c_int) -> std::result::Result<*mut u8, String> {
    // SAFETY: anonymous mapping at a kernel-chosen address; no existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS | extra,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        Err(errno_text())
    } else {
        Ok(p as *mut u8)
    }
}

/// # Safety
/// `[ptr, ptr+len)` is (part of) a mapping this module created, that nothing uses any more and
/// nobody else unmaps.
unsafe fn unmap(ptr: *mut u8, len: usize) {
    if len > 0 {
        // SAFETY: the caller's promise: our own mapping, unused from now on.
        unsafe { libc::munmap(ptr as *mut libc::c_void, len) };
    }
}

/// Whether `madvise(MADV_HUGEPAGE)` can give private anonymous memory transparent hugepages.
fn anon_thp_possible() -> bool {
    let Ok(s) = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled") else {
        return false;
    };
    let selected = s
        .split('[')
        .nth(1)
        .and_then(|r| r.split(']').next())
        .unwrap_or("");
    matches!(selected, "always" | "madvise")
}

/// `MADV_DONTFORK` on (or `MADV_DOFORK` off) for a registered private range.
///
/// A child forked from a private mapping shares the parent's pages copy-on-write; the parent's
/// next write moves the parent to a fresh copy while the CUDA registration (and every DMA into the
/// pool) still targets the old physical page, which now belongs to the child: transfers would
/// silently land in, or come from, memory the parent no longer sees. So a pinned range is not
/// inherited at all; an unpinned one is inherited copy-on-write, which is harmless.
fn set_dontfork(ptr: *mut u8, len: usize, on: bool) -> std::result::Result<(), String> {
    let advice = if on {
        libc::MADV_DONTFORK
    } else {
        libc::MADV_DOFORK
    };
    // SAFETY: advising a range of our own mapping.
    if unsafe { libc::madvise(ptr as *mut libc::c_void, len, advice) } != 0 {
        return Err(errno_text());
    }
    Ok(())
}

/// `MAP_PRIVATE|MAP_ANONYMOUS` of `len` bytes (a multiple of the base page) and, with `thp`,
/// 2 MiB-aligned (THP needs the alignment) and advised `MADV_HUGEPAGE`.
/// Returns the start and whether the THP advice was taken.
fn map_private(len: usize, thp: bool) -> std::result::Result<(*mut u8, bool), String> {
    let over = if thp { len.checked_add(MB2) } else { Some(len) };
    let over = over.ok_or_else(|| "size overflows".to_string())?;
    // SAFETY: anonymous mapping at a kernel-chosen address; no existing memory is touched.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            over,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(errno_text());
    }
    let raw = raw as *mut u8;
    let p = if thp {
        // `over` is mapped, so rounding inside it cannot overflow.
        let start = (raw as usize).div_ceil(MB2) * MB2;
        let head = start - raw as usize;
        // SAFETY: the slack before and after the aligned `len` bytes, inside the `over` bytes
        // just mapped and not handed out.
        unsafe {
            unmap(raw, head);
            unmap((start + len) as *mut u8, over - head - len);
        }
        start as *mut u8
    } else {
        raw
    };
    // Only advice: a kernel that refuses it leaves base pages, reported as such.
    // SAFETY: advising our own mapping.
    let advised =
        thp && unsafe { libc::madvise(p as *mut libc::c_void, len, libc::MADV_HUGEPAGE) } == 0;
    Ok((p, advised))
}

/// kB of transparent hugepages backing mappings that overlap `[addr, addr+len)` (smaps'
/// `AnonHugePages`). A neighbouring region the kernel merged into the same mapping counts too;
/// that only matters for telling "thp" from "base", where both are THP-advised alike.
fn anon_huge_kb(addr: usize, len: usize) -> u64 {
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
        return 0;
    };
    let mut inside = false;
    let mut kb = 0;
    for l in smaps.lines() {
        let first = l.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                inside = a < addr + len && addr < b;
                continue;
            }
        }
        if inside && first == "AnonHugePages:" {
            kb += l
                .split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    kb
}

fn mbind(ptr: *mut u8, len: usize, node: u32) -> Result<()> {
    if !std::path::Path::new(&format!("/sys/devices/system/node/node{node}")).exists() {
        return Err(Error::unsupported(format!(
            "NUMA node {node} does not exist on this host (see /sys/devices/system/node)"
        )));
    }
    let words = node as usize / 64 + 1;
    let mut mask = vec![0u64; words];
    mask[node as usize / 64] |= 1u64 << (node % 64);
    // The kernel reads `maxnode - 1` bits, hence the +1 (as libnuma does).
    let maxnode = (words * 64 + 1) as libc::c_ulong;
    // SAFETY: mbind on our own mapping with a mask buffer of `words` u64s.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            ptr as *mut libc::c_void,
            len as libc::c_ulong,
            MPOL_BIND,
            mask.as_ptr(),
            maxnode,
            0 as libc::c_uint,
        )
    };
    if rc != 0 {
        return Err(MemError::Bind {
            bytes: len as u64,
            node,
            os: errno_text(),
        }
        .into());
    }
    Ok(())
}

fn auto_threads(len: usize) -> usize {
    // Faulting is CPU work in the kernel (zeroing pages, page-table updates), so it scales with
    // cores until memory bandwidth runs out.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    cpus.min(16).min(len / PRETOUCH_BYTES_PER_THREAD).max(1)
}

/// Faults in `[ptr, ptr+len)` for writing in `page`-aligned chunks, on this thread and
/// `threads - 1` helpers. Uses `MADV_POPULATE_WRITE` where the kernel has it
/// (it reports ENOMEM instead of raising SIGBUS), else one zero write per page; never both on the
/// same range.
///
/// # Safety
/// `[ptr, ptr+len)` is a writable mapping of this module's whose content is still all zeros
/// (the fallback writes zeros into it, from several threads) and that nothing else uses yet.
unsafe fn pretouch(ptr: *mut u8, len: usize, page: usize, threads: usize) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let pages = len.div_ceil(page);
    let threads = threads.clamp(1, pages);
    // Small chunks (one 2 MiB hugepage, or 2 MiB of base pages): a helper that loses its CPU
    // (a busy or higher-priority process on the other core) holds up the end by one chunk only.
    let per_pages = if threads == 1 {
        pages
    } else {
        PRETOUCH_CHUNK.div_ceil(page)
    };
    let per = per_pages * page;
    let base = ptr as usize;
    let chunk = |k: usize| -> (usize, usize) {
        let lo = (k * per).min(len);
        (base + lo, (len - lo).min(per))
    };
    let work = |(start, n): (usize, usize)| -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        // SAFETY: populating our own mapping.
        let rc = unsafe { libc::madvise(start as *mut libc::c_void, n, MADV_POPULATE_WRITE) };
        if rc == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EINVAL) {
            // Kernel without MADV_POPULATE_WRITE: fault each page by writing a zero (the page is
            // already zero, so this changes no content).
            let mut off = 0;
            while off < n {
                // SAFETY: `start+off` lies inside the caller's writable, unused, zero mapping
                // (`off < n`, chunk inside `[ptr, ptr+len)`); each chunk is one thread's, and
                // writing the zero it already holds changes nothing.
                unsafe { std::ptr::write_volatile((start + off) as *mut u8, 0) };
                off += BASE_PAGE.min(page);
            }
            return Ok(());
        }
        Err(MemError::Prefault {
            bytes: n as u64,
            os: err.to_string(),
        }
        .into())
    };
    let chunks = len.div_ceil(per);
    if threads == 1 || chunks == 1 {
        return work(chunk(0));
    }
    // Chunks are claimed one at a time, so a helper that gets no CPU in time (busy machine)
    // delays the whole only by the one chunk it took. Fresh scoped threads, not the copy engine's
    // workers: populating from a long-lived pool worker ran ~20x slower inside a Python process
    // here (not understood), and a thread start (~50 us) is small next to a 4 MiB chunk.
    let next = AtomicUsize::new(0);
    let claim = || -> Result<()> {
        loop {
            let k = next.fetch_add(1, Ordering::Relaxed);
            if k >= chunks {
                return Ok(());
            }
            work(chunk(k))?;
        }
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = (1..threads.min(chunks))
            .filter_map(|_| std::thread::Builder::new().spawn_scoped(s, claim).ok())
            .collect();
        let mut result = claim();
        for h in handles {
            let r = h
                .join()
                .unwrap_or_else(|_| Err(MemError::PretouchThread.into()));
            if result.is_ok() {
                result = r;
            }
        }
        result
    })
}

impl HostRegion {
    /// A region over memory another allocator owns (SGLang's shm, Mooncake, mori or TensorCast
    /// segments), so it can be registered with CUDA, looked up by transfers and unregistered
    /// with the same bounded wait as the regions mapped here. It never unmaps anything.
    ///
    /// # Safety
    /// `[addr, addr + nbytes)` must stay allocated, and not be registered with CUDA by anyone
    /// else, for as long as the region lives, and longer if its unregistration times out
    /// ([`HostRegion::leak`] says when).
    pub unsafe fn adopt(addr: u64, nbytes: usize) -> Self {
        Self {
            ptr: addr as *mut u8,
            nbytes,
            map_len: 0,
            tier: Tier::Adopted,
            thp_obtained: OnceLock::new(),
            private: false,
            // SAFETY: getpid has no preconditions.
            owner_pid: unsafe { libc::getpid() },
            numa_node: None,
            registered: Mutex::new(Vec::new()),
            leaked: Default::default(),
        }
    }

    /// For a region whose unpin timed out where nobody can retry it (its owner is being
    /// dropped): the GPU may still write there, so dropping it then frees nothing (the mapping,
    /// or for adopted memory its owner, is leaked) and does not wait a second time.
    pub fn leak(&self) {
        self.leaked
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Maps `nbytes` (0 allowed: no mapping, address 0) as `opts` asks.
    pub fn new(nbytes: usize, opts: RegionOptions) -> Result<Self> {
        if opts.mode == HugePageMode::Required && opts.hugepage == HugePage::None {
            // Nothing to require: base pages would pass silently for a caller who asked for
            // hugepages.
            return Err(Error::unsupported(
                "hugepage_mode 'required' needs a hugepage size ('2MB' or '1GB')",
            ));
        }
        let mut region = Self {
            ptr: std::ptr::null_mut(),
            nbytes,
            map_len: 0,
            tier: Tier::Base,
            thp_obtained: OnceLock::new(),
            private: false,
            // SAFETY: getpid has no preconditions.
            owner_pid: unsafe { libc::getpid() },
            numa_node: opts.numa_node,
            registered: Mutex::new(Vec::new()),
            leaked: Default::default(),
        };
        if nbytes == 0 {
            return Ok(region);
        }
        let (ptr, map_len, tier) = Self::map_ladder(nbytes, &opts)?;
        region.ptr = ptr;
        region.map_len = map_len;
        region.tier = tier;
        region.private = matches!(tier, Tier::Thp | Tier::Base);
        // From here on `region`'s Drop unmaps on any error.
        if let Some(node) = opts.numa_node {
            mbind(ptr, map_len, node)?;
        }
        let threads = if opts.pretouch_threads == 0 {
            auto_threads(map_len)
        } else {
            opts.pretouch_threads
        };
        // SAFETY: the fresh mapping of `map_len` bytes made above: writable, all zeros, owned by
        // `region` and not handed out yet.
        unsafe { pretouch(ptr, map_len, tier.page_bytes(), threads)? };
        Ok(region)
    }

    fn map_ladder(nbytes: usize, opts: &RegionOptions) -> Result<(*mut u8, usize, Tier)> {
        let too_big = || {
            Error::from(MemError::Overflow {
                bytes: nbytes as u64,
            })
        };
        let huge = match opts.hugepage {
            HugePage::None => None,
            HugePage::Size2M => Some((MB2, libc::MAP_HUGE_2MB, Tier::Huge2M)),
            HugePage::Size1G => Some((GB1, libc::MAP_HUGE_1GB, Tier::Huge1G)),
        };
        if let Some((size, bits, tier)) = huge {
            // hugetlb mappings are whole hugepages; the usable size stays `nbytes`.
            let len = round_up(nbytes, size).ok_or_else(too_big)?;
            match map(len, libc::MAP_HUGETLB | bits) {
                Ok(p) => return Ok((p, len, tier)),
                Err(e) if opts.mode == HugePageMode::Required => {
                    return Err(MemError::Hugepages {
                        bytes: nbytes as u64,
                        tier: tier.name(),
                        os: e.to_string(),
                    }
                    .into());
                }
                Err(_) => {}
            }
        }
        let len = round_up(nbytes, BASE_PAGE).ok_or_else(too_big)?;
        // Regions smaller than one hugepage cannot get one; they stay unaligned and unadvised.
        let thp = len >= MB2 && anon_thp_possible();
        let (p, advised) = map_private(len, thp).map_err(|e| {
            Error::from(MemError::Map {
                bytes: nbytes as u64,
                os: e.to_string(),
            })
        })?;
        Ok((p, len, if advised { Tier::Thp } else { Tier::Base }))
    }

    /// Start address (0 for an empty region).
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Usable bytes: exactly what was asked for.
    pub fn len(&self) -> usize {
        self.nbytes
    }

    pub fn is_empty(&self) -> bool {
        self.nbytes == 0
    }

    /// Bytes mapped (a whole number of pages of the tier).
    pub fn mapped_len(&self) -> usize {
        self.map_len
    }

    /// The pages the region got. A THP-advised region reports `Thp` only if the kernel actually
    /// backs part of it with transparent hugepages (checked once, on first request), else `Base`.
    pub fn tier(&self) -> Tier {
        if self.tier != Tier::Thp {
            return self.tier;
        }
        *self.thp_obtained.get_or_init(|| {
            if anon_huge_kb(self.ptr as usize, self.map_len) > 0 {
                Tier::Thp
            } else {
                Tier::Base
            }
        })
    }

    pub fn numa_node(&self) -> Option<u32> {
        self.numa_node
    }

    /// Lock order against the GIL: taken only without the GIL (registration and unregistration
    /// run detached, and the Python getters detach before they read), because a registration
    /// holds it for seconds.
    fn ranges(&self) -> std::sync::MutexGuard<'_, Vec<(u64, usize)>> {
        // A poisoned lock only means another thread panicked while holding it; the list is
        // still a valid list.
        self.registered.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this is a forked child of the process that made the region: the registrations
    /// are the parent's, and the range lock may be held by a thread that was not forked.
    fn forked(&self) -> bool {
        // SAFETY: getpid has no preconditions.
        (unsafe { libc::getpid() }) != self.owner_pid
    }

    /// The ranges registered with CUDA by this process (none in a forked child).
    pub fn registered_ranges(&self) -> Vec<(u64, usize)> {
        if self.forked() {
            return Vec::new();
        }
        self.ranges().clone()
    }

    pub fn pinned(&self) -> bool {
        !self.forked() && !self.ranges().is_empty()
    }

    /// Registers the region with CUDA (chunks of `granularity` multiples, at most `chunk_limit`)
    /// in `device`'s context (None: the thread's current one, else device 0's). A second call
    /// while registered does nothing.
    pub fn register_cuda(
        &self,
        granularity: usize,
        chunk_limit: usize,
        device: Option<i32>,
    ) -> Result<()> {
        if !crate::cuda::available() {
            return Err(Error::cuda_unavailable(format!(
                "cannot register host memory with CUDA: CUDA is not available ({})",
                crate::cuda::runtime_info()
            )));
        }
        if self.forked() {
            return Err(Error::cuda_unavailable(
                "cannot register host memory with CUDA in a forked child of the process that \
                 made it",
            ));
        }
        let mut ranges = self.ranges();
        if !ranges.is_empty() || self.nbytes == 0 {
            return Ok(());
        }
        // Before registering: a fork between the two would leave a pinned copy-on-write range.
        if self.private {
            set_dontfork(self.ptr, self.map_len, true)
                .map_err(|e| MemError::DontFork { os: e.to_string() })?;
        }
        // SAFETY: `[addr, addr+nbytes)` is this region's own mapping, registered once (the lock
        // is held and `ranges` was empty). It stays mapped until `unregister_cuda` succeeds: the
        // drop unmaps only after a successful unregistration and leaks the mapping otherwise.
        let registered = unsafe {
            crate::cuda::register_host(self.addr(), self.nbytes, granularity, chunk_limit, device)
        };
        match registered {
            Ok(registered) => *ranges = registered,
            Err(e) => {
                if self.private {
                    // Best effort: the range stays usable either way, only fork inheritance differs.
                    let _ = set_dontfork(self.ptr, self.map_len, false);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Undoes `register_cuda`; idempotent. Waits (bounded, without needing the GIL: call it
    /// detached) for the transfers still queued on the region; when that wait runs out the
    /// region stays registered and the error says why (a later call tries again).
    pub fn unregister_cuda(&self) -> Result<()> {
        if self.forked() {
            // The registration is the parent's to undo (a child cannot use CUDA).
            return Ok(());
        }
        // Not holding the lock while waiting: `pinned()` and friends stay answerable.
        let taken = self.ranges().clone();
        if taken.is_empty() {
            return Ok(());
        }
        crate::cuda::unregister_host(&taken)?;
        {
            let mut ranges = self.ranges();
            if *ranges == taken {
                ranges.clear();
            }
        }
        if self.private {
            let _ = set_dontfork(self.ptr, self.map_len, false);
        }
        Ok(())
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        if self.leaked.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        if self.forked() {
            // A forked child: the CUDA registration is the parent's (and CUDA is unusable here),
            // and the range lock may be held by a thread that was not forked, so neither is
            // touched. A private range is either absent (it was pinned, so `MADV_DONTFORK`) or a
            // copy-on-write copy that dies with the child; the struct cannot tell which, and
            // unmapping an absent range could hit something the child mapped there since. A
            // shared (hugetlb) mapping is this child's own: unmapped unless it is, or may be,
            // pinned.
            let unpinned = matches!(self.registered.try_lock(), Ok(r) if r.is_empty());
            if self.private || self.tier == Tier::Adopted || !unpinned {
                return;
            }
        } else if self.unregister_cuda().is_err() || self.tier == Tier::Adopted {
            // Work queued on the region did not finish in time (logged by the CUDA path): the
            // GPU may still write here, so the pages stay pinned and mapped (leaked) rather than
            // freed under a running DMA. Adopted memory is its owner's to free.
            return;
        }
        // SAFETY: this region's own mapping (`map_len` bytes, none for an empty region), now
        // unpinned; the region is being dropped, so nothing uses it any more.
        unsafe { unmap(self.ptr, self.map_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (start, end) of the mapping containing `addr` in /proc/self/maps, if any.
    fn mapping_at(addr: u64) -> Option<(u64, u64)> {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines().find_map(|l| {
            let range = l.split_whitespace().next()?;
            let (a, b) = range.split_once('-')?;
            let (a, b) = (
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            );
            (a <= addr && addr < b).then_some((a, b))
        })
    }

    /// Resident kB of `[addr, addr+len)`, page by page (mincore). Private mappings of equal flags
    /// can merge with a neighbour, so the smaps entry of a region may be larger than the region.
    fn resident_kb(addr: u64, len: usize) -> u64 {
        let pages = len.div_ceil(4096);
        let mut vec = vec![0u8; pages];
        // SAFETY: mincore only looks the range up and writes one byte per page into `vec`.
        let rc = unsafe { libc::mincore(addr as *mut libc::c_void, len, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().filter(|&&v| v & 1 != 0).count() as u64 * 4
    }

    fn free_hugepages() -> u64 {
        let info = std::fs::read_to_string("/proc/meminfo").unwrap();
        info.lines()
            .find(|l| l.starts_with("HugePages_Free:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    #[test]
    fn exact_size_page_aligned_and_pretouched_zeros() {
        let n = 3 * 4096 + 123;
        let r = HostRegion::new(n, RegionOptions::default()).unwrap();
        assert_eq!(r.len(), n);
        assert_eq!(r.addr() % 4096, 0);
        assert_eq!(r.tier(), Tier::Base);
        assert_eq!(r.mapped_len(), 4 * 4096);
        let (a, b) = mapping_at(r.addr()).unwrap();
        assert!(a <= r.addr() && r.addr() + r.mapped_len() as u64 <= b);
        // Pre-touched: every page resident before anyone wrote to it.
        assert_eq!(resident_kb(r.addr(), r.mapped_len()), 16);
        // SAFETY: the region's `n` mapped bytes, alive while `r` is and written by nobody.
        let bytes = unsafe { std::slice::from_raw_parts(r.as_ptr(), n) };
        assert!(bytes.iter().all(|&b| b == 0));
    }

    #[test]
    fn parallel_pretouch_faults_every_page() {
        let n = (8 << 20) + 5 * 4096;
        let r = HostRegion::new(
            n,
            RegionOptions {
                pretouch_threads: 3,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(resident_kb(r.addr(), n), (n / 1024) as u64);
        // SAFETY: the region's `n` mapped bytes, alive while `r` is and written by nobody.
        let bytes = unsafe { std::slice::from_raw_parts(r.as_ptr(), n) };
        assert!(bytes.iter().all(|&b| b == 0));
    }

    #[test]
    fn manual_touch_fallback_faults_every_page() {
        // Same mapping, forced through the write-a-zero path.
        let n = 9 * 4096;
        let p = map(n, 0).unwrap();
        for (start, len) in [(p as usize, 4 * 4096), (p as usize + 4 * 4096, 5 * 4096)] {
            let mut off = 0;
            while off < len {
                // SAFETY: inside the fresh `n`-byte mapping `p` (zeros; writing one changes
                // nothing).
                unsafe { std::ptr::write_volatile((start + off) as *mut u8, 0) };
                off += BASE_PAGE;
            }
        }
        assert_eq!(resident_kb(p as u64, n), 36);
        // SAFETY: the test's own mapping, no longer used.
        unsafe { unmap(p, n) };
    }

    #[test]
    fn drop_unmaps() {
        let n = 17 * 4096 + 1;
        let r = HostRegion::new(n, RegionOptions::default()).unwrap();
        let addr = r.addr();
        assert!(mapping_at(addr).is_some());
        drop(r);
        // Another test thread may map new memory here, but not a mapping of the same extent.
        if let Some((a, b)) = mapping_at(addr) {
            assert!(!(a == addr && b == addr + 18 * 4096), "still mapped");
        }
    }

    #[test]
    fn zero_bytes_maps_nothing() {
        let r = HostRegion::new(
            0,
            RegionOptions {
                hugepage: HugePage::Size2M,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!((r.addr(), r.len(), r.mapped_len()), (0, 0, 0));
        assert!(!r.pinned());
        r.unregister_cuda().unwrap();
    }

    #[test]
    fn hugepage_prefer_reports_the_tier_obtained() {
        let n = 3 << 20;
        let r = HostRegion::new(
            n,
            RegionOptions {
                hugepage: HugePage::Size2M,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(r.len(), n);
        match r.tier() {
            Tier::Huge2M => assert_eq!(r.mapped_len(), 4 << 20),
            Tier::Adopted => panic!("a mapped region"),
            Tier::Thp => {
                assert!(anon_thp_possible());
                assert_eq!(r.addr() % MB2 as u64, 0);
                assert!(anon_huge_kb(r.addr() as usize, r.mapped_len()) >= 2048);
            }
            // Without hugetlb pages the THP advice may still yield base pages (fragmented
            // memory): the region must then say so rather than claim "thp".
            Tier::Base => {
                assert!(free_hugepages() < 2);
                assert_eq!(anon_huge_kb(r.addr() as usize, r.mapped_len()), 0);
            }
            Tier::Huge1G => panic!("asked for 2MB"),
        }
        // SAFETY: the region's `n` mapped bytes, alive while `r` is and written by nobody.
        let bytes = unsafe { std::slice::from_raw_parts(r.as_ptr(), n) };
        assert!(bytes.iter().all(|&b| b == 0));
    }

    #[test]
    fn hugepage_required_errors_without_hugepages() {
        let opts = RegionOptions {
            hugepage: HugePage::Size1G,
            mode: HugePageMode::Required,
            ..Default::default()
        };
        match HostRegion::new(1 << 20, opts) {
            Ok(r) => assert_eq!(r.tier(), Tier::Huge1G),
            Err(e) => {
                assert!(matches!(e, Error::Mem(_)));
                assert!(e.to_string().contains("1GB hugepages"), "{e}");
            }
        }
    }

    #[test]
    fn thp_mapping_is_aligned_and_exact() {
        let len = 5 << 20;
        let (p, advised) = map_private(len, true).unwrap();
        assert_eq!(p as usize % MB2, 0);
        // The alignment slack is given back: exactly `len` bytes stay mapped.
        assert_eq!(
            mapping_at(p as u64 + len as u64 - 1).map(|(_, b)| b >= p as u64 + len as u64),
            Some(true)
        );
        if anon_thp_possible() {
            assert!(advised);
        }
        // SAFETY: the test's own mapping, no longer used.
        unsafe { unmap(p, len) };
    }

    /// True iff `VmFlags` of the mapping at `addr` has `flag` (two letters, see proc(5)).
    fn vm_flag(addr: u64, flag: &str) -> bool {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for l in smaps.lines() {
            let first = l.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = first.split_once('-') {
                if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                    inside = a <= addr && addr < b;
                    continue;
                }
            }
            if inside && first == "VmFlags:" {
                return l.split_whitespace().skip(1).any(|f| f == flag);
            }
        }
        panic!("no smaps entry at {addr:#x}");
    }

    #[test]
    fn default_region_is_private_and_inherited_only_while_unpinned() {
        for n in [64 << 10, 6 << 20] {
            let r = HostRegion::new(n, RegionOptions::default()).unwrap();
            // No "sh": private. No "dc": an unpinned region is inherited copy-on-write.
            assert!(!vm_flag(r.addr(), "sh"), "{n}");
            assert!(!vm_flag(r.addr(), "dc"), "{n}");
            if n >= MB2 && anon_thp_possible() {
                assert!(vm_flag(r.addr(), "hg"), "THP not advised");
            }
            // What register_cuda does around a registration ("dc": MADV_DONTFORK).
            set_dontfork(r.as_ptr(), r.map_len, true).unwrap();
            assert!(vm_flag(r.addr(), "dc"), "{n}");
            set_dontfork(r.as_ptr(), r.map_len, false).unwrap();
            assert!(!vm_flag(r.addr(), "dc"), "{n}");
        }
    }

    /// Forks, runs `child` in the child (its exit code is the result), returns whether it was 0.
    fn in_forked_child(child: impl FnOnce() -> bool) -> bool {
        // SAFETY: the child only reads/writes memory, calls mincore and exits with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let ok = child();
            // SAFETY: ends the child at once (no destructors, no atexit handlers).
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child with a valid status pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
    }

    #[test]
    fn forked_child_gets_a_private_copy_of_an_unpinned_region() {
        let r = HostRegion::new(3 << 20, RegionOptions::default()).unwrap();
        // SAFETY: the first byte of the live region, used by nobody else.
        unsafe { std::ptr::write_volatile(r.as_ptr(), 7) };
        assert!(in_forked_child(|| {
            // SAFETY: as above, in the child's copy-on-write copy of the region.
            let seen = unsafe { std::ptr::read_volatile(r.as_ptr()) };
            // SAFETY: as above.
            unsafe { std::ptr::write_volatile(r.as_ptr(), 9) };
            // The child's drop must not unmap or unregister anything of the parent's. A bitwise copy:
            // the child exits with _exit, so the original is never dropped there.
            // SAFETY: the copy is the only one dropped in this process (see above).
            drop(unsafe { std::ptr::read(&r) });
            seen == 7
        }));
        // SAFETY: as above, in the parent.
        assert_eq!(unsafe { std::ptr::read_volatile(r.as_ptr()) }, 7);
    }

    #[test]
    fn forked_child_does_not_have_a_dontfork_range() {
        let r = HostRegion::new(3 << 20, RegionOptions::default()).unwrap();
        // SAFETY: the first byte of the live region, used by nobody else.
        unsafe { std::ptr::write_volatile(r.as_ptr(), 7) };
        set_dontfork(r.as_ptr(), r.map_len, true).unwrap();
        assert!(in_forked_child(|| {
            let mut vec = [0u8; 1];
            // ENOMEM: the range is not mapped in the child.
            let absent =
                // SAFETY: mincore only looks the range up and writes one byte into `vec`.
                unsafe { libc::mincore(r.as_ptr() as *mut libc::c_void, 4096, vec.as_mut_ptr()) }
                    != 0;
            // SAFETY: see the test above.
            drop(unsafe { std::ptr::read(&r) });
            absent
        }));
        // SAFETY: as above, in the parent.
        assert_eq!(unsafe { std::ptr::read_volatile(r.as_ptr()) }, 7);
    }

    #[test]
    fn numa_binding() {
        let r = HostRegion::new(
            64 << 10,
            RegionOptions {
                numa_node: Some(0),
                ..Default::default()
            },
        );
        if std::path::Path::new("/sys/devices/system/node/node0").exists() {
            let r = r.unwrap();
            assert_eq!(r.numa_node(), Some(0));
        }
        let e = HostRegion::new(
            4096,
            RegionOptions {
                numa_node: Some(4000),
                ..Default::default()
            },
        )
        .err()
        .unwrap();
        assert!(
            e.to_string().contains("NUMA node 4000 does not exist"),
            "{e}"
        );
    }

    #[test]
    fn parse_options() {
        assert_eq!(HugePage::parse("").unwrap(), HugePage::None);
        assert_eq!(HugePage::parse("2MB").unwrap(), HugePage::Size2M);
        assert_eq!(HugePage::parse("1GB").unwrap(), HugePage::Size1G);
        assert!(HugePage::parse("4MB").is_err());
        assert_eq!(
            HugePageMode::parse("required").unwrap(),
            HugePageMode::Required
        );
        assert!(HugePageMode::parse("maybe").is_err());
    }

    #[test]
    fn register_without_cuda_is_a_clear_error() {
        let r = HostRegion::new(4096, RegionOptions::default()).unwrap();
        if !crate::cuda::available() {
            let e = r.register_cuda(0, 1 << 30, None).unwrap_err();
            assert!(matches!(
                e,
                Error::Cuda(crate::error::CudaError::Unavailable(_))
            ));
            assert!(!r.pinned());
        }
    }
}
