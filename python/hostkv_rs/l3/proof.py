"""The proof every stored page carries: a 64-byte header in front of the page's bytes.

    offset  bytes  field
         0      8  magic b"hkvpage\\0"
         8      2  header version (2), little endian like every field
        10      2  header bytes (64)
        12      4  zero
        16      8  page bytes (the object is header + page)
        24     16  identity digest: XXH3-128 of the writer's model identity and format tag
        40     16  page digest: XXH3-128 of the object's store key (its UTF-8 length as 8
                   bytes, then the bytes) and the page's bytes, buffer after buffer
        56      8  check: the low 64 bits of XXH3-128 of bytes 0..56

Why a header inside the object, not a companion key: the digest then travels and is evicted,
replaced or removed with the bytes it proves, atomically (a companion object can outlive or miss
its page, and doubles the master's objects and round trips). The key is under the digest so that
an intact object under another key (copied there, or a store-side mix-up) is no proof of this
key's page (version 1 headers proved the bytes alone; they now read as foreign). The page itself
still moves zero-copy: the header lives in a small buffer the tier registers beside the pool, and
each put or get names it as the first piece of a multi-buffer transfer, so no page byte is copied
to add it.

The digests come from `hostkv_rs._core.digest` (Rust, without the GIL) over byte views of the
pool's own HostRegions or tensors, sliced with bounds checks (`PoolBytes`): no hash starts from a
bare address, and a page buffer outside the pool's memory raises instead of being read.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import os
import struct
import threading
import warnings

import numpy as np

from hostkv_rs import _core

HEADER_BYTES = 64
MAGIC = b"hkvpage\x00"
HEADER_VERSION = 2
_FIELDS = struct.Struct("<8sHHIQ16s16s")  # bytes 0..56
_CHECK = struct.Struct("<Q")  # bytes 56..64
_LOW64 = (1 << 64) - 1

# Kinds of proof failure: the tier counts and logs them under these names.
FOREIGN = "foreign"  # not a header this tier writes (another writer's object, a damaged header)
IDENTITY = "identity"  # a valid header of another model or format
DIGEST = "digest"  # our header, but the bytes are not the ones it proves (corrupted, torn)


def text_digest(text: str) -> int:
    return _core.digest([memoryview(text.encode("utf-8"))])


def encode(buf: memoryview, offset: int, page_bytes: int, identity: bytes, page_digest: int):
    """Write one header at `buf[offset:offset + 64]`."""
    _FIELDS.pack_into(
        buf,
        offset,
        MAGIC,
        HEADER_VERSION,
        HEADER_BYTES,
        0,
        page_bytes,
        identity,
        page_digest.to_bytes(16, "little"),
    )
    head = buf[offset : offset + _FIELDS.size]
    _CHECK.pack_into(buf, offset + _FIELDS.size, _core.digest([head]) & _LOW64)


def decode(buf: memoryview, offset: int, page_bytes: int, identity: bytes):
    """(failure kind or None, the page digest the header proves). A header that is not ours or
    is damaged is FOREIGN; a sound one of another writer's identity is IDENTITY."""
    head = buf[offset : offset + _FIELDS.size]
    (check,) = _CHECK.unpack_from(buf, offset + _FIELDS.size)
    magic, version, nbytes, zero, size, their_identity, digest = _FIELDS.unpack_from(buf, offset)
    if (
        magic != MAGIC
        or version != HEADER_VERSION
        or nbytes != HEADER_BYTES
        or zero != 0
        or check != _core.digest([head]) & _LOW64
    ):
        return FOREIGN, None
    if size != page_bytes:  # a sound header that contradicts its own object's size
        return FOREIGN, None
    if their_identity != identity:
        return IDENTITY, None
    return None, int.from_bytes(digest, "little")


class Headers:
    """A registered scratch buffer of one header per page of a store batch."""

    def __init__(self, slots: int):
        self.slots = int(slots)
        self.array = np.zeros(self.slots * HEADER_BYTES, dtype=np.uint8)
        self.view = memoryview(self.array)
        self.address = int(self.array.ctypes.data)
        self.nbytes = int(self.array.nbytes)

    def slot(self, j: int) -> int:
        """Address of header slot `j`, for the store's transfer calls."""
        if not 0 <= j < self.slots:
            raise IndexError(f"header slot {j} of {self.slots}")
        return self.address + j * HEADER_BYTES


