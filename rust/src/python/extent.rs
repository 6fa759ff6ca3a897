//! A device tensor's extent read from torch's own objects, so a transfer can tell that a checked
//! tensor is unchanged without calling into Python for every tensor it touches.
//!
//! What a transfer must know of each tensor it writes through a cached pointer: the tensor still
//! names the same storage, the storage still holds the same allocation (data pointer, byte
//! size), and the tensor still sits at the same element offset with the same element count.
//! torch keeps all of these in two C++ objects: the tensor's `TensorImpl` (its storage, storage
//! offset and numel) and that storage's `StorageImpl` (data pointer, byte size). Their field
//! offsets are not a public ABI and change between releases (2.15 dropped the `MaybeOwned`
//! wrapper in `THPVariable`, for one), so none is assumed: once per process the offsets are
//! found by asking torch, through Python, about probe tensors of known, distinct geometry (two
//! allocators, three dtypes, offsets and counts that no other field shares) and searching for
//! the one set of offsets that gives every probe's answers, with a read that cannot fault (the
//! kernel copies the bytes into a pipe, and refuses an unmapped address with EFAULT). No set, or
//! more than one: no layout, and every check goes through Python as before.
//!
//! Why the per-call read of a checked device tensor (`unchanged`) is sound: a snapshot is taken
//! only when reading its objects with the found offsets (again with the faultless read) gives
//! exactly what Python reports for it. The binding holds the tensor object, and the snapshot holds
//! the storage object, so the `StorageImpl` it read stays allocated. A tensor object does not own
//! one `TensorImpl` for life (`torch.utils.swap_tensors` exchanges them), so `unchanged` reads
//! through a pointer only after checking that it is still the snapshot's: the object's `TensorImpl`
//! pointer first (the object is alive), then, through that impl (alive: the object still names it),
//! its storage pointer, and only then the held `StorageImpl`'s fields. What is compared: the
//! storage, the words of its data pointer through its byte size (the data pointer, its deleter and
//! context, so a storage turned copy-on-write is checked again), the storage offset, the element
//! count, the dtype, and that the tensor is still contiguous (its `is_contiguous_` flag, found the
//! same way; where it is not found, its sizes and strides), so a tensor restrided in place
//! (`transpose_`, `as_strided_`) is checked again. Reads happen with the GIL held; torch methods
//! that change these fields may release it, so a concurrent change is seen by this call or the
//! next, and either way every read stays inside a live object.
//!
//! Index tensors are read once per call with no snapshot to compare, only for objects of
//! exactly `torch.Tensor` and only when they have a storage with data. Where the sizes record,
//! the allocation's device and the negative-view bit were found too (`index`), nothing is asked
//! of Python: the tensor must read as 1-D (a dimension count of 1, so its sizes are inline),
//! contiguous (torch's rule for one dimension), not a negative view, int64 or int32, on the CPU
//! or a CUDA device; anything else is asked of Python as before. The device word is found only
//! where exactly one allocation word reads as the CPU in every probe and as Meta in a meta
//! tensor's storage, so a lookalike field cannot be taken for it while the real one is there; a
//! device type other than CPU or CUDA is never read as either. Otherwise (`dense`) Python first
//! says that the tensor is a 1-D contiguous CPU or CUDA tensor. A thread that `set_`s or resizes
//! an index tensor while a transfer reads it (torch releases the GIL in those methods) races
//! with that read, as it would on the indices themselves: the read may then see the storage
//! being freed, so such a caller is outside what the reads vouch for.
//! `HOSTKV_TENSOR_EXTENT=python` turns the reads off.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::errors::value_err;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyDict, PySlice};

use super::tensor_calls;
use crate::config;

/// Byte offsets, found once per process: the `TensorImpl` pointer in the tensor's Python
/// object; the storage pointer, storage offset and numel in the `TensorImpl`; the data pointer
/// and byte size in the `StorageImpl`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct TorchLayout {
    pub(crate) tensor_impl: usize,
    pub(crate) storage: usize,
    pub(crate) storage_offset: usize,
    pub(crate) numel: usize,
    pub(crate) data: usize,
    pub(crate) nbytes: usize,
    /// The dtype (`caffe2::TypeMeta`, a 16-bit index) in the `TensorImpl`.
    pub(crate) dtype: usize,
    /// The dimension count of the `TensorImpl`'s sizes-and-strides record; the sizes follow it
    /// and the strides start `INLINE_DIMS` words after the sizes (c10 keeps up to five of each
    /// inline). None where not found: index tensors are then asked through Python.
    pub(crate) sizes: Option<usize>,
    /// The device of the storage's allocation (`DataPtr`'s `Device`: type byte, index byte) in
    /// the `StorageImpl`. None where not found, as `sizes`.
    pub(crate) device: Option<usize>,
    /// The word of the `TensorImpl`'s dispatch keys and the bit that marks a negative view
    /// (`torch._neg_view`: the values read are the stored ones negated). None where not found,
    /// as `sizes`.
    pub(crate) negative: Option<(usize, u64)>,
    /// The word of the `TensorImpl`'s flags and the bit that says it is contiguous (c10 keeps
    /// `is_contiguous_` among the bit-fields after the dtype). None where not found: a
    /// snapshot then compares the sizes and strides themselves, one more cache line per tensor.
    pub(crate) contiguous: Option<(usize, u64)>,
}

