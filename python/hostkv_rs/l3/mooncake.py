"""`MooncakeTier`: host pool pages to and from a Mooncake Store, zero-copy.

One object per page, moved straight between the pool's registered host memory and the store
(`batch_put_from` / `batch_get_into`, or their multi-buffer forms when a page is several buffers,
e.g. MHA layer_first: 2 x layers of them). Safe by construction:

* keys carry the page format tag (`hostkv_rs.l3.format`): another layout, dtype, geometry or
  shard computes other keys and misses;
* a load counts only when the stored object has exactly the page's size; sizes are checked
  before any byte moves, so a short or long object never touches the pool;
* a page whose transfer fails after it started is zero-filled (never half-written) and reported;
  a page that fails before any byte moved is left as it was;
* pages already stored with the right size are skipped on save (a wrong-size object under the
  key is replaced);
* the master not answering raises `StoreUnavailable` (nothing is written to the pool then);
  `connect` asks the master's TCP port first, so a wrong address fails in seconds, in one line
  (`hostkv_rs.l3._native`), instead of Mooncake's ~100 s of retries;
* Mooncake's native logging stays quiet unless HOSTKV_MOONCAKE_LOG is set (`_native`);
* `detach()`, the pool's `destroy()` and the pool's garbage collection all unregister its host
  memory from the client, once, so a later pool at the same addresses can register again.
"""

from __future__ import annotations

import ctypes
import enum
import ipaddress
import logging
import os
import threading
import weakref
from dataclasses import dataclass

import torch

from hostkv_rs._indices import as_index_array
from hostkv_rs.l3 import _native
from hostkv_rs.l3.format import PageFormat, host_buffers, page_format

logger = logging.getLogger(__name__)

# Mooncake's ErrorCode values (mooncake-store/include/types.h) that this tier tells apart.
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
NO_AVAILABLE_HANDLE = -200  # the store is full
INVALID_PARAMS = -600  # e.g. the buffer is smaller than the object: nothing moved
TRANSFER_FAIL = -800
RPC_FAIL = -900  # the master did not answer
_CODE_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE (store full)",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    INVALID_PARAMS: "INVALID_PARAMS",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
}
# Codes of a get that fail before any byte reaches the destination buffer.
_NOTHING_MOVED = {OBJECT_NOT_FOUND, INVALID_PARAMS, RPC_FAIL, -703, -400}

DEFAULT_SEGMENT_BYTES = 1 << 30
DEFAULT_LOCAL_BUFFER_BYTES = 16 << 20
DEFAULT_BATCH_BYTES = 256 << 20


def code_name(code: int) -> str:
    return _CODE_NAMES.get(int(code), f"error {int(code)}")


class Status(str, enum.Enum):
    STORED = "stored"  # save: written now
    SKIPPED = "skipped"  # save: already stored with the right size
    LOADED = "loaded"  # load: every byte of the page came from the store
    REMOVED = "removed"
    MISSING = "missing"  # no object under this key (for this pool's format)
    WRONG_SIZE = "wrong_size"  # load: the object is not exactly one page; the pool is untouched
    FULL = "full"  # save: the store has no room
    BUSY = "busy"  # remove: a reader holds a lease on the object (use force=True)
    FAILED = "failed"  # see `code`


_OK = {Status.STORED, Status.SKIPPED, Status.LOADED, Status.REMOVED}


@dataclass(frozen=True)
class PageResult:
    """The outcome for one page; truthy when it succeeded (`all(tier.load(...))`)."""

    status: Status
    code: int = 0  # Mooncake's return value where one explains the status
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in _OK

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        extra = f", {code_name(self.code)}" if self.code < 0 else ""
        extra += f", {self.detail}" if self.detail else ""
        return f"PageResult({self.status.value}{extra})"


class L3Error(RuntimeError):
    """A store operation could not be carried out (setup, registration, a malformed request)."""


class StoreUnavailable(L3Error):
    """The Mooncake master did not answer. `results` holds what is known per page (pages that
    failed this way were not written to the pool)."""

    def __init__(self, message: str, results=None):
        super().__init__(message)
        self.results = results


MOONCAKE_HINT = (
    'pip install ".[mooncake]" in the hostkv_rs checkout (the mooncake-transfer-engine-non-cuda '
    "wheel; its native libraries also need the Debian packages libibverbs1 and libnuma1)"
)


