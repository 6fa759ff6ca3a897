//! Locks a forked child may inherit held.
//!
//! `fork` copies only the calling thread: a lock another thread held at that moment stays held
//! in the child for ever, and the child's first `lock()` on it would hang. Every lock the core
//! takes is held only for a copy or a swap, so this is rare, but a server that forks (a
//! multiprocessing worker, a subprocess spawned by fork) must get an error, never a hang.
//! [`lock`] takes a lock as usual in the process that made it, and in a child only if it is free.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, Once, TryLockError};

use crate::error::{Error, Result};

/// How many forks lie between the first process and this one (0 in a process that did not come
/// from a fork after the handler was registered).
static GENERATION: AtomicU64 = AtomicU64::new(0);
static REGISTER: Once = Once::new();

extern "C" fn in_child() {
    // Async-signal-safe: one atomic add.
    GENERATION.fetch_add(1, Ordering::Relaxed);
}

/// This process's fork generation: what an object records when it is made, to tell later
/// whether it is used in a forked child.
pub fn generation() -> u64 {
    REGISTER.call_once(|| {
        // SAFETY: registers a handler that only does an atomic add; it is never unregistered.
        // A failure (ENOMEM) leaves the generation at 0 everywhere: locks then behave as before.
        unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
    });
    GENERATION.load(Ordering::Relaxed)
}

/// `mutex`, locked (`what` names it in the refusal). In the process that made it (`born`, its [`generation`]) this waits as
/// `Mutex::lock` does; in a forked child it takes the lock only if it is free, and otherwise
/// refuses, because the thread that holds it does not exist there. A poisoned lock is taken
/// (its holder panicked; what it guards is still whole: every guarded value here is swapped in
/// one assignment).
pub fn lock<'a, T>(
    mutex: &'a Mutex<T>,
    born: u64,
    what: impl FnOnce() -> String,
) -> Result<MutexGuard<'a, T>> {
    if generation() == born {
        return Ok(mutex.lock().unwrap_or_else(|e| e.into_inner()));
    }
    match mutex.try_lock() {
        Ok(guard) => Ok(guard),
        Err(TryLockError::Poisoned(e)) => Ok(e.into_inner()),
        Err(TryLockError::WouldBlock) => Err(Error::state(format!(
            "{} was locked by another thread of the parent process when this process \
             forked, and that thread does not exist here: build a new pool in this process \
             (or start workers with the 'spawn' method)",
            what()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_held_across_fork_is_refused_in_the_child_and_taken_in_the_parent() {
        let mutex = std::sync::Arc::new(Mutex::new(7));
        let born = generation();
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let holder = {
            let mutex = mutex.clone();
            std::thread::spawn(move || {
                let _guard = mutex.lock().unwrap();
                held_tx.send(()).unwrap();
                done_rx.recv().unwrap();
            })
        };
        held_rx.recv().unwrap();
        // SAFETY: the child only tries the lock, formats an error and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let code = match lock(&mutex, born, || "the test lock".into()) {
                Err(e)
                    if e.to_string()
                        .contains("parent process when this process forked") =>
                {
                    0
                }
                _ => 1,
            };
            // SAFETY: leave the child without running the parent's test harness.
            unsafe { libc::_exit(code) };
        }
        assert!(pid > 0, "fork failed");
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "{status}"
        );
        done_tx.send(()).unwrap();
        holder.join().unwrap();
        assert_eq!(*lock(&mutex, born, || "the test lock".into()).unwrap(), 7);
    }
}
