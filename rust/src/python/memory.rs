//! Host memory handed to a core: its address and length, and the Python object that keeps it
//! alive for as long as the core exists.
//!
//! A core never takes a bare address: using one after its pool was garbage collected would read
//! and write freed memory. A plane is given as a `HostRegion`, a CPU torch tensor (the core then
//! holds the tensor's storage, so swapping the tensor's storage later does not free what the core
//! points at), or `(owner, byte_offset)` of either.
//!
//! Holding a torch storage keeps the storage object alive, not its allocation: `resize_` frees
//! or moves the bytes of a resizable storage, and `share_memory_` moves any CPU storage's bytes
//! into shared memory, both in place. So a core over a torch storage (a tensor given directly,
//! or a `HostRegion` that adopted one) keeps a `StorageWatch` and checks, before every use of the
//! bytes, that the storage still holds the allocation it was given. Memory a `HostRegion`
//! mapped itself cannot move, and needs no watch.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::args::int_in;
use super::errors::{type_err, value_err};
use super::extent::{self, StorageAllocation};
use super::region::PyHostRegion;
use super::tensor_calls;

/// Bytes a core may touch, from `addr`, and the object that owns them.
pub(crate) struct HostMemory {
    pub addr: u64,
    pub len: u64,
    pub owner: Py<PyAny>,
    /// The torch storage the bytes lie in, where one does (see the module's notes).
    pub watch: Option<StorageWatch>,
}

/// A torch storage and the allocation (data pointer, byte size) a core was given in it.
pub(crate) struct StorageWatch {
    storage: Py<PyAny>,
    data: u64,
    nbytes: u64,
    /// The allocation as read from torch's objects (`extent`), so the check on each call asks
    /// Python nothing; None where those reads are off or did not agree with Python.
    read: Option<StorageAllocation>,
}

impl StorageWatch {
    pub(crate) fn clone_ref(&self, py: Python<'_>) -> Self {
        Self {
            storage: self.storage.clone_ref(py),
            data: self.data,
            nbytes: self.nbytes,
            read: self.read,
        }
    }

    /// The storage's allocation words as they are now, read from torch's objects without
    /// running Python (None where the watch asks Python): a call compares them again just before
    /// it copies, so Python that ran after its check (a finalizer, a profile hook) and changed
    /// them is seen.
    pub(crate) fn words_now(&self, _py: Python<'_>) -> Option<extent::AllocationWords> {
        // SAFETY: as in `check`: the GIL is held (`_py`), and `self.storage` is a plain
        // `torch.UntypedStorage` of the read's very `StorageImpl`, which keeps it allocated.
        self.read.map(|read| unsafe { read.now() })
    }

    /// Refuses use of the bytes once the storage no longer holds the allocation it held when the
    /// core took it (freed, resized or moved: the old bytes may be unmapped or reused). A change
    /// made by another thread while a copy runs without the GIL is seen by the next call.
    /// `what` names the memory in the refusal (built only then: this runs on every call).
    pub(crate) fn check(&self, py: Python<'_>, what: impl FnOnce() -> String) -> PyResult<()> {
        // SAFETY: the GIL is held, and `self.storage` is a plain `torch.UntypedStorage` of the
        // read's very `StorageImpl` (its `_cdata`, compared in `watch`), which keeps it
        // allocated.
        if self.read.is_some_and(|read| unsafe { read.unchanged() }) {
            return Ok(());
        }
        // Changed words may still be the same memory (a deleter context replaced): Python says.
        // Through the type's methods: torch keeps one Python object per storage, which an
        // attribute set on it could otherwise answer for (`tensor_calls`).
        let storage = self.storage.bind(py);
        let m = tensor_calls::methods(py)?;
        let (data, nbytes): (u64, u64) = m.unmoded(py, || {
            Ok((
                m.ask(&m.storage_data_ptr, storage)?.extract()?,
                m.ask(&m.storage_nbytes, storage)?.extract()?,
            ))
        })?;
        if data == self.data && nbytes == self.nbytes {
            return Ok(());
        }
        Err(value_err(format!(
            "{}: the torch storage it lies in no longer holds the memory it was built over \
             ({} bytes at {:#x}, now {nbytes} bytes at {data:#x}: resized, freed or moved into \
             shared memory); a host pool's memory must stay where it is while the pool lives",
            what(),
            self.nbytes,
            self.data
        )))
    }
}

