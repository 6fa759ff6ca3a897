//! Host memory registered with CUDA, as the transfers see it: which chunks are pinned and on
//! which device, the guard transfers and unregistration share, and the events that say when the
//! work queued on a region has finished.
//!
//! * A transfer enters every region its host planes lie in before it enqueues anything, and
//!   leaves after it recorded an event on its stream behind its work (`Entered::record`). A
//!   region being unregistered refuses new transfers.
//! * Unregistration takes the region exclusively: it waits (bounded) until no transfer is between
//!   validation and its event, then for that region's events only (not for every stream of the
//!   process, as `cuCtxSynchronize` would: an NCCL kernel spinning on a dead peer must not hang
//!   `destroy()`, and a context synchronize is illegal while another thread captures a CUDA
//!   graph), then unpins each chunk with the device it was registered on current.
//! * When the wait runs out, the region stays pinned (and its owner keeps it mapped): a clear
//!   error and a log line instead of a hang, and never unpinned memory under a running DMA.

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_int;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::driver::{as_void, check, code, describe, Cu};
use super::probe;
use crate::error::{Error, Result};
use crate::plan::CopyOp;

/// One `cuMemHostRegister` range and the device whose context was current when it was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub base: u64,
    pub len: usize,
    pub device: c_int,
}

struct Event {
    event: usize,
    device: c_int,
}

#[derive(Default)]
struct State {
    /// Transfers between validation and their event record.
    readers: usize,
    /// Unregistration started (or finished): new transfers are refused.
    closing: bool,
    /// A thread is unregistering the region (another one waits for its outcome).
    removing: bool,
    /// The region was unpinned (it stays `closing` for good).
    removed: bool,
    /// One event per (context, stream) that queued work touching the region; re-recorded by
    /// every later transfer on the same stream (stream order makes the latest one cover all).
    events: HashMap<(u64, u64), Event>,
    /// Work was queued but no event could be recorded behind it.
    untracked: Vec<c_int>,
    /// The unpinning thread's outcome, for the caller waiting on it.
    unpinned: Option<Result<()>>,
    /// The caller stopped waiting for the unpinning thread: it finishes the removal itself.
    abandoned: bool,
    /// Some chunks may be unpinned already: the region never takes transfers again.
    unpin_started: bool,
}

struct Region {
    chunks: Vec<Chunk>,
    /// Never held together with `REGIONS` (a lookup drops that first); no Python runs under it.
    state: Mutex<State>,
    idle: Condvar,
}

impl Region {
    fn start(&self) -> u64 {
        self.chunks[0].base
    }

    fn end(&self) -> u64 {
        self.chunks
            .iter()
            .map(|c| c.base + c.len as u64)
            .max()
            .unwrap_or(0)
    }

    fn wait<'a>(&self, st: MutexGuard<'a, State>, left: Duration) -> MutexGuard<'a, State> {
        self.idle
            .wait_timeout(st, left)
            .unwrap_or_else(|p| p.into_inner())
            .0
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update is a single field assignment or map insert/remove: still consistent
        // after a panic elsewhere.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Against the GIL: a leaf lock in code that never calls Python, so it is never held while the
/// GIL is waited for (design.md, "Locks and the GIL").
static REGIONS: Mutex<BTreeMap<u64, Arc<Region>>> = Mutex::new(BTreeMap::new());

fn regions() -> MutexGuard<'static, BTreeMap<u64, Arc<Region>>> {
    REGIONS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Records a freshly registered region (its chunks, in address order).
pub(crate) fn insert(chunks: Vec<Chunk>) {
    if chunks.is_empty() {
        return;
    }
    let region = Arc::new(Region {
        chunks,
        state: Mutex::new(State::default()),
        idle: Condvar::new(),
    });
    regions().insert(region.start(), region);
}

fn find(addr: u64) -> Option<Arc<Region>> {
    let map = regions();
    let (_, r) = map.range(..=addr).next_back()?;
    (addr < r.end()).then(|| r.clone())
}

/// A transfer inside the regions its host planes lie in (see the module doc).
pub(crate) struct Entered {
    regions: Vec<Arc<Region>>,
    /// Per host plane: whether it lies in registered memory.
    pub registered: Vec<bool>,
}

