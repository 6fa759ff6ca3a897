//! Host memory handed to a core: its address and length, and the Python object that keeps it
//! alive for as long as the core exists.
//!
//! A core never takes a bare address: using one after its pool was garbage collected would read
//! and write freed memory. A plane is given as a `HostRegion`, a CPU torch tensor (the core then
//! holds the tensor's storage, so swapping the tensor's storage later does not free what the core
//! points at), or `(owner, byte_offset)` of either.

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::args::int_in;
use super::errors::{type_err, value_err};
use super::region::PyHostRegion;

/// Bytes a core may touch, from `addr`, and the object that owns them.
pub(crate) struct HostMemory {
    pub addr: u64,
    pub len: u64,
    pub owner: Py<PyAny>,
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
    })
}

fn whole_memory(owner: &Bound<'_, PyAny>, what: &str) -> PyResult<HostMemory> {
    if let Ok(region) = owner.cast::<PyHostRegion>() {
        let inner = &region.get().inner;
        return Ok(HostMemory {
            addr: inner.addr(),
            len: inner.len() as u64,
            owner: owner.clone().unbind(),
        });
    }
    if !owner.hasattr("untyped_storage")? {
        return Err(type_err(format!(
            "{what} must be a HostRegion, a CPU torch tensor or (owner, byte_offset), got {}",
            owner.get_type().name()?
        )));
    }
    let device = owner.getattr("device")?.getattr("type")?;
    if device.extract::<&str>()? != "cpu" {
        return Err(value_err(format!(
            "{what} must be host memory, got a tensor on {}",
            owner.getattr("device")?.str()?
        )));
    }
    if !owner.call_method0("is_contiguous")?.extract::<bool>()? {
        return Err(value_err(format!("{what} must be a contiguous tensor")));
    }
    let storage = owner.call_method0("untyped_storage")?;
    let base: u64 = storage.call_method0("data_ptr")?.extract()?;
    let nbytes: u64 = storage.call_method0("nbytes")?.extract()?;
    let addr: u64 = owner.call_method0("data_ptr")?.extract()?;
    let start = addr.wrapping_sub(base);
    if addr < base || start > nbytes {
        return Err(value_err(format!(
            "{what}: the tensor's data lies outside its storage"
        )));
    }
    Ok(HostMemory {
        addr,
        len: nbytes - start,
        owner: storage.unbind(),
    })
}