/// Dimensions c10's `SizesAndStrides` keeps inline (sizes, then strides, after the count).
const INLINE_DIMS: usize = 5;

/// c10 `DeviceType`s an index tensor's allocation is read for: the CPU and CUDA, and Meta
/// (a calibration probe only: its pattern tells the device word from a lookalike).
const DEVICE_CPU: u8 = 0;
const DEVICE_CUDA: u8 = 1;
const DEVICE_META: u8 = 14;

/// One tensor's extent as read through a `TorchLayout`. In C order, what every check compares
/// first and the sizes and strides (compared only for a tensor not contiguous) last: a check
/// over many layers then touches fewer of the snapshots' cache lines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct Extent {
    /// The tensor's Python object (held by the binding).
    object: usize,
    tensor_impl: usize,
    storage_impl: usize,
    storage_offset: u64,
    numel: u64,
    /// The `StorageImpl` words from the data pointer through the byte size.
    allocation: [u64; ALLOCATION_WORDS],
    dtype: u16,
    /// Whether the contiguity bit was set (where it was found).
    contiguous: bool,
    /// The dimension count and the inline sizes and strides, where the sizes record was found
    /// and holds them inline (up to `INLINE_DIMS` dimensions).
    geometry: Option<[u64; GEOMETRY_WORDS]>,
}

/// The sizes-and-strides words a snapshot keeps: the count, then the inline sizes and strides.
const GEOMETRY_WORDS: usize = 1 + 2 * INLINE_DIMS;

impl Extent {
    /// Whether the snapshot read the tensor's contiguity flag, set.
    pub(crate) fn contiguous(&self) -> bool {
        self.contiguous
    }

    /// The tensor's (sizes, strides) as the snapshot read them; None where they were not read.
    pub(crate) fn shape_and_strides(&self) -> Option<(Vec<i64>, Vec<i64>)> {
        let words = self.geometry?;
        let dims = words[0] as usize;
        let sizes = words[1..=dims].iter().map(|&w| w as i64).collect();
        let strides = words[1 + INLINE_DIMS..=INLINE_DIMS + dims]
            .iter()
            .map(|&w| w as i64)
            .collect();
        Some((sizes, strides))
    }
}

/// Words from a storage's data pointer through its byte size that a snapshot keeps (torch 2.15:
/// data, deleter context, deleter, device, byte size); a layout wider than this is not used.
const ALLOCATION_WORDS: usize = 8;

/// What Python reports about one tensor: the values a snapshot must read back.
pub(crate) struct Reported {
    pub(crate) object: usize,
    pub(crate) storage_data: u64,
    pub(crate) storage_nbytes: u64,
    pub(crate) storage_offset: u64,
    pub(crate) numel: u64,
    /// c10's `ScalarType` number of the tensor's dtype, where it is one of the probes' (None:
    /// not needed for a snapshot, which reads whatever the dtype field holds).
    pub(crate) scalar_type: Option<u16>,
    /// Python's object size for the tensor's type: where the `TensorImpl` pointer may sit.
    pub(crate) basicsize: usize,
}

static LAYOUT: PyOnceLock<Result<Option<TorchLayout>, String>> = PyOnceLock::new();

/// The offsets for this process's torch, found on first use; None where they could not be
/// found or `HOSTKV_TENSOR_EXTENT=python`; a ValueError for any other value of it.
pub(crate) fn layout(py: Python<'_>) -> PyResult<Option<TorchLayout>> {
    let found = LAYOUT.get_or_init(py, || match config::tensor_extent_reads() {
        Ok(false) => Ok(None),
        Ok(true) => Ok(calibrate(py).ok().flatten()),
        Err(e) => Err(e.to_string()),
    });
    found.clone().map_err(value_err)
}

/// Reads of any address that fail instead of faulting: the kernel copies the bytes from our
/// address space into a pipe, and an unmapped address is EFAULT, not a signal.
struct SafeReader {
    read_end: OwnedFd,
    write_end: OwnedFd,
}