class PoolBytes:
    """Byte views of every host allocation of one pool, and of page buffers inside them.

    Built per operation and dropped after it: a view keeps a HostRegion mapped, and a tier
    holding one past detach() would keep a destroyed pool's memory alive."""

    def __init__(self, allocations):
        spans = []
        for address, nbytes, owner in allocations:
            view = _byte_view(owner)
            if int(view.ctypes.data) != address or view.nbytes != nbytes:
                raise ValueError(
                    f"the byte view of a {type(owner).__name__} ({view.nbytes} bytes at "
                    f"{int(view.ctypes.data):#x}) is not the allocation it should be "
                    f"({nbytes} bytes at {address:#x})"
                )
            spans.append((address, view))
        spans.sort(key=lambda s: s[0])
        self._bases = [a for a, _ in spans]
        self._views = [v for _, v in spans]
        self._starts = np.array(self._bases, dtype=np.uint64)
        self._ends = np.array([a + v.nbytes for a, v in spans], dtype=np.uint64)

    def check(self, ptrs, sizes) -> None:
        """Raise ValueError unless every buffer lies inside one of the pool's allocations (all
        at once, before any byte moves)."""
        try:
            with warnings.catch_warnings():
                # numpy 1.x wraps a negative address into a large one, with only this warning.
                warnings.simplefilter("error", DeprecationWarning)
                p = np.asarray(ptrs, dtype=np.uint64)
            n = np.asarray(sizes, dtype=np.int64)
        except (OverflowError, TypeError, ValueError, DeprecationWarning):
            raise ValueError(
                "page buffers must be given as addresses in [0, 2**64) and sizes in [0, 2**63)"
            ) from None
        if not p.size:
            return
        inside = n > 0
        if len(self._starts):
            j = np.searchsorted(self._starts, p, side="right").astype(np.int64) - 1
            end = self._ends[np.clip(j, 0, None)]
            # `p + n` could wrap past 2**64 and land inside: compare what is left after p.
            # Past the end there is no room, and `inside` already asks for n > 0.
            room = np.where(p <= end, end - p, 0)
            inside &= (j >= 0) & (n.astype(np.uint64) <= room)
        else:
            inside[:] = False
        if not inside.all():
            k = int(np.argmin(inside))
            raise ValueError(_outside(int(p[k]), int(n[k])))

    def piece(self, ptr: int, size: int) -> np.ndarray:
        """The bytes of one page buffer; raises ValueError for one outside the pool's memory."""
        j = bisect.bisect_right(self._bases, ptr) - 1
        if j >= 0 and size > 0 and ptr + size <= self._bases[j] + self._views[j].nbytes:
            off = ptr - self._bases[j]
            return self._views[j][off : off + size]
        raise ValueError(_outside(ptr, size))

    def pieces(self, page) -> list[np.ndarray]:
        """Views of one page's buffers, in order. This runs for every buffer of every page
        moved (64 per MHA layer_first page): the allocation of the previous buffer is tried
        before a search."""
        out = []
        base, end, view = 0, -1, None
        for ptr, size in zip(*page):
            if not (base <= ptr and ptr + size <= end and size > 0):
                out.append(self.piece(ptr, size))
                j = bisect.bisect_right(self._bases, ptr) - 1
                base, view = self._bases[j], self._views[j]
                end = base + view.nbytes
                continue
            out.append(view[ptr - base : ptr - base + size])
        return out


def _outside(ptr: int, size: int) -> str:
    return f"a page buffer of {size} bytes at {ptr:#x} lies outside the pool's host memory"


def _byte_view(owner) -> np.ndarray:
    """A writable uint8 view of a HostRegion or a CPU tensor (never of a device tensor: its
    bytes are not host memory)."""
    import torch

    if isinstance(owner, torch.Tensor):
        if owner.device.type != "cpu":
            raise ValueError(f"a {owner.device} tensor holds no host bytes to digest")
        return owner.detach().reshape(-1).view(torch.uint8).numpy()
    return np.frombuffer(owner, dtype=np.uint8)


def page_digest(memory: PoolBytes, page, key: str) -> int:
    """XXH3-128 of store key `key` and one page's bytes (see the header's page digest). The views
    are made here, on a hashing thread, while the caller's thread is inside the store's transfer
    call without the GIL."""
    name = key.encode("utf-8")
    return _core.digest([len(name).to_bytes(8, "little"), name, *memory.pieces(page)])


# One process-wide pool of hashing threads: `_core.digest` runs without the GIL, so pages hash
# while the store's own threads move other pages (overlap is what keeps the proof cheap).
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_PID = 0
_POOL_LOCK = threading.Lock()


def hasher() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        # a forked child inherits the executor but not its threads: it would wait forever
        if _POOL is None or _POOL_PID != os.getpid():
            _POOL = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, min(4, (os.cpu_count() or 2) - 1)),
                thread_name_prefix="hostkv-l3-digest",
            )
            _POOL_PID = os.getpid()
        return _POOL
