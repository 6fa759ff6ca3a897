//! The vocabulary every engine shares: what a transfer request is.
//!
//! A host pool is one or two *planes* (K and V for MHA, one latent plane for MLA, one page-row plane
//! for DeepSeek V4). Every plane has the same layout, layer count, row count and page size, and its
//! own item size (bytes of one row, one layer). The device side is always layer-first: per plane and
//! layer one base pointer, rows of exactly `item_bytes` bytes.
//!
//! `plan.rs` validates a request and turns it into copy operations for the CPU engine;
//! `cuda/` turns the same request into kernel launches or copy-engine batches.

use crate::error::{Error, Result};

/// Host buffer layouts of SGLang's HiCache (see `layout.rs` for the byte arithmetic).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Layout {
    LayerFirst = 0,
    PageFirst = 1,
    PageFirstDirect = 2,
    PageHead = 3,
}

impl Layout {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "layer_first" => Ok(Self::LayerFirst),
            "page_first" => Ok(Self::PageFirst),
            "page_first_direct" => Ok(Self::PageFirstDirect),
            "page_head" => Ok(Self::PageHead),
            other => Err(Error::Unsupported(format!("Unsupported layout: {other}"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::LayerFirst => "layer_first",
            Self::PageFirst => "page_first",
            Self::PageFirstDirect => "page_first_direct",
            Self::PageHead => "page_head",
        }
    }
}

/// `kernel`: per-item gather/scatter (our PTX kernels on a GPU). `direct`: coalesced runs or whole
/// page blocks through the copy engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    Kernel,
    Direct,
}

impl Backend {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "kernel" => Ok(Self::Kernel),
            "direct" => Ok(Self::Direct),
            other => Err(Error::Unsupported(format!(
                "Unsupported IO backend: {other}"
            ))),
        }
    }
}

/// Backup moves every layer device -> host; load moves one host layer into one device layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Backup,
    /// One host layer, device -> host: a layer-sharded pool backs up only the layers it owns.
    BackupLayer {
        host_layer: usize,
    },
    Load {
        host_layer: usize,
    },
}

impl Op {
    /// True when bytes move device -> host.
    pub fn to_host(self) -> bool {
        !matches!(self, Self::Load { .. })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexWidth {
    I32,
    I64,
}

impl IndexWidth {
    pub fn bytes(self) -> usize {
        match self {
            Self::I32 => 4,
            Self::I64 => 8,
        }
    }
}

/// A contiguous array of token (or page-row) indices owned by the caller for the whole call.
#[derive(Clone, Copy, Debug)]
pub struct IndexArray {
    pub ptr: u64,
    pub len: usize,
    pub width: IndexWidth,
    /// True when `ptr` is GPU memory: it cannot be read on the host, so the kernel checks bounds.
    pub on_device: bool,
}

/// Host pool geometry: shared by all planes except the item size and the base address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostGeometry {
    pub layout: Layout,
    pub layers: usize,
    /// `S`: token slots (or page rows for V4); a multiple of `page_size`.
    pub rows: usize,
    pub page_size: usize,
    /// Head count for `page_head` (each head is its own segment); 1 for every other layout.
    pub heads: usize,
    /// Bytes of one row of one layer, per plane (1 or 2 planes).
    pub item_bytes: Vec<usize>,
    /// Base address of each plane's host buffer.
    pub plane_base: Vec<u64>,
}

/// The device pool as the engines see it: layer-first rows of `item_bytes` per plane.
#[derive(Clone, Debug)]
pub struct DeviceSide {
    /// Plane-major base pointers: plane `p`, layer `l` at `p * layers + l`, where `layers` is the
    /// host layer count for a backup and 1 for a load.
    pub layer_ptrs: Vec<u64>,
    /// Rows addressable in each device layer (bounds for device indices).
    pub rows: usize,
}

#[derive(Clone, Debug)]
pub struct TransferRequest {
    pub geom: HostGeometry,
    pub backend: Backend,
    pub op: Op,
    pub device: DeviceSide,
    pub host_idx: IndexArray,
    pub dev_idx: IndexArray,
}
