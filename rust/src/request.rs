//! The vocabulary every engine shares: what a transfer request is.
//!
//! A host pool is one or two *planes* (K and V for MHA, one latent plane for MLA, one page-row plane
//! for DeepSeek V4). Every plane has the same layout, layer count, row count and page size, and its
//! own item size (bytes of one row, one layer). The device side is always layer-first: per plane and
//! layer one base pointer, rows of exactly `item_bytes` bytes.
//!
//! `plan.rs` validates a request into a compact [`crate::plan::Plan`] that the CPU engine runs
//! (and the CUDA direct backend streams into copy batches); `cuda/` turns the same request into
//! kernel launches or copy-engine batches. Only [`TransferRequest::new`], which is `unsafe`,
//! turns raw addresses into something safe code dereferences.

use crate::error::{Error, Result};
pub use crate::index_map::IndexMap;

/// Host buffer layouts of SGLang's HiCache (see `layout.rs` for the byte arithmetic).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Layout {
    LayerFirst = 0,
    PageFirst = 1,
    PageFirstDirect = 2,
    PageHead = 3,
    /// SGLang 0.5.23's fused page block: per page, `(head_group, layer, component, page_size,
    /// heads_in_group, head_dim)` (MHA, K and V interleaved in one allocation) or `(layer,
    /// page_size, dim)` (MLA).
    PageUnified = 4,
}