/// Enters the regions of `planes` (`(base, nbytes)` per host plane). Refused when one of them is
/// being unregistered: the pool is being destroyed.
pub(crate) fn enter(planes: &[(u64, u64)]) -> Result<Entered> {
    let mut e = Entered {
        regions: Vec::new(),
        registered: Vec::with_capacity(planes.len()),
    };
    for (p, &(base, nbytes)) in planes.iter().enumerate() {
        let Some(r) = find(base).filter(|_| nbytes > 0) else {
            e.registered.push(false);
            continue;
        };
        e.registered.push(base + nbytes <= r.end());
        if e.regions.iter().any(|have| Arc::ptr_eq(have, &r)) {
            continue;
        }
        let mut st = r.lock();
        if st.closing {
            return Err(Error::cuda(format!(
                "host plane {p} at {base:#x} is being unregistered from CUDA (its pool is being \
                 destroyed); the transfer was refused and nothing was enqueued"
            )));
        }
        st.readers += 1;
        drop(st);
        e.regions.push(r);
    }
    Ok(e)
}

impl Entered {
    /// Chunk boundaries inside the entered regions (a copy must not span one), sorted.
    pub(crate) fn seams(&self) -> Vec<u64> {
        let mut s: Vec<u64> = self
            .regions
            .iter()
            .flat_map(|r| r.chunks.iter().skip(1).map(|c| c.base))
            .collect();
        s.sort_unstable();
        s
    }

    pub(crate) fn touches_registered(&self) -> bool {
        !self.regions.is_empty()
    }

    /// Records an event on `stream` (context `ctx`, current on this thread) behind the work just
    /// enqueued, in every entered region. On failure the region falls back to a device-wide
    /// wait at unregistration (and the error is returned).
    pub(crate) fn record(&self, ctx: sys::CUcontext, device: c_int, stream: u64) -> Result<()> {
        let key = (probe::ctx_key(ctx), stream);
        let mut result = Ok(());
        for r in &self.regions {
            let mut st = r.lock();
            prune(&mut st);
            let rc = match st.events.get(&key) {
                Some(ev) => record_on(ev.event, stream),
                None => match create_event() {
                    Ok(event) => {
                        let rc = record_on(event, stream);
                        st.events.insert(key, Event { event, device });
                        rc
                    }
                    Err(e) => Err(e),
                },
            };
            if let Err(e) = rc {
                if !st.untracked.contains(&device) {
                    st.untracked.push(device);
                }
                result = result.and(Err(e));
            }
        }
        result
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        for r in &self.regions {
            let mut st = r.lock();
            st.readers -= 1;
            if st.readers == 0 {
                r.idle.notify_all();
            }
        }
    }
}

fn create_event() -> Result<usize> {
    let mut ev: sys::CUevent = std::ptr::null_mut();
    check(
        // SAFETY: `ev` is a valid out-pointer and a context is current (the transfer's); the
        // flags are a valid `CUevent_flags` value.
        unsafe {
            sys::cuEventCreate(
                &mut ev,
                sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32,
            )
        },
        "cuEventCreate (host region)",
    )?;
    Ok(ev as usize)
}

fn record_on(event: usize, stream: u64) -> Result<()> {
    // SAFETY: a live event of the current context and the caller's stream.
    check(
        unsafe { sys::cuEventRecord(event as sys::CUevent, super::driver::as_stream(stream)) },
        "cuEventRecord (host region)",
    )
}

fn query(event: usize) -> std::result::Result<bool, i32> {
    // SAFETY: a live event.
    match unsafe { sys::cuEventQuery(event as sys::CUevent) } {
        Cu::CUDA_SUCCESS => Ok(true),
        Cu::CUDA_ERROR_NOT_READY => Ok(false),
        other => Err(code(other)),
    }
}

/// Drops events whose work has finished once a region has collected many (streams come and go).
fn prune(st: &mut State) {
    if st.events.len() < 16 {
        return;
    }
    st.events.retain(|_, ev| {
        if query(ev.event) == Ok(true) {
            // SAFETY: a live event nobody records or waits on (the region lock is held).
            unsafe { sys::cuEventDestroy_v2(ev.event as sys::CUevent) };
            false
        } else {
            true
        }
    });
}