pub(crate) fn host_memory(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<HostMemory> {
    let (owner, offset) = match obj.cast::<PyTuple>() {
        Ok(pair) if pair.len() == 2 => {
            let offset = int_in(
                &pair.get_item(1)?,
                &format!("{what} offset"),
                0,
                i64::MAX as u128,
                "[0, 2**63)",
            )? as u64;
            (pair.get_item(0)?, offset)
        }
        _ => (obj.clone(), 0),
    };
    let whole = whole_memory(&owner, what)?;
    if offset > whole.len {
        return Err(value_err(format!(
            "{what} offset {offset} lies past the end of its {} bytes",
            whole.len
        )));
    }
    Ok(HostMemory {
        addr: whole.addr + offset,
        len: whole.len - offset,
        owner: whole.owner,
        watch: whole.watch,
    })
}

fn whole_memory(owner: &Bound<'_, PyAny>, what: &str) -> PyResult<HostMemory> {
    // What torch is asked here is where the core will read and write: with every
    // torch-function override off, so that torch answers (`tensor_calls`).
    let m = tensor_calls::methods(owner.py())?;
    m.unmoded(owner.py(), || whole_memory_unmoded(owner, what))
}

fn whole_memory_unmoded(owner: &Bound<'_, PyAny>, what: &str) -> PyResult<HostMemory> {
    if let Ok(region) = owner.cast::<PyHostRegion>() {
        let region = region.get();
        return Ok(HostMemory {
            addr: region.inner.addr(),
            len: region.inner.len() as u64,
            owner: owner.clone().unbind(),
            watch: region.watch.as_ref().map(|w| w.clone_ref(owner.py())),
        });
    }
    let t = super::binding::torch(owner.py())?;
    if !owner.is_instance(t.tensor.bind(owner.py()))? {
        return Err(type_err(format!(
            "{what} must be a HostRegion, a CPU torch tensor or (owner, byte_offset), got {}",
            owner.get_type().name()?
        )));
    }
    // The address and extent below come from the tensor's methods, which a subclass (or its
    // `__torch_function__`) could answer with memory it does not own: read a plain alias.
    let owner = &super::indices::plain_tensor(owner, "tensor")?;
    let device = owner.getattr("device")?.getattr("type")?;
    if device.extract::<&str>()? != "cpu" {
        return Err(value_err(format!(
            "{what} must be host memory, got a tensor on {}",
            owner.getattr("device")?.str()?
        )));
    }
    let m = tensor_calls::methods(owner.py())?;
    if !m.ask(&m.is_contiguous, owner)?.extract::<bool>()? {
        return Err(value_err(format!("{what} must be a contiguous tensor")));
    }
    let storage = m.ask(&m.untyped_storage, owner)?;
    let base: u64 = m.ask(&m.storage_data_ptr, &storage)?.extract()?;
    let nbytes: u64 = m.ask(&m.storage_nbytes, &storage)?.extract()?;
    let addr: u64 = m.ask(&m.data_ptr, owner)?.extract()?;
    let start = addr.wrapping_sub(base);
    if addr < base || start > nbytes {
        return Err(value_err(format!(
            "{what}: the tensor's data lies outside its storage"
        )));
    }
    Ok(HostMemory {
        addr,
        len: nbytes - start,
        watch: Some(watch(owner, &storage, base, nbytes)?),
        owner: storage.unbind(),
    })
}

/// The watch of `tensor`'s `storage` (taken from it), which holds `nbytes` at `data`: with the
/// allocation read from torch's objects where that read agrees with Python and is of the very
/// storage held. A tensor subclass may answer `untyped_storage()` with another storage object
/// over the same bytes, and the held object keeps only its own `StorageImpl` alive: the read is
/// used only when the held object is exactly a `torch.UntypedStorage` whose `_cdata` (its
/// `StorageImpl`'s address) is the one the read went through.
fn watch(
    tensor: &Bound<'_, PyAny>,
    storage: &Bound<'_, PyAny>,
    data: u64,
    nbytes: u64,
) -> PyResult<StorageWatch> {
    let read = match extent::layout(tensor.py())? {
        Some(layout) => {
            let py = tensor.py();
            let plain = storage
                .get_type()
                .is(py.import("torch")?.getattr("UntypedStorage")?);
            let held: Option<usize> = if plain {
                storage.getattr(intern!(py, "_cdata"))?.extract().ok()
            } else {
                None
            };
            let reported = extent::reported(tensor)?;
            layout
                .snapshot(&reported)
                .filter(|_| reported.storage_data == data && reported.storage_nbytes == nbytes)
                .map(|snapshot| snapshot.allocation(&layout))
                .filter(|read| held.is_some_and(|impl_| read.storage_impl() == impl_))
        }
        None => None,
    };
    Ok(StorageWatch {
        storage: storage.clone().unbind(),
        data,
        nbytes,
        read,
    })
}