impl SafeReader {
    fn new() -> Option<Self> {
        let mut fds = [0; 2];
        // SAFETY: `fds` is a valid two-int array for pipe2 to fill.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return None;
        }
        // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nobody else.
        Some(unsafe {
            Self {
                read_end: OwnedFd::from_raw_fd(fds[0]),
                write_end: OwnedFd::from_raw_fd(fds[1]),
            }
        })
    }

    /// The `N` machine words at `addr`, or None if any of their bytes is not readable.
    fn words<const N: usize>(&self, addr: usize) -> Option<[u64; N]> {
        if addr == 0 || addr % 8 != 0 {
            return None;
        }
        let len = N * 8;
        // SAFETY: write(2) reads `len` bytes at `addr` in the kernel, which returns EFAULT
        // (nothing written) for an unmapped range instead of faulting this process.
        let put = unsafe { libc::write(self.write_end.as_raw_fd(), addr as *const _, len) };
        if put != len as isize {
            // A partial write (the range ends in an unmapped page) left bytes to drain.
            if put > 0 {
                let mut sink = vec![0u8; put as usize];
                // SAFETY: `sink` has room for the `put` bytes the pipe holds.
                unsafe {
                    libc::read(
                        self.read_end.as_raw_fd(),
                        sink.as_mut_ptr().cast(),
                        sink.len(),
                    )
                };
            }
            return None;
        }
        let mut out = [0u64; N];
        // SAFETY: `out` is `len` writable bytes; the pipe holds exactly the `len` just written.
        let got = unsafe { libc::read(self.read_end.as_raw_fd(), out.as_mut_ptr().cast(), len) };
        (got == len as isize).then_some(out)
    }

    fn word(&self, addr: usize) -> Option<u64> {
        self.words::<1>(addr).map(|[w]| w)
    }
}

// How far into each object the search looks (bytes); torch's fields sit well inside.
const IMPL_SEARCH: usize = 512;
const STORAGE_SEARCH: usize = 256;
// How far past the dtype's word the negative-view bit is looked for (bytes): the next word.
const KEYS_AFTER_DTYPE: usize = 8;