fn log(msg: &str) {
    eprintln!("hostkv_rs: {msg}");
}

/// Waits for every event of `events` (bounded by `deadline`); the number still pending after it.
fn wait_events(events: &[(usize, c_int)], deadline: Instant) -> Result<usize> {
    let mut pending: Vec<(usize, c_int)> = events.to_vec();
    let mut nap = Duration::from_micros(20);
    loop {
        let mut still = Vec::with_capacity(pending.len());
        for &(ev, device) in &pending {
            let _scope = probe::bind_device(device)?;
            match query(ev) {
                Ok(true) => {}
                Ok(false) => still.push((ev, device)),
                Err(rc) => {
                    return Err(Error::cuda(format!(
                        "waiting for transfers queued on pinned host memory failed: \
                         cuEventQuery: {}",
                        describe(rc)
                    )))
                }
            }
        }
        pending = still;
        if pending.is_empty() || Instant::now() >= deadline {
            return Ok(pending.len());
        }
        std::thread::sleep(nap.min(deadline.saturating_duration_since(Instant::now())));
        nap = (nap * 2).min(Duration::from_millis(5));
    }
}

/// Waits for all work of `device` (`cuCtxSynchronize`), but no longer than `deadline`: the
/// wait runs on a helper thread, since a kernel spinning on a dead peer would hold it forever.
/// False when the deadline passed first; the helper then returns whenever the driver does.
fn synchronize_within(device: c_int, deadline: Instant) -> Result<bool> {
    let (done, wait) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("hostkv-sync".into())
        .spawn(move || {
            // The receiver is gone once the deadline passed; the result is then nobody's.
            let _ = done.send(probe::synchronize_device(device));
        })
        .map_err(|e| {
            Error::cuda(format!(
                "could not start the thread that waits for device {device}: {e}"
            ))
        })?;
    match wait.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(result) => result.map(|()| true),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Ok(false),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(Error::cuda(format!(
            "the thread waiting for device {device} ended without an answer"
        ))),
    }
}

fn unregister_chunk(c: &Chunk) -> Result<()> {
    let _scope = probe::bind_device(c.device)?;
    // SAFETY: `c.base` is the base of a range registered by `register`.
    let rc = unsafe { sys::cuMemHostUnregister(as_void(c.base)) };
    if rc == Cu::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::cuda(format!(
            "cuMemHostUnregister of {:#x} ({} bytes, device {}) failed: {}",
            c.base,
            c.len,
            c.device,
            describe(code(rc))
        )))
    }
}

/// Unpins the region whose first chunk starts at `base` (see the module doc). Blocks (bounded):
/// call without the GIL. A second caller while one is at work waits for its outcome.
pub(crate) fn remove(base: u64) -> Result<()> {
    let Some(r) = regions().get(&base).cloned() else {
        return Ok(());
    };
    let limit = crate::config::unregister_timeout();
    let deadline = Instant::now() + limit;
    let mut st = r.lock();
    if st.removing {
        while st.removing && Instant::now() < deadline {
            st = r.wait(st, deadline.saturating_duration_since(Instant::now()));
        }
        return if st.removed {
            Ok(())
        } else {
            Err(Error::cuda(format!(
                "pinned host memory at {base:#x} could not be unregistered by another thread \
                 (see its error); it stays pinned"
            )))
        };
    }
    if st.removed {
        return Ok(());
    }
    st.removing = true;
    st.closing = true;
    st.abandoned = false;
    st.unpin_started = false;
    drop(st);
    let outcome = remove_locked(&r, base, limit, deadline);
    let mut st = r.lock();
    if st.abandoned {
        // The unpinning thread owns the rest of the removal (it may have finished it already).
        return outcome;
    }
    st.removing = false;
    match &outcome {
        Ok(()) => st.removed = true,
        // Nothing was unpinned yet: transfers may use it again, and a later call may try again.
        Err(_) if !st.unpin_started => st.closing = false,
        // Partly unpinned: it stays closed (a transfer must not treat an unpinned chunk as
        // registered); the memory stays mapped.
        Err(_) => {}
    }
    r.idle.notify_all();
    drop(st);
    if outcome.is_ok() {
        regions().remove(&base);
    }
    outcome
}