def _import_store_class():
    # the log level must be in the environment before the native module is loaded
    _native.quiet_logging_env()
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError(f"hostkv_rs.l3 needs Mooncake: {MOONCAKE_HINT}: {exc}") from exc
    return MooncakeDistributedStore


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _unregister(store, spans, lock=None) -> None:
    """Finalizer body: unregister `spans` from `store` (never raises: it runs from destroy(), from
    garbage collection, or from detach()). Under the tier's lock, so a destroy() on another thread
    waits for a transfer in flight."""
    if lock is not None:
        with lock:
            _unregister(store, spans)
        return
    for address, _nbytes in spans:
        try:
            rc = store.unregister_buffer(address)
        except Exception:  # a closed client
            logger.warning("Mooncake unregister_buffer(%#x) raised", address, exc_info=True)
            continue
        if rc != 0:
            logger.warning("Mooncake unregister_buffer(%#x) returned %s", address, code_name(rc))


class MooncakeTier:
    """A store tier over a running Mooncake Store for one host pool at a time.

    `MooncakeTier.connect(master, metadata_server)` sets up a client (it contributes
    `global_segment_size` bytes of this process's memory to the store; 0 contributes none), or
    pass an already set up `mooncake.store.MooncakeDistributedStore`. Then `attach(pool)` and
    `save` / `load` / `exists` / `remove` with one key per page and `host_indices` naming those
    pages (page_size consecutive slots per page, in key order; logical slots under DCP).
    Results are one `PageResult` per key (`exists` returns booleans).

    `namespace` prefixes every key (e.g. the model name); `tp_rank`/`tp_size`/`pp_rank`/`pp_size`
    name this shard (the pool itself knows its DCP rank).
    """

    def __init__(
        self,
        store,
        *,
        namespace: str = "",
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        max_batch_bytes: int = DEFAULT_BATCH_BYTES,
        owns_store: bool = False,
        master: str = "",
    ):
        self.store = store
        self.namespace = namespace
        self.ranks = {
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "pp_rank": pp_rank,
            "pp_size": pp_size,
        }
        self.max_batch_bytes = int(max_batch_bytes)
        self.master = master
        self._owns_store = owns_store
        self._lock = threading.RLock()
        self._pool_ref = None
        self._format: PageFormat | None = None
        self._finalizer = None
        self._closed = False

    @classmethod
    def connect(
        cls,
        master: str,
        metadata_server: str,
        *,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        global_segment_size: int = DEFAULT_SEGMENT_BYTES,
        local_buffer_size: int = DEFAULT_LOCAL_BUFFER_BYTES,
        probe_timeout: float | None = _native.PROBE_TIMEOUT_S,
        **kwargs,
    ) -> MooncakeTier:
        """Set up a Mooncake client against `master` ("host:port") and `metadata_server`
        ("http://host:port/metadata" for the master's embedded one, or "P2PHANDSHAKE").

        The master's port (and an http metadata server's) must accept a TCP connection within
        `probe_timeout` seconds, else StoreUnavailable is raised at once (None: no probe, leave
        it to Mooncake's retries). With the tcp protocol on a loopback `local_hostname`,
        MC_TCP_BIND_ADDRESS is set to it when unset, so the client advertises loopback and not
        the machine's first interface. MC_LOG_LEVEL defaults to ERROR and the setup's known
        harmless lines are dropped, unless HOSTKV_MOONCAKE_LOG is set."""
        store_cls = _import_store_class()
        if probe_timeout is not None:
            _native.probe(master, metadata_server, probe_timeout)
        if protocol == "tcp" and _is_loopback(local_hostname):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
        with _native.filtered_stderr():
            store = store_cls()
            rc = store.setup(
                local_hostname,
                metadata_server,
                int(global_segment_size),
                int(local_buffer_size),
                protocol,
                device_name,
                master,
            )
        if rc != 0:
            raise L3Error(
                f"Mooncake client setup against master {master} (metadata {metadata_server}, "
                f"protocol {protocol}) failed: {code_name(rc)}"
            )
        return cls(store, owns_store=True, master=master, **kwargs)

    # ----------------------------------------------------------------- attach / detach

    @property
    def pool(self):
        """The attached pool, or None (detached, destroyed or garbage collected)."""
        if self._finalizer is None or not self._finalizer.alive:
            return None
        return self._pool_ref()

    @property
    def attached(self) -> bool:
        return self.pool is not None

    @property
    def format(self) -> PageFormat | None:
        return self._format if self.attached else None

    def attach(self, pool) -> PageFormat:
        """Register every host buffer of `pool` with the client (once) and make it the pool this
        tier moves pages of. Returns its page format."""
        with self._lock:
            self._check_open()
            if self.attached:
                raise L3Error(
                    f"this tier already has a pool attached ({type(self.pool).__name__}); "
                    "detach() it first"
                )
            fmt = page_format(pool, namespace=self.namespace, **self.ranks)
            spans = host_buffers(pool)
            done = []
            for address, nbytes in spans:
                rc = self.store.register_buffer(address, nbytes)
                if rc != 0:
                    _unregister(self.store, done)
                    raise L3Error(
                        f"Mooncake refused to register {nbytes} bytes at {address:#x} of "
                        f"{type(pool).__name__}: {code_name(rc)}. Mooncake refuses a range that "
                        "overlaps one still registered (an earlier pool at these addresses freed "
                        "without detaching from this client?), and any registration while the "
                        f"metadata server of master {self.master or '(unknown)'} is unreachable"
                    )
                done.append((address, nbytes))
            # One finalizer does the unregistering for all three ways out (detach, destroy(), GC);
            # it holds the client and the addresses, never the pool.
            finalizer = weakref.finalize(pool, _unregister, self.store, tuple(done), self._lock)
            finalizer.atexit = False  # at exit the client goes away with its registrations
            from hostkv_rs.base import on_destroy

            on_destroy(pool, finalizer)
            self._pool_ref = weakref.ref(pool)
            self._format = fmt
            self._finalizer = finalizer
            return fmt

    def detach(self) -> None:
        """Unregister the attached pool's host memory (idempotent)."""
        with self._lock:
            finalizer, self._finalizer = self._finalizer, None
            pool = self._pool_ref() if self._pool_ref is not None else None
            self._pool_ref = None
            self._format = None
            if finalizer is not None:
                finalizer()
                if pool is not None:
                    callbacks = pool.__dict__.get("_on_destroy")
                    if callbacks and finalizer in callbacks:
                        callbacks.remove(finalizer)

    def close(self) -> None:
        """Detach, then close the client when this tier set it up (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self.detach()
            self._closed = True
            if self._owns_store:
                self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self._closed:
            raise L3Error("this MooncakeTier is closed")

    # ----------------------------------------------------------------- keys and pages

    def key(self, key: str) -> str:
        """The store key of page `key` for the attached pool's format."""
        fmt = self._require_pool()[1]
        return f"{key}@{fmt.tag}"

    def _require_pool(self):
        self._check_open()
        pool = self.pool
        if pool is None:
            raise L3Error("no pool is attached (detached, destroyed or garbage collected)")
        if getattr(pool, "_destroyed", False):
            raise L3Error(f"the attached {type(pool).__name__} has been destroyed")
        return pool, self._format

    def _pages(self, keys, host_indices):
        """(pool, format, store keys, [(ptrs, sizes)] per page) after checking the request."""
        pool, fmt = self._require_pool()
        keys = [str(k) for k in keys]
        indices = as_index_array(host_indices, torch.device("cpu"))
        if indices.numel() != len(keys) * fmt.slots_per_page:
            raise ValueError(
                f"{len(keys)} keys need {len(keys) * fmt.slots_per_page} host indices "
                f"({fmt.slots_per_page} per page), got {indices.numel()}"
            )
        if not keys:
            return pool, fmt, [], []
        rows = indices.to(torch.int64).reshape(len(keys), fmt.slots_per_page)
        if not torch.equal(rows - rows[:, :1], torch.arange(fmt.slots_per_page).expand_as(rows)):
            raise ValueError(
                f"host_indices must name whole pages: {fmt.slots_per_page} consecutive slots per "
                "key (the pool's page metadata only reads each page's first slot)"
            )
        ptrs, sizes = pool.get_page_buffer_meta(indices)
        per = fmt.buffers_per_page
        if len(ptrs) != len(keys) * per or len(sizes) != len(ptrs):
            raise L3Error(
                f"{type(pool).__name__}.get_page_buffer_meta gave {len(ptrs)} buffers for "
                f"{len(keys)} pages; expected {per} per page"
            )
        pages = []
        for i in range(len(keys)):
            p = [int(x) for x in ptrs[i * per : (i + 1) * per]]
            s = [int(x) for x in sizes[i * per : (i + 1) * per]]
            if sum(s) != fmt.page_bytes:
                raise L3Error(f"page {i} has {sum(s)} bytes, the format says {fmt.page_bytes}")
            pages.append((p, s))
        store_keys = [f"{k}@{fmt.tag}" for k in keys]
        return pool, fmt, store_keys, pages

    def _chunks(self, n: int, page_bytes: int):
        step = max(1, self.max_batch_bytes // max(page_bytes, 1))
        for start in range(0, n, step):
            yield range(start, min(n, start + step))

    # ----------------------------------------------------------------- store queries

    def _exist_codes(self, store_keys) -> list[int]:
        codes = list(self.store.batch_is_exist(store_keys))
        if len(codes) != len(store_keys):
            raise L3Error(f"batch_is_exist answered {len(codes)} of {len(store_keys)} keys")
        if any(c not in (0, 1) for c in codes):
            raise self._unavailable("batch_is_exist", next(c for c in codes if c not in (0, 1)))
        return codes

    def _sizes(self, store_keys) -> dict[str, int]:
        """Object size per present key (absent from the result: not found)."""
        if not store_keys:
            return {}
        found = self.store.batch_get_replica_desc(store_keys)
        sizes = {}
        for key, replicas in found.items():
            for replica in replicas:
                if replica.is_memory_replica():
                    sizes[key] = int(replica.get_memory_descriptor().buffer_descriptor.size)
                    break
            else:
                if replicas:  # a disk replica only; its size is not exposed here
                    sizes[key] = -1
        return sizes

    def _stored_sizes(self, store_keys, results=None) -> tuple[list[int], dict[str, int]]:
        """(existence code per key, object size per present key). A store that does not answer
        raises StoreUnavailable carrying `results` (what the operation settled so far)."""
        try:
            codes = self._exist_codes(store_keys)
        except StoreUnavailable as exc:
            exc.results = results
            raise
        return codes, self._sizes([k for k, c in zip(store_keys, codes) if c == 1])

    def _unavailable(self, what: str, code: int, results=None) -> StoreUnavailable:
        return StoreUnavailable(
            f"Mooncake {what} failed with {code_name(code)}: the master "
            f"{self.master or '(address not known)'} did not answer; is it running?",
            results,
        )

    # ----------------------------------------------------------------- operations

    def exists(self, keys) -> list[bool]:
        """Whether each page is stored for this pool's format with exactly one page of bytes."""
        with self._lock:
            _pool, fmt = self._require_pool()
            store_keys = [f"{k}@{fmt.tag}" for k in keys]
            if not store_keys:
                return []
            _codes, sizes = self._stored_sizes(store_keys)
            return [sizes.get(k) == fmt.page_bytes for k in store_keys]

    def save(self, keys, host_indices) -> list[PageResult]:
        """Store each page under its key from the pool's memory (no copy on this side). Pages
        already stored with the right size are skipped."""
        return self._by_chunks(keys, host_indices, self._save_chunk)

    def _by_chunks(self, keys, host_indices, run_chunk) -> list[PageResult]:
        """`run_chunk(fmt, store_keys, pages, chunk, results)` over batches of at most
        `max_batch_bytes`, filling one result per page."""
        with self._lock:
            _pool, fmt, store_keys, pages = self._pages(keys, host_indices)
            results: list[PageResult | None] = [None] * len(store_keys)
            for chunk in self._chunks(len(store_keys), fmt.page_bytes):
                run_chunk(fmt, store_keys, pages, list(chunk), results)
            return results

    def _save_chunk(self, fmt, store_keys, pages, chunk, results):
        ckeys = [store_keys[i] for i in chunk]
        codes, sizes = self._stored_sizes(ckeys, results)
        todo, replace = [], []
        for i, key, code in zip(chunk, ckeys, codes):
            if code == 1 and sizes.get(key) == fmt.page_bytes:
                results[i] = PageResult(Status.SKIPPED)
            else:
                todo.append(i)
                if code == 1:
                    replace.append(key)
        if replace:
            # A wrong-size object under our key is unusable by any pool of this format.
            logger.warning("replacing %d stored object(s) of the wrong size", len(replace))
            self.store.batch_remove(replace, True)
        if not todo:
            return
        put_keys = [store_keys[i] for i in todo]
        if fmt.buffers_per_page == 1:
            rcs = self.store.batch_put_from(
                put_keys, [pages[i][0][0] for i in todo], [pages[i][1][0] for i in todo]
            )
        else:
            rcs = self.store.batch_put_from_multi_buffers(
                put_keys, [pages[i][0] for i in todo], [pages[i][1] for i in todo]
            )
        unavailable = None
        for i, rc in zip(todo, rcs):
            rc = int(rc)
            if rc == 0:
                results[i] = PageResult(Status.STORED)
            elif rc == NO_AVAILABLE_HANDLE:
                results[i] = PageResult(Status.FULL, rc)
            else:
                results[i] = PageResult(Status.FAILED, rc)
                if rc == RPC_FAIL:
                    unavailable = rc
        if unavailable is not None:
            raise self._unavailable("batch_put_from", unavailable, results)

    def load(self, keys, host_indices) -> list[PageResult]:
        """Fetch each page into the pool's memory at `host_indices` (no copy on this side). Only
        objects of exactly one page are fetched; others leave the pool untouched."""
        return self._by_chunks(keys, host_indices, self._load_chunk)

    def _load_chunk(self, fmt, store_keys, pages, chunk, results):
        ckeys = [store_keys[i] for i in chunk]
        _codes, sizes = self._stored_sizes(ckeys, results)
        todo = []
        for i, key in zip(chunk, ckeys):
            size = sizes.get(key)
            if size is None:
                results[i] = PageResult(Status.MISSING, OBJECT_NOT_FOUND)
            elif size != fmt.page_bytes:
                results[i] = PageResult(
                    Status.WRONG_SIZE, detail=f"object has {size} bytes, a page {fmt.page_bytes}"
                )
            else:
                todo.append(i)
        if not todo:
            return
        get_keys = [store_keys[i] for i in todo]
        if fmt.buffers_per_page == 1:
            rcs = self.store.batch_get_into(
                get_keys, [pages[i][0][0] for i in todo], [pages[i][1][0] for i in todo]
            )
        else:
            rcs = self.store.batch_get_into_multi_buffers(
                get_keys, [pages[i][0] for i in todo], [pages[i][1] for i in todo]
            )
        unavailable = None
        for i, rc in zip(todo, rcs):
            rc = int(rc)
            if rc == fmt.page_bytes:
                results[i] = PageResult(Status.LOADED)
                continue
            if rc == OBJECT_NOT_FOUND:  # removed or evicted since the size check
                results[i] = PageResult(Status.MISSING, rc)
                continue
            if rc == RPC_FAIL:
                unavailable = rc
            if rc >= 0 or rc not in _NOTHING_MOVED:
                _zero(pages[i])  # bytes may have moved: never leave a half-written page
                detail = "page zero-filled"
            else:
                detail = "pool untouched"
            results[i] = PageResult(Status.FAILED, min(0, rc), detail=f"got {rc} bytes; {detail}")
        if unavailable is not None:
            raise self._unavailable("batch_get_into", unavailable, results)

    def remove(self, keys, *, force: bool = False) -> list[PageResult]:
        """Remove each page's object. A page a reader holds a lease on (Mooncake leases objects
        for a while after each read) reports BUSY unless `force`."""
        with self._lock:
            _pool, fmt = self._require_pool()
            store_keys = [f"{k}@{fmt.tag}" for k in keys]
            if not store_keys:
                return []
            rcs = self.store.batch_remove(store_keys, bool(force))
            results = []
            unavailable = None
            for rc in rcs:
                rc = int(rc)
                if rc == 0:
                    results.append(PageResult(Status.REMOVED))
                elif rc == OBJECT_NOT_FOUND:
                    results.append(PageResult(Status.MISSING, rc))
                elif rc == OBJECT_HAS_LEASE:
                    results.append(PageResult(Status.BUSY, rc))
                else:
                    results.append(PageResult(Status.FAILED, rc))
                    if rc == RPC_FAIL:
                        unavailable = rc
            if unavailable is not None:
                raise self._unavailable("batch_remove", unavailable, results)
            return results


def _zero(page) -> None:
    for ptr, size in zip(*page):
        ctypes.memset(ptr, 0, size)