/// Every set of offsets under which `reported`'s tensor reads back as Python reports it.
fn candidates(reader: &SafeReader, reported: &Reported) -> Vec<TorchLayout> {
    let mut out = Vec::new();
    for tensor_impl in (16..reported.basicsize.min(256)).step_by(8) {
        let Some(impl_addr) = reader.word(reported.object + tensor_impl) else {
            continue;
        };
        let Some(fields) = reader.words::<{ IMPL_SEARCH / 8 }>(impl_addr as usize) else {
            continue;
        };
        let at = |value: u64| -> Vec<usize> {
            (1..fields.len())
                .filter(|&i| fields[i] == value)
                .map(|i| i * 8)
                .collect()
        };
        let offsets = at(reported.storage_offset);
        let numels = at(reported.numel);
        // 16-bit fields: the dtype's TypeMeta index, c10's ScalarType number for these dtypes.
        let dtypes: Vec<usize> = match reported.scalar_type {
            Some(want) => (8..IMPL_SEARCH)
                .step_by(2)
                .filter(|&b| (fields[b / 8] >> ((b % 8) * 8)) as u16 == want)
                .collect(),
            None => Vec::new(),
        };
        if offsets.is_empty() || numels.is_empty() || dtypes.is_empty() {
            continue;
        }
        for (i, &storage_addr) in fields.iter().enumerate().skip(1) {
            let Some(storage) = reader.words::<{ STORAGE_SEARCH / 8 }>(storage_addr as usize)
            else {
                continue;
            };
            let find = |value: u64| -> Vec<usize> {
                (1..storage.len())
                    .filter(|&j| storage[j] == value)
                    .map(|j| j * 8)
                    .collect()
            };
            for data in find(reported.storage_data) {
                for nbytes in find(reported.storage_nbytes) {
                    if nbytes < data || (nbytes - data) / 8 >= ALLOCATION_WORDS {
                        continue;
                    }
                    for &storage_offset in &offsets {
                        for &numel in &numels {
                            for &dtype in &dtypes {
                                out.push(TorchLayout {
                                    tensor_impl,
                                    storage: i * 8,
                                    storage_offset,
                                    numel,
                                    data,
                                    nbytes,
                                    dtype,
                                    sizes: None,
                                    device: None,
                                    negative: None,
                                    contiguous: None,
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// What Python says about `tensor`, for a search or a snapshot (asked through the types'
/// methods, so an instance attribute cannot answer: `tensor_calls`).
pub(crate) fn reported(tensor: &Bound<'_, PyAny>) -> PyResult<Reported> {
    let py = tensor.py();
    let m = tensor_calls::methods(py)?;
    let storage = m.ask(&m.untyped_storage, tensor)?;
    Ok(Reported {
        object: tensor.as_ptr() as usize,
        storage_data: m.ask(&m.storage_data_ptr, &storage)?.extract()?,
        storage_nbytes: m.ask(&m.storage_nbytes, &storage)?.extract()?,
        storage_offset: m.ask(&m.storage_offset, tensor)?.extract()?,
        numel: m.ask(&m.numel, tensor)?.extract()?,
        scalar_type: None,
        basicsize: tensor
            .get_type()
            .getattr(pyo3::intern!(py, "__basicsize__"))?
            .extract()?,
    })
}

/// Probe tensors whose storages come from two allocators (torch's own, and a bytearray's
/// buffer, whose allocation context is not its data pointer), with distinct dtypes, storage
/// sizes, offsets and element counts, 2-D so that no size or stride equals the count.
fn probes(py: Python<'_>) -> PyResult<Vec<(Bound<'_, PyAny>, u16)>> {
    let torch = py.import("torch")?;
    fn view<'py>(
        base: Bound<'py, PyAny>,
        offset: isize,
        rows: usize,
        cols: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let end = offset + (rows * cols) as isize;
        base.get_item(PySlice::new(base.py(), offset, end, 1))?
            .call_method1("view", (rows, cols))
    }
    let dtype = |name: &str| torch.getattr(name);
    // On the CPU by name: a process whose default device is CUDA (`torch.set_default_device`)
    // would otherwise probe device tensors, whose allocation words differ.
    let empty = |n: usize, name: &str| {
        let kw = PyDict::new(py);
        kw.set_item("dtype", dtype(name)?)?;
        kw.set_item("device", "cpu")?;
        torch.call_method("empty", (n,), Some(&kw))
    };
    let kw = PyDict::new(py);
    kw.set_item("dtype", dtype("int64")?)?;
    let from_buffer = torch.call_method(
        "frombuffer",
        (PyByteArray::new(py, &[0u8; 8008]),),
        Some(&kw),
    )?;
    // c10::ScalarType numbers (Short 2, Long 4, Double 7), which a TensorImpl's dtype holds as
    // its TypeMeta index.
    Ok(vec![
        (view(empty(4096, "float64")?, 37, 9, 13)?, 7),
        (view(empty(2050, "int16")?, 101, 7, 11)?, 2),
        (view(from_buffer, 5, 3, 29)?, 4),
    ])
}

fn calibrate(py: Python<'_>) -> PyResult<Option<TorchLayout>> {
    let Some(reader) = SafeReader::new() else {
        return Ok(None);
    };
    let probes = probes(py)?;
    let mut common: Option<Vec<TorchLayout>> = None;
    for (probe, scalar_type) in &probes {
        let mut facts = reported(probe)?;
        facts.scalar_type = Some(*scalar_type);
        let found = candidates(&reader, &facts);
        common = Some(match common {
            None => found,
            Some(before) => before.into_iter().filter(|c| found.contains(c)).collect(),
        });
    }
    let Some([only]) = common.as_deref() else {
        return Ok(None);
    };
    let mut found = *only;
    let shapes = [(9, 13), (7, 11), (3, 29)];
    found.sizes = unique(
        (8..IMPL_SEARCH - (INLINE_DIMS + 2) * 8)
            .step_by(8)
            .filter(|&at| {
                probes.iter().zip(shapes).all(|((probe, _), (rows, cols))| {
                    let impl_addr = reader.word(probe.as_ptr() as usize + found.tensor_impl);
                    let dims = impl_addr
                        .and_then(|a| reader.words::<{ INLINE_DIMS + 3 }>(a as usize + at));
                    dims.is_some_and(|w| {
                        w[0] == 2
                            && w[1] == rows
                            && w[2] == cols
                            && w[1 + INLINE_DIMS] == cols
                            && w[2 + INLINE_DIMS] == 1
                    })
                })
            }),
    );
    found.device = device_offset(py, &reader, &found, &probes).unwrap_or(None);
    found.negative = negative_bit(&reader, &found, &probes).unwrap_or(None);
    found.contiguous = contiguous_bit(&reader, &found, &probes).unwrap_or(None);
    Ok(Some(found))
}

/// The one (word, bit) of the `TensorImpl` that is set in a negative view of each probe and
/// clear in a plain view of it, the two words differing in that bit alone, in the word after
/// the dtype's: c10 keeps the dispatch key set right after the dtype (`data_type_`, the device
/// and the flag bits share a word, then `key_set_`), and the object ends there. Words
/// past the object are the heap's next chunk (its header's size and flag bits), which a plain
/// and a negative view can leave differing by one bit in the same place in every probe: seen
/// in about one process in five (at 176, 184, 472 or 504 bytes here, the key set at 168) when
/// the search ran on. Where torch moves the key set elsewhere, no bit is found and negative
/// views go through Python, which is slower but right.
fn negative_bit(
    reader: &SafeReader,
    found: &TorchLayout,
    probes: &[(Bound<'_, PyAny>, u16)],
) -> PyResult<Option<(usize, u64)>> {
    let py = probes[0].0.py();
    let torch = py.import("torch")?;
    let mut pairs = Vec::new();
    for (probe, _) in probes {
        let plain = probe.call_method1("view", (probe.getattr("shape")?,))?;
        let negative = torch.call_method1("_neg_view", (probe,))?;
        let words = |t: &Bound<'_, PyAny>| {
            let impl_addr = reader.word(t.as_ptr() as usize + found.tensor_impl)?;
            reader.words::<{ IMPL_SEARCH / 8 }>(impl_addr as usize)
        };
        match (words(&plain), words(&negative)) {
            (Some(a), Some(b)) => pairs.push((a, b)),
            _ => return Ok(None),
        }
    }
    // The words after the dtype's: the dtype's own word holds c10's flag bits, one of which
    // also differs between a plain and a negative view in some processes.
    let from = found.dtype / 8 + 1;
    let to = ((found.dtype + KEYS_AFTER_DTYPE) / 8).min(IMPL_SEARCH / 8 - 1);
    let mut hits = (from..=to).filter_map(|i| {
        let bit = pairs[0].0[i] ^ pairs[0].1[i];
        let marks = bit.count_ones() == 1
            && pairs
                .iter()
                .all(|(plain, neg)| plain[i] & bit == 0 && plain[i] ^ neg[i] == bit);
        marks.then_some((i * 8, bit))
    });
    let first = hits.next();
    Ok(first.filter(|_| hits.next().is_none()))
}

/// The one (word, bit) of the `TensorImpl`, in the dtype's word or the few after it, that is set
/// in each (contiguous, 2-D) probe and clear in its transpose, a view of the same storage, offset
/// and count that is not contiguous. Where there is not exactly one, None.
fn contiguous_bit(
    reader: &SafeReader,
    found: &TorchLayout,
    probes: &[(Bound<'_, PyAny>, u16)],
) -> PyResult<Option<(usize, u64)>> {
    let from = found.dtype / 8;
    let to = ((found.dtype + KEYS_AFTER_DTYPE) / 8).min(IMPL_SEARCH / 8 - 1);
    let mut candidates: Option<Vec<u64>> = None;
    for (probe, _) in probes {
        let transposed = probe.call_method0("t")?;
        let words = |t: &Bound<'_, PyAny>| {
            let impl_addr = reader.word(t.as_ptr() as usize + found.tensor_impl)?;
            reader.words::<{ IMPL_SEARCH / 8 }>(impl_addr as usize)
        };
        let (Some(plain), Some(other)) = (words(probe), words(&transposed)) else {
            return Ok(None);
        };
        let bits: Vec<u64> = (from..=to).map(|i| plain[i] & !other[i]).collect();
        candidates = Some(match candidates {
            None => bits,
            Some(before) => before.iter().zip(&bits).map(|(a, b)| a & b).collect(),
        });
    }
    let bits = candidates.unwrap_or_default();
    if bits.iter().map(|w| w.count_ones()).sum::<u32>() != 1 {
        return Ok(None);
    }
    Ok(bits
        .iter()
        .position(|&w| w != 0)
        .map(|k| ((from + k) * 8, bits[k])))
}

/// The one item of `items`, or None where there are none or several.
fn unique(mut items: impl Iterator<Item = usize>) -> Option<usize> {
    let first = items.next()?;
    items.next().is_none().then_some(first)
}

/// Where the storage's allocation device sits among its allocation words: the one word that
/// reads as the CPU (type 0, index -1) in every CPU probe and as Meta in a meta tensor's storage.
fn device_offset(
    py: Python<'_>,
    reader: &SafeReader,
    found: &TorchLayout,
    probes: &[(Bound<'_, PyAny>, u16)],
) -> PyResult<Option<usize>> {
    let torch = py.import("torch")?;
    let kw = PyDict::new(py);
    kw.set_item("device", "meta")?;
    let meta = torch.call_method("empty", (8,), Some(&kw))?;
    let word = |tensor: &Bound<'_, PyAny>, at: usize| -> Option<u64> {
        let impl_addr = reader.word(tensor.as_ptr() as usize + found.tensor_impl)?;
        let storage = reader.word(impl_addr as usize + found.storage)?;
        reader.word(storage as usize + at)
    };
    let pattern = |kind: u8| u64::from(kind) | 0xFF00;
    Ok(unique(
        (1..found.allocation_words() - 1)
            .map(|k| found.data + k * 8)
            .filter(|&at| {
                probes
                    .iter()
                    .all(|(p, _)| word(p, at).is_some_and(|w| w & 0xFFFF == pattern(DEVICE_CPU)))
                    && word(&meta, at).is_some_and(|w| w & 0xFFFF == pattern(DEVICE_META))
            }),
    ))
}

impl TorchLayout {
    /// `reported`'s tensor read through these offsets, if that is exactly what Python reports
    /// (read faultlessly: the tensor has not been vouched for yet).
    pub(crate) fn snapshot(&self, reported: &Reported) -> Option<Extent> {
        let reader = SafeReader::new()?;
        let tensor_impl = reader.word(reported.object + self.tensor_impl)? as usize;
        let storage_impl = reader.word(tensor_impl + self.storage)? as usize;
        let mut allocation = [0u64; ALLOCATION_WORDS];
        for (k, word) in allocation
            .iter_mut()
            .enumerate()
            .take(self.allocation_words())
        {
            *word = reader.word(storage_impl + self.data + k * 8)?;
        }
        let dtype_word = reader.word((tensor_impl + self.dtype) & !7)?;
        let geometry = self.sizes.and_then(|at| {
            let words = reader.words::<GEOMETRY_WORDS>(tensor_impl + at)?;
            (words[0] as usize <= INLINE_DIMS).then_some(words)
        });
        let extent = Extent {
            object: reported.object,
            tensor_impl,
            storage_impl,
            storage_offset: reader.word(tensor_impl + self.storage_offset)?,
            numel: reader.word(tensor_impl + self.numel)?,
            dtype: (dtype_word >> (((tensor_impl + self.dtype) % 8) * 8)) as u16,
            allocation,
            geometry,
            contiguous: self
                .contiguous
                .and_then(|(at, bit)| reader.word(tensor_impl + at).map(|w| w & bit != 0))
                .unwrap_or(false),
        };
        // The allocation words run from the data pointer to the byte size.
        let (data, nbytes) = (allocation[0], allocation[self.allocation_words() - 1]);
        let agrees = data != 0
            && data == reported.storage_data
            && nbytes == reported.storage_nbytes
            && extent.storage_offset == reported.storage_offset
            && extent.numel == reported.numel;
        agrees.then_some(extent)
    }

    /// Whether the tensor of `extent` still has it: same `TensorImpl`, same storage, same
    /// allocation and byte size, same offset, count and dtype, and the same sizes and strides
    /// where the snapshot read them.
    ///
    /// # Safety
    /// `extent` came from `snapshot` with these offsets, the caller holds the GIL, and the
    /// tensor object and the storage object it was taken from are still held alive (so every
    /// address read here lies inside a live object).
    pub(crate) unsafe fn unchanged(&self, extent: &Extent) -> bool {
        let read = |addr: usize| -> u64 {
            // SAFETY: per this function's contract, `addr` lies inside a live, aligned object.
            unsafe { std::ptr::read_volatile(addr as *const u64) }
        };
        // The dtype's aligned word: the contiguity flag usually shares it (one load for both).
        let dtype_at = extent.tensor_impl + self.dtype;
        let dtype_word = |w: u64| (w >> ((dtype_at % 8) * 8)) as u16;
        // The order matters: each pointer is read through only once it is known to be the
        // snapshot's (see the module doc).
        if read(extent.object + self.tensor_impl) as usize != extent.tensor_impl
            || read(extent.tensor_impl + self.storage) as usize != extent.storage_impl
        {
            return false;
        }
        let word = read(dtype_at & !7);
        (0..self.allocation_words())
            .all(|k| read(extent.storage_impl + self.data + k * 8) == extent.allocation[k])
            && read(extent.tensor_impl + self.storage_offset) == extent.storage_offset
            && read(extent.tensor_impl + self.numel) == extent.numel
            && dtype_word(word) == extent.dtype
            && match (self.sizes, &extent.geometry) {
                // A tensor still contiguous with the same storage, offset, count and dtype covers
                // the same bytes in the same order of rows (the flag shares a cache line with the
                // fields above; the sizes do not).
                _ if extent.contiguous => {
                    let (at, bit) = self.contiguous.unwrap_or_default();
                    let at = extent.tensor_impl + at;
                    let flags = if at == dtype_at & !7 { word } else { read(at) };
                    flags & bit != 0
                }
                // The count, then only the sizes and strides it covers.
                (Some(at), Some(words)) => {
                    let at = extent.tensor_impl + at;
                    let dims = words[0] as usize;
                    read(at) == words[0]
                        && (1..=dims).all(|k| {
                            read(at + k * 8) == words[k]
                                && read(at + (k + INLINE_DIMS) * 8) == words[k + INLINE_DIMS]
                        })
                }
                _ => true,
            }
    }

    /// Words from the data pointer through the byte size.
    fn allocation_words(&self) -> usize {
        (self.nbytes - self.data) / 8 + 1
    }
}

/// A storage's allocation as a snapshot read it: what a host pool's memory is checked against
/// on every call without asking Python (see `memory::StorageWatch`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct StorageAllocation {
    layout: TorchLayout,
    storage_impl: usize,
    words: [u64; ALLOCATION_WORDS],
}

impl Extent {
    /// The allocation of this extent's storage, to compare later through `layout`.
    pub(crate) fn allocation(&self, layout: &TorchLayout) -> StorageAllocation {
        StorageAllocation {
            layout: *layout,
            storage_impl: self.storage_impl,
            words: self.allocation,
        }
    }
}

impl StorageAllocation {
    /// The `StorageImpl` it was read through.
    pub(crate) fn storage_impl(&self) -> usize {
        self.storage_impl
    }

    /// Whether the storage still holds the allocation the snapshot read (data pointer, its
    /// deleter and context, byte size).
    ///
    /// # Safety
    /// The caller holds the GIL and a Python storage object of this very `StorageImpl` (its
    /// `_cdata`, compared when the watch was made), which keeps it allocated.
    pub(crate) unsafe fn unchanged(&self) -> bool {
        // SAFETY: this function's contract is `now`'s.
        unsafe { self.now() == self.words }
    }

    /// The allocation words as they are now (the unused tail zero, as in `words`).
    ///
    /// # Safety
    /// As [`unchanged`](Self::unchanged).
    pub(crate) unsafe fn now(&self) -> [u64; ALLOCATION_WORDS] {
        let base = self.storage_impl + self.layout.data;
        let mut words = [0u64; ALLOCATION_WORDS];
        for (k, word) in words
            .iter_mut()
            .enumerate()
            .take(self.layout.allocation_words())
        {
            // SAFETY: per this function's contract the `StorageImpl` is live; the words from
            // its data pointer through its byte size are aligned fields inside it.
            *word = unsafe { read_word(base + k * 8) };
        }
        words
    }
}

/// A storage's allocation words as read at one moment (`StorageAllocation::now`).
pub(crate) type AllocationWords = [u64; ALLOCATION_WORDS];

/// One word of a live torch object.
///
/// # Safety
/// `addr` is 8-byte aligned and lies inside a live object.
unsafe fn read_word(addr: usize) -> u64 {
    // SAFETY: per this function's contract.
    unsafe { std::ptr::read_volatile(addr as *const u64) }
}

/// What a dense tensor's objects say about its memory: the element count and offset, and its
/// storage's data pointer and byte size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dense {
    pub(crate) numel: u64,
    pub(crate) storage_offset: u64,
    pub(crate) storage_data: u64,
    pub(crate) storage_nbytes: u64,
}

impl TorchLayout {
    /// The extent of a tensor nobody has snapshotted (an index tensor, read once per call), or
    /// None where it has no storage (sparse, opaque and other storage-less tensors).
    ///
    /// # Safety
    /// `object` is a live Python object of exactly type `torch.Tensor` (whose layout the
    /// offsets were found for), on a CPU or CUDA device, and the caller holds the GIL and a
    /// reference to it for the duration of the call (the tensor owns its `TensorImpl`, which
    /// owns its storage).
    pub(crate) unsafe fn dense(&self, object: usize) -> Option<Dense> {
        // SAFETY: per this function's contract the object is live and exactly a tensor.
        let (tensor_impl, storage) = unsafe { self.impls(object) }?;
        // SAFETY: both pointers were just read from the live tensor.
        unsafe { self.dense_of(tensor_impl, storage) }
    }

    /// The tensor's `TensorImpl` and `StorageImpl` addresses, None where either is null.
    ///
    /// # Safety
    /// As [`dense`](Self::dense).
    unsafe fn impls(&self, object: usize) -> Option<(usize, usize)> {
        // SAFETY: per the contract both addresses lie inside the live tensor object or its
        // `TensorImpl`, at found (aligned) offsets.
        let tensor_impl = unsafe { read_word(object + self.tensor_impl) } as usize;
        if tensor_impl == 0 {
            return None;
        }
        // SAFETY: the impl is the live tensor's own (non-null, just read).
        let storage = unsafe { read_word(tensor_impl + self.storage) } as usize;
        (storage != 0).then_some((tensor_impl, storage))
    }

    /// `dense` past the pointer reads.
    ///
    /// # Safety
    /// `tensor_impl` and `storage` were read by `impls` from a tensor that, per `dense`'s
    /// contract, is still alive.
    unsafe fn dense_of(&self, tensor_impl: usize, storage: usize) -> Option<Dense> {
        let read = |addr: usize| -> u64 {
            // SAFETY: each address lies inside the live `TensorImpl` or its `StorageImpl`.
            unsafe { read_word(addr) }
        };
        let dense = Dense {
            numel: read(tensor_impl + self.numel),
            storage_offset: read(tensor_impl + self.storage_offset),
            storage_data: read(storage + self.data),
            storage_nbytes: read(storage + self.nbytes),
        };
        // A storage without memory (functionalized, fake): the conversion path refuses it.
        (dense.storage_data != 0 || dense.numel == 0).then_some(dense)
    }
}

/// What an index tensor's objects say, read without Python: its dtype, whether its memory is
/// on a CUDA device, and its extent.
pub(crate) struct IndexFacts {
    /// c10's `ScalarType` number (4: int64, 3: int32).
    pub(crate) scalar_type: u16,
    pub(crate) on_device: bool,
    pub(crate) dense: Dense,
}

impl TorchLayout {
    /// An index tensor's facts where it is a 1-D contiguous tensor whose memory is on the CPU
    /// or a CUDA device and has data; None otherwise (or where the sizes or the device were
    /// not found): the caller then asks Python, which refuses what must be refused with its
    /// own text.
    ///
    /// # Safety
    /// As [`dense`](Self::dense).
    pub(crate) unsafe fn index(&self, object: usize) -> Option<IndexFacts> {
        let (sizes, device, (keys, negative)) = (self.sizes?, self.device?, self.negative?);
        let read = |addr: usize| -> u64 {
            // SAFETY: as `dense`: each address lies inside the live tensor object, its
            // `TensorImpl` or that impl's `StorageImpl`, at the found (aligned) offsets.
            unsafe { read_word(addr) }
        };
        // SAFETY: this function's contract is `dense`'s.
        let (tensor_impl, storage) = unsafe { self.impls(object) }?;
        // A negative view's values are not its stored ones: Python resolves it.
        if read(tensor_impl + sizes) != 1 || read(tensor_impl + keys) & negative != 0 {
            return None;
        }
        let size = read(tensor_impl + sizes + 8);
        let stride = read(tensor_impl + sizes + 8 * (1 + INLINE_DIMS)) as i64;
        // torch's contiguity of one dimension: fewer than two elements, or unit stride.
        if size > 1 && stride != 1 {
            return None;
        }
        let on_device = match read(storage + device) as u8 {
            DEVICE_CPU => false,
            DEVICE_CUDA => true,
            _ => return None,
        };
        let dtype_at = tensor_impl + self.dtype;
        let scalar_type = (read(dtype_at & !7) >> ((dtype_at % 8) * 8)) as u16;
        // SAFETY: the pointers were read from the live tensor above.
        let dense = unsafe { self.dense_of(tensor_impl, storage) }?;
        (dense.numel == size).then_some(IndexFacts {
            scalar_type,
            on_device,
            dense,
        })
    }
}

/// `_core.tensor_extent_layout()`: the offsets this process reads tensors' extents at, or None
/// where every check goes through Python (diagnostics and tests).
#[pyfunction]
pub(crate) fn tensor_extent_layout(py: Python<'_>) -> PyResult<Option<Vec<(&'static str, usize)>>> {
    Ok(layout(py)?.map(|l| {
        let mut fields = vec![
            ("tensor_impl", l.tensor_impl),
            ("storage", l.storage),
            ("storage_offset", l.storage_offset),
            ("numel", l.numel),
            ("data", l.data),
            ("nbytes", l.nbytes),
            ("dtype", l.dtype),
        ];
        // Found separately: an index tensor is read without Python only where both are.
        fields.extend(l.sizes.map(|at| ("sizes", at)));
        fields.extend(l.device.map(|at| ("device", at)));
        fields.extend(l.negative.map(|(at, _)| ("negative", at)));
        fields.extend(l.contiguous.map(|(at, _)| ("contiguous", at)));
        fields
    }))
}