fn remove_locked(r: &Region, base: u64, limit: Duration, deadline: Instant) -> Result<()> {
    let give_up = |what: String| {
        let msg = format!(
            "unregistering pinned host memory at {base:#x} ({} bytes) timed out after {:.1} s: \
             {what}. The memory stays pinned and mapped (not freed) so that the GPU never \
             writes into freed pages; raise HOSTKV_UNREGISTER_TIMEOUT_S or find the stuck \
             stream",
            r.end() - r.start(),
            limit.as_secs_f64()
        );
        log(&msg);
        Error::cuda(msg)
    };
    let mut st = r.lock();
    while st.readers > 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let n = st.readers;
            return Err(give_up(format!(
                "{n} transfer(s) are still enqueueing work on it"
            )));
        }
        st = r.wait(st, left);
    }
    let events: Vec<(usize, c_int)> = st.events.values().map(|e| (e.event, e.device)).collect();
    let untracked = st.untracked.clone();
    drop(st);
    let still = wait_events(&events, deadline)?;
    if still > 0 {
        return Err(give_up(format!(
            "work queued by {still} stream(s) that touches it has not finished"
        )));
    }
    for &device in &untracked {
        log(&format!(
            "an event could not be recorded behind a transfer into {base:#x}; waiting for all \
             work of device {device} before unpinning it"
        ));
        if !synchronize_within(device, deadline)? {
            return Err(give_up(format!(
                "an event could not be recorded behind a transfer into it, and the wait for all \
                 work of device {device} has not returned"
            )));
        }
    }
    // Nothing queued touches the region any more, and nothing new can be (closing). Some drivers
    // make cuMemHostUnregister wait for all work of the device, ours or not (an NCCL kernel
    // spinning on a dead peer): it runs on a helper thread, and the wait for it is bounded like
    // the rest. If it does not return in time the region stays pinned and mapped; the helper
    // finishes the removal when the driver lets it.
    {
        let mut st = r.lock();
        st.unpinned = None;
        st.unpin_started = true;
    }
    let region = regions().get(&base).cloned();
    let Some(region) = region else {
        return Ok(());
    };
    let spawned = std::thread::Builder::new()
        .name("hostkv-unpin".into())
        .spawn(move || unpin_chunks(&region, base));
    if let Err(e) = spawned {
        return Err(Error::cuda(format!(
            "could not start the thread that unpins host memory at {base:#x}: {e}; it stays \
             pinned"
        )));
    }
    // The unpin gets a budget of its own: the wait for queued work may have used most of the
    // first, and unpinning a large region legitimately takes a while.
    let deadline = Instant::now() + limit;
    let mut st = r.lock();
    while st.unpinned.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            st.abandoned = true;
            drop(st);
            return Err(give_up(
                "cuMemHostUnregister has not returned (the driver waits for other work on the \
                 device); it will finish on a helper thread"
                    .into(),
            ));
        }
        st = r.wait(st, left);
    }
    st.unpinned.take().unwrap_or(Ok(()))
}

/// The helper thread of `remove_locked`: unpins every chunk, destroys the region's events, and
/// hands the outcome to the waiting caller, or, when that caller gave up, finishes the removal.
fn unpin_chunks(r: &Region, base: u64) {
    let _relaxed = super::driver::RelaxedCapture::enter();
    let mut first_err = None;
    for c in r.chunks.iter().rev() {
        if let Err(e) = unregister_chunk(c) {
            first_err.get_or_insert(e);
        }
    }
    let mut st = r.lock();
    for (_, ev) in st.events.drain() {
        // SAFETY: completed events nobody records or waits on any more.
        unsafe { sys::cuEventDestroy_v2(ev.event as sys::CUevent) };
    }
    let outcome = first_err.map_or(Ok(()), Err);
    if !st.abandoned {
        st.unpinned = Some(outcome);
        r.idle.notify_all();
        return;
    }
    // Nobody waits: this is the end of `remove`.
    st.removing = false;
    match outcome {
        Ok(()) => {
            st.removed = true;
            log(&format!(
                "pinned host memory at {base:#x} was unregistered late, on the helper thread"
            ));
        }
        Err(e) => {
            // Partly unpinned, maybe: it stays closed.
            log(&format!("late unregistration of {base:#x} failed: {e}"));
        }
    }
    let removed = st.removed;
    r.idle.notify_all();
    drop(st);
    if removed {
        regions().remove(&base);
    }
}

