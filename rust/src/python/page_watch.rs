//! `HOSTKV_PAGE_DIGEST`: a debugging aid for silent host-memory corruption. A watched pool's
//! backups digest every host page they write (XXH3-128 over the page's pieces, without the GIL)
//! and a load verifies the pages it reads before a byte moves, refusing a changed page.
//!
//! The check lives with the pool's memory (`HostPool`) and runs inside the device binding's
//! calls, so every path that writes or reads the pool's pages through the core is covered, and a
//! pool without it pays one branch per call. A page written by other means (a flat page set,
//! handed out by address through page metadata, or allocated to a new owner) is forgotten until
//! its next backup.
//!
//! Lock order: both mutexes are leaves. Neither is held while Python runs or while the GIL is
//! waited for (digests are taken before locking; a replaced index object is dropped after
//! unlocking, since dropping it may run Python).

use std::sync::Mutex;

use pyo3::prelude::*;

use super::errors::runtime_err;
use crate::digest::PageDigests;

#[derive(Default)]
pub(crate) struct PageWatch {
    pub(crate) digests: PageDigests,
    /// The index tensor the last load verified, and its version counter then. A batch loads
    /// layer after layer with one index tensor: its pages are verified whole at its first layer
    /// (a digest covers every layer of a page), and the layers after it are not hashed again
    /// while the same tensor comes back unmodified (torch counts every in-place write to it in
    /// `_version`). Indices of any other kind are verified on every load.
    verified: Mutex<Option<(Py<PyAny>, i64)>>,
}

/// The version counter of `indices` where it is exactly a torch.Tensor (None otherwise: its
/// contents cannot be known unchanged without reading them).
fn version_of(indices: &Bound<'_, PyAny>) -> Option<i64> {
    let py = indices.py();
    let t = super::binding::torch(py).ok()?;
    if !indices.get_type().is(t.tensor.bind(py)) {
        return None;
    }
    indices.getattr("_version").ok()?.extract().ok()
}

impl PageWatch {
    pub(crate) fn record(&self, pages: &[u64], digests: &[u128]) {
        self.digests.record(pages, digests);
        self.replace_verified(None);
    }

    pub(crate) fn forget(&self, pages: &[u64]) {
        self.digests.forget(pages);
        self.replace_verified(None);
    }

    /// Whether `indices` is the tensor the last load verified, unmodified since.
    pub(crate) fn already_verified(&self, indices: &Bound<'_, PyAny>) -> bool {
        let Some(version) = version_of(indices) else {
            return false; // asked of Python before locking
        };
        let verified = self.verified.lock().unwrap_or_else(|p| p.into_inner());
        verified
            .as_ref()
            .is_some_and(|(o, v)| o.as_ptr() == indices.as_ptr() && *v == version)
    }

    pub(crate) fn replace_verified(&self, indices: Option<&Bound<'_, PyAny>>) {
        let entry = indices.and_then(|i| version_of(i).map(|v| (i.clone().unbind(), v)));
        let old = {
            let mut verified = self.verified.lock().unwrap_or_else(|p| p.into_inner());
            std::mem::replace(&mut *verified, entry)
        };
        drop(old); // outside the lock: the last reference may run Python
    }
}

/// The refusal of a load whose page changed since its backup.
pub(crate) fn changed_page(name: &str, page: u64, page_size: u64) -> PyErr {
    runtime_err(format!(
        "{name}: host page {page} (slots [{}, {})) changed since its backup \
         (HOSTKV_PAGE_DIGEST): its bytes were overwritten or corrupted in host memory; nothing \
         was loaded",
        page * page_size,
        (page + 1) * page_size
    ))
}