impl Layout {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "layer_first" => Ok(Self::LayerFirst),
            "page_first" => Ok(Self::PageFirst),
            "page_first_direct" => Ok(Self::PageFirstDirect),
            "page_head" => Ok(Self::PageHead),
            "page_unified" => Ok(Self::PageUnified),
            other => Err(Error::unsupported(format!("Unsupported layout: {other}"))),
        }
    }

    /// Whether the layout splits a page's heads into groups (SGLang's `head_group_num`, which
    /// every other layout ignores, whatever its value).
    pub fn groups_heads(self) -> bool {
        self == Self::PageUnified
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::LayerFirst => "layer_first",
            Self::PageFirst => "page_first",
            Self::PageFirstDirect => "page_first_direct",
            Self::PageHead => "page_head",
            Self::PageUnified => "page_unified",
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
            other => Err(Error::unsupported(format!(
                "Unsupported IO backend: {other}"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Kernel => "kernel",
            Self::Direct => "direct",
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
/// Plain data, like [`HostGeometry`].
#[derive(Clone, Copy, Debug)]
pub struct IndexArray {
    pub ptr: u64,
    pub len: usize,
    pub width: IndexWidth,
    /// True when `ptr` is device-side memory: GPU memory in a [`DeviceMemory::Cuda`] request
    /// (the host cannot read it, so the kernel checks bounds); in a [`DeviceMemory::Host`]
    /// request, host memory that only the emulated kernels read. The CPU engine refuses it.
    pub on_device: bool,
    /// Which elements a transfer reads and what each becomes (DCP, V4 page rows, C4 tokens);
    /// `len` counts raw elements, [`IndexArray::count`] the positions a transfer moves.
    pub map: IndexMap,
}

impl IndexArray {
    /// Positions the transfer moves (raw elements through the map), or the map's refusal.
    pub fn count(&self) -> Result<usize> {
        self.map.count(self.len)
    }
}

/// Host pool geometry: shared by all planes except the item size and the base address.
///
/// Plain data: the addresses in `plane_base` are only ever dereferenced through a
/// [`TransferRequest`], whose constructor is `unsafe`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostGeometry {
    pub layout: Layout,
    pub layers: usize,
    /// `S`: token slots (or page rows for V4); a multiple of `page_size`.
    pub rows: usize,
    pub page_size: usize,
    /// Segments per row: the head count for `page_head`, the head-group count for
    /// `page_unified`; 1 for every other layout.
    pub heads: usize,
    /// Bytes of one row of one layer, per plane (1 or 2 planes).
    pub item_bytes: Vec<usize>,
    /// Base address of each plane's host buffer.
    pub plane_base: Vec<u64>,
}

/// Where the device side of a request lives: which engines may dereference its device layer
/// pointers and its `on_device` index arrays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceMemory {
    /// Host memory (tests, the CPU engine, the kernel emulation): every address of the request
    /// is readable and writable by the CPU. `on_device` index arrays are host memory too, read
    /// only by the (emulated) kernels.
    Host,
    /// CUDA device memory (`cuda::execute`): device layer pointers and `on_device` index arrays
    /// are GPU addresses; the CPU never dereferences them.
    Cuda,
}

/// The device pool as the engines see it: layer-first rows of `item_bytes` per plane.
///
/// Plain data, like [`HostGeometry`].
#[derive(Clone, Debug)]
pub struct DeviceSide {
    /// Plane-major base pointers: plane `p`, layer `l` at `p * layers + l`, where `layers` is the
    /// host layer count for a backup and 1 for a load.
    pub layer_ptrs: Vec<u64>,
    /// Rows addressable in each device layer (bounds for device indices).
    pub rows: usize,
    /// Bytes from one device row to the next, the same in every layer and plane (SGLang's
    /// strided rows: per-layer views of a token-major buffer); None: packed rows, one plane's
    /// item size apart.
    pub row_pitch: Option<u64>,
    /// What `layer_ptrs` (and `on_device` index arrays) address.
    pub memory: DeviceMemory,
}

impl DeviceSide {
    /// Bytes from one row of plane item size `item` to the next.
    pub fn pitch(&self, item: u64) -> u64 {
        self.row_pitch.unwrap_or(item)
    }

    /// Bytes a device layer of `item`-byte rows spans from its pointer: `rows` rows, the last
    /// one only its own bytes (None: past `u64`).
    pub fn layer_span(&self, item: u64) -> Option<u64> {
        match self.rows as u64 {
            0 => Some(0),
            rows => (rows - 1).checked_mul(self.pitch(item))?.checked_add(item),
        }
    }
}

/// One transfer: host pool geometry and addresses, device layer pointers, index arrays, and what
/// to do. It carries raw addresses that safe code (`plan::build`, `cpu::execute`,
/// `cuda::execute`, `cuda::emulate`) dereferences, so it can only be made with the `unsafe`
/// [`TransferRequest::new`]; its fields are read-only afterwards. Not `Clone`: the promise made
/// at construction covers this one value.
#[derive(Debug)]
pub struct TransferRequest {
    geom: HostGeometry,
    backend: Backend,
    op: Op,
    device: DeviceSide,
    host_idx: IndexArray,
    dev_idx: IndexArray,
}

impl TransferRequest {
    /// A request over caller-owned memory. Counts, lengths, layer ids, index values and address
    /// arithmetic are all checked later (`plan::validate` / `plan::build`), before any byte moves;
    /// what cannot be checked is the memory itself, which the caller vouches for here.
    ///
    /// # Safety
    ///
    /// From this call until the request is dropped, and until every CUDA operation enqueued with
    /// it (`cuda::execute`) has finished on its stream:
    ///
    /// 1. **Host planes.** For each plane `p`, the `geom.layers * geom.rows * geom.item_bytes[p]`
    ///    bytes at `geom.plane_base[p]` are one live allocation, readable and writable from the
    ///    CPU (and, for `cuda::execute`, registered with CUDA or otherwise addressable by it).
    /// 2. **Device layers.** Each pointer `k` of `device.layer_ptrs` belongs to plane
    ///    `p = k / (device.layer_ptrs.len() / nplanes)` (plane-major) and addresses
    ///    `device.layer_span(geom.item_bytes[p])` live bytes (`device.rows` rows of that item
    ///    size, `device.row_pitch` apart when set), readable and writable: CPU memory when
    ///    `device.memory` is [`DeviceMemory::Host`], memory of one CUDA device when it is
    ///    [`DeviceMemory::Cuda`]. (A pointer count the op does not expect is refused before use.)
    /// 3. **Index arrays.** Each of `host_idx` / `dev_idx` with `len > 0` addresses
    ///    `len * width.bytes()` live bytes: CPU memory unless `on_device` is set with
    ///    [`DeviceMemory::Cuda`] (then GPU memory of the device that holds the layer pointers).
    ///    Nobody else writes them: the engines read them more than once (validation, then the
    ///    copy) and rely on seeing the same values. (One lying in the bytes the transfer itself
    ///    writes is refused by `plan::check_structure` before any of them is read.)
    /// 4. **No Rust aliasing.** None of these bytes is a Rust object that safe code may access
    ///    during the call (for example this request's own vectors): they are reached only through
    ///    the raw addresses.
    /// 5. **Writes.** Nothing else reads or writes the bytes the transfer writes while it runs.
    ///    Several positions may name the same destination row (SGLang allows it): the engines
    ///    may then copy into that row from two threads (or GPU warps) at once, and which
    ///    source's bytes land there is unspecified.
    ///
    /// A request that fails the structural checks (`plan::check_structure`: null or overflowing
    /// addresses, pointer counts the op does not expect, lengths that differ, bad geometry) is
    /// refused before any of its addresses is used, so those addresses need not be valid.
    /// Overlap between the source and destination bytes of one request is allowed: the CPU
    /// engine then runs on one thread with `memmove` semantics per copy.
    pub unsafe fn new(
        geom: HostGeometry,
        backend: Backend,
        op: Op,
        device: DeviceSide,
        host_idx: IndexArray,
        dev_idx: IndexArray,
    ) -> Self {
        Self {
            geom,
            backend,
            op,
            device,
            host_idx,
            dev_idx,
        }
    }

    pub fn geom(&self) -> &HostGeometry {
        &self.geom
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn op(&self) -> Op {
        self.op
    }

    pub fn device(&self) -> &DeviceSide {
        &self.device
    }

    pub fn host_idx(&self) -> &IndexArray {
        &self.host_idx
    }

    pub fn dev_idx(&self) -> &IndexArray {
        &self.dev_idx
    }

    /// The plain data back (safe: the parts dereference nothing by themselves).
    pub fn into_parts(
        self,
    ) -> (
        HostGeometry,
        Backend,
        Op,
        DeviceSide,
        IndexArray,
        IndexArray,
    ) {
        (
            self.geom,
            self.backend,
            self.op,
            self.device,
            self.host_idx,
            self.dev_idx,
        )
    }
}