/// Splits one copy so that no piece spans a registration seam (`seams`: sorted chunk boundaries
/// of the host side) and hands the pieces to `f`, in order: the driver rejects a copy whose host
/// range lies in two registrations. `to_host` says which side of the copy is host memory (the
/// destination for a backup).
pub(crate) fn split_at_seams(
    op: CopyOp,
    to_host: bool,
    seams: &[u64],
    mut f: impl FnMut(CopyOp) -> Result<()>,
) -> Result<()> {
    let host = if to_host { op.dst } else { op.src };
    let end = host + op.len;
    let first = seams.partition_point(|&s| s <= host);
    let mut at = host;
    for &s in seams[first..].iter().take_while(|&&s| s < end) {
        let skip = at - host;
        f(CopyOp {
            src: op.src + skip,
            dst: op.dst + skip,
            len: s - at,
        })?;
        at = s;
    }
    let skip = at - host;
    f(CopyOp {
        src: op.src + skip,
        dst: op.dst + skip,
        len: end - at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_all(ops: &[CopyOp], to_host: bool, seams: &[u64]) -> Vec<CopyOp> {
        let mut out = Vec::new();
        for &op in ops {
            split_at_seams(op, to_host, seams, |piece| {
                out.push(piece);
                Ok(())
            })
            .unwrap();
        }
        out
    }

    #[test]
    fn copies_are_cut_at_every_seam_they_cross_and_nowhere_else() {
        let seams = [100, 200, 300];
        let ops = vec![
            CopyOp {
                src: 10,
                dst: 5000,
                len: 50,
            }, // inside one chunk
            CopyOp {
                src: 150,
                dst: 6000,
                len: 200,
            }, // crosses 200 and 300
            CopyOp {
                src: 200,
                dst: 7000,
                len: 100,
            }, // ends exactly at a seam
        ];
        let got = split_all(&ops, false, &seams);
        assert_eq!(
            got,
            vec![
                CopyOp {
                    src: 10,
                    dst: 5000,
                    len: 50
                },
                CopyOp {
                    src: 150,
                    dst: 6000,
                    len: 50
                },
                CopyOp {
                    src: 200,
                    dst: 6050,
                    len: 100
                },
                CopyOp {
                    src: 300,
                    dst: 6150,
                    len: 50
                },
                CopyOp {
                    src: 200,
                    dst: 7000,
                    len: 100
                },
            ]
        );
        // Backups: the host side is the destination.
        let back: Vec<CopyOp> = ops
            .iter()
            .map(|o| CopyOp {
                src: o.dst,
                dst: o.src,
                len: o.len,
            })
            .collect();
        let got_back = split_all(&back, true, &seams);
        assert_eq!(got_back.len(), 5);
        assert!(got_back
            .iter()
            .all(|o| !seams.iter().any(|&s| o.dst < s && s < o.dst + o.len)));
        assert_eq!(got_back.iter().map(|o| o.len).sum::<u64>(), 350);
    }

    #[test]
    fn transfers_are_refused_once_unregistration_started() {
        insert(vec![
            Chunk {
                base: 1 << 40,
                len: 4096,
                device: 0,
            },
            Chunk {
                base: (1 << 40) + 4096,
                len: 4096,
                device: 0,
            },
        ]);
        let e = enter(&[((1 << 40) + 100, 5000), (1 << 41, 10)]).unwrap();
        assert_eq!(e.registered, vec![true, false]);
        assert_eq!(e.seams(), vec![(1 << 40) + 4096]);
        let r = find(1 << 40).unwrap();
        assert_eq!(r.lock().readers, 1);
        r.lock().closing = true;
        let refused = enter(&[(1 << 40, 10)]).err().unwrap();
        assert!(
            refused.to_string().contains("being unregistered"),
            "{refused}"
        );
        drop(e);
        assert_eq!(r.lock().readers, 0);
        regions().remove(&(1 << 40));
    }
}
