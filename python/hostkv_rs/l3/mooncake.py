"""`MooncakeTier`: host pool pages to and from a Mooncake Store, zero-copy, each with its proof.

One object per page, moved straight between the pool's registered host memory and the store
(multi-buffer puts and gets: a 64-byte proof header from a small registered buffer, then the
page's own buffers, e.g. MHA layer_first: 2 x layers of them). Safe by construction:

* keys carry the page format tag (`hostkv_rs.l3.format`): another layout, dtype (the one the
  bytes encode: fp8 e4m3fn and e5m2 differ), geometry (MLA latent and rope widths apart), shard
  or model (`model_id=`, else the SGLang server's model path) computes other keys and misses;
* every object carries a proof header (`hostkv_rs.l3.proof`): the XXH3-128 digest of the page's
  bytes and of the writer's identity (model identity + format tag). A load verifies both; an
  object that fails (foreign, another identity, bytes not matching their digest) is a miss
  (`Status.MISMATCH`), counted in `tier.mismatches`, logged once per kind, and its page is
  zero-filled, never left holding the foreign bytes;
* a load counts only when the stored object has exactly the page's size (+ header); sizes are
  checked before any byte moves, so a short or long object never touches the pool;
* a page whose transfer fails after it started is zero-filled (never half-written) and reported;
  a page that fails before any byte moved is left as it was;
* save refuses a key listed twice (ValueError naming it, nothing stored); a page already stored
  with the same bytes is skipped; one stored under the key with other bytes by another writer is
  kept and reported (`Status.CONFLICT`, `tier.second_writers`, one log line); a wrong-size or
  foreign object under the key is replaced. Not seen: a writer that puts the key between our
  existence check and our put (Mooncake's put then reports success and keeps the first object;
  its put sessions say "exists", but their ranged puts ran at half the speed here). The object
  kept is whole either way, and the next save of the key reports the difference;
* the master not answering raises `StoreUnavailable` (nothing is written to the pool then);
  `connect` asks the master's TCP port first, so a wrong address fails in seconds, in one line
  (`hostkv_rs.l3._native`), instead of Mooncake's ~100 s of retries;
* Mooncake's native logging stays quiet unless HOSTKV_MOONCAKE_LOG is set (`_native`);
* `detach()`, the pool's `destroy()` and the pool's garbage collection all unregister its host
  memory (and the header buffer) from the client, once, so a later pool at the same addresses can
  register again. Not while the master is unreachable: Mooncake's client then keeps the ranges
  for its life (a retry fails too), and only a new client can register memory there; the
  warning logged then, and the refusal of a later attach(), say so.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import enum
import ipaddress
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field

import torch

from hostkv_rs import _core
from hostkv_rs.l3 import _native, proof
from hostkv_rs.l3.format import PageFormat, _host_allocations, page_format

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

# An object stored only on a replica whose size is not exposed (a local-disk replica): fetched
# and checked like one of the right size (its get returns its byte count, and the proof
# decides), and removed only once its get shows it is no page object.
UNKNOWN_SIZE = -1
DEFAULT_SEGMENT_BYTES = 1 << 30
DEFAULT_LOCAL_BUFFER_BYTES = 16 << 20
DEFAULT_BATCH_BYTES = 256 << 20
# Pages per store call at most: bounds the registered header buffer (64 bytes a page).
MAX_BATCH_PAGES = 1024
# The most bytes one store call of a batch moves while other pages hash (save: hashed ahead of
# the put; load: hashed behind the get).
OVERLAP_BYTES = 32 << 20
# A batch smaller than this is one store call: its hash costs less than another round trip.
SPLIT_BYTES = 8 << 20


def code_name(code: int) -> str:
    return _CODE_NAMES.get(int(code), f"error {int(code)}")


class Status(str, enum.Enum):
    STORED = "stored"  # save: written now
    SKIPPED = "skipped"  # save: already stored with the same bytes
    LOADED = "loaded"  # load: every byte of the page came from the store, and its proof holds
    REMOVED = "removed"
    MISSING = "missing"  # no object under this key (for this pool's format)
    WRONG_SIZE = "wrong_size"  # load: the object is not exactly one page; the pool is untouched
    MISMATCH = "mismatch"  # load: the object's proof failed (see `detail`); page zero-filled
    CONFLICT = "conflict"  # save: another writer stored other bytes under the key; theirs kept
    FULL = "full"  # save: the store has no room
    BUSY = "busy"  # remove: a reader holds a lease on the object (use force=True)
    FAILED = "failed"  # see `code`


_OK = {Status.STORED, Status.SKIPPED, Status.LOADED, Status.REMOVED}

_MISMATCH_TEXT = {
    proof.FOREIGN: "is not a page object this tier writes (no valid proof header)",
    proof.IDENTITY: "was written for another model identity or page format",
    proof.DIGEST: "holds bytes that do not match their digest (corrupted or torn)",
}


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


def _replica_size(replica) -> int | None:
    """The object size a replica descriptor states: a memory replica's buffer size, or a disk
    (SSD offload, DFS) replica's object size; None where the descriptor gives none."""
    if replica.is_memory_replica():
        return int(replica.get_memory_descriptor().buffer_descriptor.size)
    if getattr(replica, "is_disk_replica", lambda: False)():
        return int(replica.get_disk_descriptor().object_size)
    return None


def _fits(size: int | None, fmt) -> bool:
    """Whether a stored object of `size` may be one page object of `fmt`."""
    return size == fmt.object_bytes or size == UNKNOWN_SIZE


def _key_texts(keys) -> list[str]:
    """Each key as its text, refused (ValueError naming it) where the text is not encodable as
    UTF-8 (a lone surrogate), which Mooncake's binding fails on with a bare TypeError."""
    texts = [str(k) for k in keys]
    for position, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"key {text!r} at position {position} is not UTF-8 text ({exc.reason}); Mooncake "
                "stores keys as UTF-8"
            ) from None
    return texts


def _refuse_repeats(values, text: str) -> None:
    """ValueError(`text` formatted with the value and both positions) for the first value listed
    twice."""
    seen: dict = {}
    for i, value in enumerate(values):
        if value in seen:
            raise ValueError(text.format(value, seen[value], i))
        seen[value] = i


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


def _unregister(store, spans, lock=None, keep=None) -> None:
    """Finalizer body: unregister `spans` from `store` (never raises: it runs from destroy(), from
    garbage collection, or from detach()). Under the tier's lock, so a destroy() on another thread
    waits for a transfer in flight. `keep` is memory registered among `spans` (the header
    buffer): the finalizer holds it so it is not freed while the client still has it."""
    del keep
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
            logger.warning(
                "Mooncake unregister_buffer(%#x) returned %s: this client keeps the range "
                "registered for its life (Mooncake does not retry it), so memory there can be "
                "attached again only through a new client (MooncakeTier.connect)",
                address,
                code_name(rc),
            )


@dataclass
class _Op:
    """One save or load: the pages, and byte views of the pool's memory for hashing them."""

    pool: object  # held for the operation: its collection would unregister it mid-transfer
    fmt: PageFormat
    keys: list  # store keys
    pages: list  # (ptrs, sizes) per page
    memory: proof.PoolBytes | None
    first: int = 0  # index of the current chunk's first page (header slot 0)
    # pages whose stored object's size was not known before their get (UNKNOWN_SIZE)
    unsized: set = field(default_factory=set)

    def pieces(self, i: int):
        return self.memory.pieces(self.pages[i])

    def zero(self, i: int) -> None:
        for piece in self.pieces(i):
            piece[...] = 0


class MooncakeTier:
    """A store tier over a running Mooncake Store for one host pool at a time.

    `MooncakeTier.connect(master, metadata_server)` sets up a client (it contributes
    `global_segment_size` bytes of this process's memory to the store; 0 contributes none), or
    pass an already set up `mooncake.store.MooncakeDistributedStore`. Then `attach(pool)` and
    `save` / `load` / `exists` / `remove` with one key per page and `host_indices` naming those
    pages (page_size consecutive slots per page, in key order; logical slots under DCP).
    Results are one `PageResult` per key (`exists` returns booleans).

    `model_id` names the weights whose KV the pages are (a model path, a hub id + revision):
    two models with the same geometry and the same token keys must not read each other's pages,
    and nothing in a pool tells them apart. Without it the SGLang server's model path is used
    when SGLang runs in this process, else the pages carry no model identity (logged once).
    `kv_dtype` names the dtype the pool's bytes encode when the pool cannot say (a uint8-stored
    fp8 cache built from an SGLang 0.5.23 buffer info outside a server). `namespace` prefixes
    every key; `tp_rank`/`tp_size`/`pp_rank`/`pp_size` name this shard (the pool itself knows
    its DCP rank; an MHA pool attached without a TP rank is logged once, since TP ranks hold
    other heads under the same keys).

    Counters: `mismatches` (a Counter of loads and saves that found an object under our key
    whose proof failed, by kind: "foreign", "identity", "digest") and `second_writers` (saves
    that found the page stored with other bytes). `digests=False` stores pages without proof,
    under their own tag, only to measure what the proof costs (`python -m hostkv_rs.l3.bench
    --digest both`).
    """

    def __init__(
        self,
        store,
        *,
        namespace: str = "",
        tp_rank: int | None = None,
        tp_size: int | None = None,
        pp_rank: int = 0,
        pp_size: int = 1,
        max_batch_bytes: int = DEFAULT_BATCH_BYTES,
        owns_store: bool = False,
        master: str = "",
        model_id: str | None = None,
        kv_dtype=None,
        digests: bool = True,
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
        self.model_id = model_id
        self.kv_dtype = kv_dtype
        self.digests = bool(digests)
        self.mismatches: collections.Counter[str] = collections.Counter()
        self.second_writers = 0
        self._logged: set[str] = set()
        self._owns_store = owns_store
        self._lock = threading.RLock()
        self._pool_ref = None
        self._format: PageFormat | None = None
        self._identity = b""
        self._headers: proof.Headers | None = None
        self._chunk_pages = 1
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

        The master's port must answer an RPC request as a Mooncake master does (and an http
        metadata server's port accept a TCP connection) within `probe_timeout` seconds, else
        StoreUnavailable is raised at once; so is, with or without the probe, a master address
        that names the metadata server's own HTTP port or a HOST:PORT whose port is not one.
        With `probe_timeout=None` there is no probe: a master that is down is left to
        Mooncake's retries, and an open port that is not a master's RPC port makes Mooncake's
        setup wait for a reply that never comes (it has no timeout and holds the GIL), as it
        does without hostkv_rs. With the tcp protocol on a loopback `local_hostname`,
        MC_TCP_BIND_ADDRESS is set to it when unset, so the client advertises loopback and not
        the machine's first interface. MC_LOG_LEVEL defaults to ERROR and the setup's known
        harmless lines are dropped, unless HOSTKV_MOONCAKE_LOG is set."""
        store_cls = _import_store_class()
        if probe_timeout is not None:
            _native.probe(master, metadata_server, probe_timeout)
        else:
            _native.refuse_metadata_port_as_master(master, metadata_server)
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

    def attach(self, pool, *, model_id: str | None = None) -> PageFormat:
        """Register every host buffer of `pool` with the client (once) and make it the pool this
        tier moves pages of. `model_id` overrides the tier's for this pool. Returns its page
        format."""
        with self._lock:
            self._check_open()
            if self.attached:
                raise L3Error(
                    f"this tier already has a pool attached ({type(self.pool).__name__}); "
                    "detach() it first"
                )
            fmt = page_format(
                pool,
                namespace=self.namespace,
                model_id=model_id if model_id is not None else self.model_id,
                kv_dtype=self.kv_dtype,
                digests=self.digests,
                **self.ranks,
            )
            allocations = _host_allocations(pool)
            try:
                proof.PoolBytes(allocations)  # every allocation can be viewed for hashing
            except ValueError as exc:
                raise L3Error(f"{type(pool).__name__}: {exc}") from exc
            spans = [(address, nbytes) for address, nbytes, _owner in allocations]
            chunk_pages = max(1, min(MAX_BATCH_PAGES, self.max_batch_bytes // fmt.page_bytes))
            headers = proof.Headers(chunk_pages) if self.digests else None
            if headers is not None:
                spans.append((headers.address, headers.nbytes))
            done = []
            for address, nbytes in spans:
                try:
                    rc = self.store.register_buffer(address, nbytes)
                except BaseException:
                    _unregister(self.store, done)  # a client that raises (or a Ctrl-C)
                    raise
                if rc != 0:
                    _unregister(self.store, done)
                    raise L3Error(
                        f"Mooncake refused to register {nbytes} bytes at {address:#x} of "
                        f"{type(pool).__name__}: {code_name(rc)}. Mooncake refuses a range that "
                        "overlaps one still registered (an earlier pool at these addresses freed "
                        "without detaching from this client, or detached while its master was "
                        "unreachable: the client then keeps the range for its life, and a new "
                        "client, MooncakeTier.connect, is needed), and any registration while the "
                        f"metadata server of master {self.master or '(unknown)'} is unreachable"
                    )
                done.append((address, nbytes))
            # One finalizer does the unregistering for all three ways out (detach, destroy(), GC);
            # it holds the client, the addresses and the header buffer, never the pool.
            finalizer = weakref.finalize(
                pool, _unregister, self.store, tuple(done), self._lock, headers
            )
            finalizer.atexit = False  # at exit the client goes away with its registrations
            from hostkv_rs.pools.base import on_destroy

            on_destroy(pool, finalizer)
            self._pool_ref = weakref.ref(pool)
            self._format = fmt
            self._identity = proof.text_digest(fmt.identity).to_bytes(16, "little")
            self._headers = headers
            self._chunk_pages = chunk_pages
            self._finalizer = finalizer
            if fmt.model_id is None:
                self._log_once(
                    "no-model",
                    "L3 pages of %s carry no model identity (pass model_id= to MooncakeTier): "
                    "another model with the same geometry saving the same keys would load as "
                    "hits",
                    type(pool).__name__,
                )
            if not fmt.tp_known:
                self._log_once(
                    "tp",
                    "L3 pages of %s (its heads are split across TP ranks) carry no TP rank (pass "
                    "tp_rank= and tp_size= to MooncakeTier): two TP ranks saving the same keys "
                    "would load each other's heads as hits",
                    type(pool).__name__,
                )
            if not fmt.dtype_known:
                self._log_once(
                    "dtype",
                    "%s stores uint8 and does not say which dtype the bytes are (pass kv_dtype= "
                    "to MooncakeTier): an fp8 e4m3fn and an e5m2 pool would share keys",
                    type(pool).__name__,
                )
            return fmt

    def detach(self) -> None:
        """Unregister the attached pool's host memory (idempotent)."""
        with self._lock:
            finalizer, self._finalizer = self._finalizer, None
            pool = self._pool_ref() if self._pool_ref is not None else None
            self._pool_ref = None
            self._format = None
            self._headers = None
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

    def _pages(self, keys, host_indices, distinct_pages: bool = False) -> _Op:
        """The request checked: store keys, (ptrs, sizes) per page, views of the pool's bytes."""
        pool, fmt = self._require_pool()
        keys = [str(k) for k in keys]
        indices = _core.as_index_array(host_indices, torch.device("cpu"))
        if indices.numel() != len(keys) * fmt.slots_per_page:
            raise ValueError(
                f"{len(keys)} keys need {len(keys) * fmt.slots_per_page} host indices "
                f"({fmt.slots_per_page} per page), got {indices.numel()}"
            )
        if not keys:
            return _Op(pool, fmt, [], [], None)
        rows = indices.to(torch.int64).reshape(len(keys), fmt.slots_per_page)
        starts = rows[:, 0]
        if not torch.equal(
            rows - starts[:, None], torch.arange(fmt.slots_per_page).expand_as(rows)
        ) or bool((starts % fmt.slots_per_page).any()):
            # A run that starts inside a page names parts of two: some pools' page metadata
            # round it down to the first, others point into it, and two such runs overlap.
            raise ValueError(
                f"host_indices must name whole pages: {fmt.slots_per_page} consecutive slots per "
                "key, starting on a page boundary (the pool's page metadata only reads each "
                "page's first slot)"
            )
        if distinct_pages:
            _refuse_repeats(
                starts.tolist(),
                "the page at host slot {} is listed twice in one load (positions {} and {}); "
                "each page holds one object",
            )
        ptrs, sizes = pool.get_page_buffer_meta(indices)
        per = fmt.buffers_per_page
        if len(ptrs) != len(keys) * per or len(sizes) != len(ptrs):
            raise L3Error(
                f"{type(pool).__name__}.get_page_buffer_meta gave {len(ptrs)} buffers for "
                f"{len(keys)} pages; expected {per} per page"
            )
        memory = proof.PoolBytes(_host_allocations(pool))
        pages = []
        for i in range(len(keys)):
            p = [int(x) for x in ptrs[i * per : (i + 1) * per]]
            s = [int(x) for x in sizes[i * per : (i + 1) * per]]
            if sum(s) != fmt.page_bytes:
                raise L3Error(f"page {i} has {sum(s)} bytes, the format says {fmt.page_bytes}")
            pages.append((p, s))
        try:  # never hash, zero or transfer outside the pool
            memory.check(ptrs, sizes)
        except ValueError as exc:
            raise L3Error(f"{type(pool).__name__}.get_page_buffer_meta: {exc}") from exc
        store_keys = [f"{k}@{fmt.tag}" for k in keys]
        return _Op(pool, fmt, store_keys, pages, memory)

    def _chunks(self, n: int):
        step = self._chunk_pages
        for start in range(0, n, step):
            yield range(start, min(n, start + step))

    @staticmethod
    def _groups(idx: list[int], object_bytes: int) -> list[list[int]]:
        """`idx` in runs for a load: each run's pages hash while the store moves the next run,
        so only the last run's hash is left with nothing to hide behind. Runs are about
        OVERLAP_BYTES, and the last such run is split in halves down to one page, so what a load
        waits for after its last get is about one page's hash, not a whole run's. Each run is
        one more store call (a master round trip or two), so a batch under SPLIT_BYTES stays
        whole."""
        if len(idx) * object_bytes < SPLIT_BYTES:
            return [list(idx)]
        per = max(1, OVERLAP_BYTES // object_bytes)
        runs = [idx[k : k + per] for k in range(0, len(idx), per)]
        last = runs.pop()
        while len(last) > 1:
            half = len(last) // 2
            runs.append(last[:half])
            last = last[half:]
        runs.append(last)
        return runs

    def _log_once(self, kind: str, message: str, *args) -> None:
        """A warning the first time this tier meets `kind`, debug after (the counters count)."""
        level = logging.DEBUG if kind in self._logged else logging.WARNING
        self._logged.add(kind)
        logger.log(level, message, *args)

    def _mismatch(self, kind: str, key: str, outcome: str) -> None:
        self.mismatches[kind] += 1
        self._log_once(
            f"mismatch-{kind}",
            "L3 object %s %s: %s (counted in tier.mismatches[%r]; further ones are not logged)",
            key,
            _MISMATCH_TEXT[kind],
            outcome,
            kind,
        )

    def _second_writer(self, key: str) -> None:
        self.second_writers += 1
        self._log_once(
            "second-writer",
            "L3 key %s already holds this page with other bytes from another writer: theirs is "
            "kept and this save reported as a conflict (counted in tier.second_writers; further "
            "ones are not logged)",
            key,
        )

    # ----------------------------------------------------------------- store queries

    def _exist_codes(self, store_keys) -> list[int]:
        codes = list(self.store.batch_is_exist(store_keys))
        if len(codes) != len(store_keys):
            raise L3Error(f"batch_is_exist answered {len(codes)} of {len(store_keys)} keys")
        if any(c not in (0, 1) for c in codes):
            raise self._unavailable("batch_is_exist", next(c for c in codes if c not in (0, 1)))
        return codes

    def _sizes(self, store_keys) -> dict[str, int]:
        """Object size per present key (absent from the result: not found; UNKNOWN_SIZE: only
        replicas whose size this client does not expose)."""
        if not store_keys:
            return {}
        found = self.store.batch_get_replica_desc(store_keys)
        sizes = {}
        for key, replicas in found.items():
            known = [s for s in map(_replica_size, replicas) if s is not None]
            if known:
                sizes[key] = known[0]
            elif replicas:
                sizes[key] = UNKNOWN_SIZE
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
        """Whether each page is stored for this pool's format with exactly one page object's
        bytes (its proof is checked when it is loaded)."""
        with self._lock:
            _pool, fmt = self._require_pool()
            store_keys = [f"{k}@{fmt.tag}" for k in _key_texts(keys)]
            if not store_keys:
                return []
            _codes, sizes = self._stored_sizes(store_keys)
            return [_fits(sizes.get(k), fmt) for k in store_keys]

    def save(self, keys, host_indices) -> list[PageResult]:
        """Store each page under its key from the pool's memory (no copy on this side). Pages
        already stored with the same bytes are skipped; other bytes under the key are another
        writer's, kept and reported (CONFLICT). A key listed twice raises ValueError before
        anything is stored: its two pages cannot both be what the key names."""
        keys = _key_texts(keys)
        _refuse_repeats(
            keys,
            "key {!r} is listed twice in one save (positions {} and {}); each key names one page",
        )
        return self._by_chunks(keys, host_indices, self._save_chunk)

    def _by_chunks(
        self, keys, host_indices, run_chunk, *, distinct_pages: bool = False
    ) -> list[PageResult]:
        """`run_chunk(op, chunk, results)` over batches of at most `max_batch_bytes` (and
        MAX_BATCH_PAGES pages), filling one result per page."""
        with self._lock:
            op = self._pages(keys, host_indices, distinct_pages)
            results: list[PageResult | None] = [None] * len(op.keys)
            for chunk in self._chunks(len(op.keys)):
                op.first = chunk.start
                run_chunk(op, list(chunk), results)
            return results

    def _header(self, op: _Op, i: int) -> int:
        """Address of page `i`'s header slot (one per page of the chunk)."""
        return self._headers.slot(i - op.first)

    def _clear_headers(self, op: _Op, idx) -> None:
        """Zero the header slots of pages `idx` before the store writes into them: a slot the
        store leaves alone must not offer an earlier call's header as this one's proof."""
        view = self._headers.array
        for i in idx:
            at = (i - op.first) * proof.HEADER_BYTES
            view[at : at + proof.HEADER_BYTES] = 0

    def _hash(self, op: _Op, idx):
        """Futures of the digests of pages `idx`, computed off this thread."""
        pool = proof.hasher()
        return [pool.submit(proof.page_digest, op.memory, op.pages[i], op.keys[i]) for i in idx]

    def _save_chunk(self, op: _Op, chunk, results):
        fmt = op.fmt
        ckeys = [op.keys[i] for i in chunk]
        codes, sizes = self._stored_sizes(ckeys, results)
        todo, replace, present = [], [], []
        for i, key, code in zip(chunk, ckeys, codes):
            if code == 1 and _fits(sizes.get(key), fmt):
                present.append(i)
            else:
                todo.append(i)
                if code == 1:
                    replace.append(key)
        if replace:
            # A wrong-size object under our key is unusable by any pool of this format.
            logger.warning("replacing %d stored object(s) of the wrong size", len(replace))
            self.store.batch_remove(replace, True)
        if present:
            if self.digests:
                again = self._compare_stored(op, present, results, "replaced by this save")
            else:
                for i in present:
                    results[i] = PageResult(Status.SKIPPED)
                again = []
            todo += again
        if todo:
            self._put(op, sorted(todo), results)

    def _compare_stored(self, op: _Op, idx, results, foreign_outcome: str) -> list[int]:
        """Settle pages `idx`, whose keys hold an object of the right size, by its header: the
        same page digest is SKIPPED, another is CONFLICT. Returns the pages to put again (their
        object vanished, or it is not ours: those objects are removed first)."""
        if not hasattr(self.store, "batch_get_session_start"):
            # a client without ranged reads: the stored header cannot be had alone
            self._log_once(
                "no-ranged-get",
                "this Mooncake client has no ranged get (batch_get_into_multi_buffer_ranges): "
                "pages already stored are skipped without comparing their bytes",
            )
            for i in idx:
                results[i] = PageResult(Status.SKIPPED, detail="not compared")
            return []
        ours = self._hash(op, idx)  # while the headers come
        keys = [op.keys[i] for i in idx]
        self._clear_headers(op, idx)
        rcs = self._read_headers(keys, [self._header(op, i) for i in idx])
        again, foreign, unavailable = [], [], None
        for i, key, rc, digest in zip(idx, keys, rcs, ours):
            rc = int(rc)
            if rc == OBJECT_NOT_FOUND:  # removed or evicted since the size check
                again.append(i)
                continue
            if rc != proof.HEADER_BYTES:
                results[i] = PageResult(
                    Status.FAILED, min(0, rc), detail=f"stored header: got {rc} bytes"
                )
                unavailable = rc if rc == RPC_FAIL else unavailable
                continue
            at = (i - op.first) * proof.HEADER_BYTES
            kind, theirs = proof.decode(self._headers.view, at, op.fmt.page_bytes, self._identity)
            if kind is not None:
                self._mismatch(kind, key, foreign_outcome)
                foreign.append(i)
            elif theirs == digest.result():
                results[i] = PageResult(Status.SKIPPED)
            else:
                self._second_writer(key)
                results[i] = PageResult(
                    Status.CONFLICT, detail="stored with other bytes by another writer; kept"
                )
        if unavailable is not None:
            raise self._unavailable("batch_get_into_multi_buffer_ranges", unavailable, results)
        if foreign:
            self.store.batch_remove([op.keys[i] for i in foreign], True)
        return again + foreign

    def _read_headers(self, keys, addresses) -> list[int]:
        """The first HEADER_BYTES of each object into `addresses`: bytes read, or an error code
        per key. Mooncake serves a ranged get only inside a get session (-600 outside one)."""
        store = self.store
        starts = [int(c) for c in store.batch_get_session_start(keys)]
        try:
            go = [j for j, c in enumerate(starts) if c == 0]
            rcs = list(starts)
            if go:
                got = store.batch_get_into_multi_buffer_ranges(
                    [keys[j] for j in go],
                    [[addresses[j]] for j in go],
                    [[proof.HEADER_BYTES]] * len(go),
                    [[0]] * len(go),
                )
                for j, rc in zip(go, got):
                    rcs[j] = int(rc)
            return rcs
        finally:
            store.batch_get_session_end(keys)

    def _put(self, op: _Op, todo, results):
        if not self.digests:
            self._put_raw(op, todo, results)
            return
        fmt = op.fmt
        # Every page's hash is queued at once, in page order; each put takes the run of pages
        # already hashed (at least the next one, at most OVERLAP_BYTES). The first put waits for
        # one page's hash only, and the runs grow by themselves when hashing outpaces the store.
        # A batch under SPLIT_BYTES waits for all its hashes and is one store call.
        digests = self._hash(op, todo)
        most = max(1, OVERLAP_BYTES // fmt.object_bytes)
        if len(todo) * fmt.object_bytes < SPLIT_BYTES:
            concurrent.futures.wait(digests)
            most = len(todo)
        unavailable, k = None, 0
        try:
            while k < len(todo):
                digests[k].result()
                end = k + 1
                while end < len(todo) and end - k < most and digests[end].done():
                    end += 1
                group = todo[k:end]
                for i, digest in zip(group, digests[k:end]):
                    at = (i - op.first) * proof.HEADER_BYTES
                    proof.encode(
                        self._headers.view, at, fmt.page_bytes, self._identity, digest.result()
                    )
                unavailable = self._put_group(op, group, results) or unavailable
                k = end
        finally:
            for digest in digests[k:]:
                digest.cancel()
        if unavailable is not None:
            raise self._unavailable("batch_put_from_multi_buffers", unavailable, results)

    def _put_group(self, op: _Op, group, results) -> int | None:
        """Put `group`, each page behind its header. Returns RPC_FAIL when the master did not
        answer."""
        keys = [op.keys[i] for i in group]
        rcs = self.store.batch_put_from_multi_buffers(
            keys,
            [[self._header(op, i), *op.pages[i][0]] for i in group],
            [[proof.HEADER_BYTES, *op.pages[i][1]] for i in group],
        )
        unavailable = None
        for i, rc in zip(group, rcs):
            unavailable = self._put_result(results, i, int(rc)) or unavailable
        return unavailable

    @staticmethod
    def _put_result(results, i: int, rc: int) -> int | None:
        if rc == 0:
            results[i] = PageResult(Status.STORED)
        elif rc == NO_AVAILABLE_HANDLE:
            results[i] = PageResult(Status.FULL, rc)
        else:
            results[i] = PageResult(Status.FAILED, rc)
            if rc == RPC_FAIL:
                return rc
        return None

    def _put_raw(self, op: _Op, todo, results):
        """The proof-less put (digests=False), as the tier stored pages before proofs."""
        put_keys = [op.keys[i] for i in todo]
        if op.fmt.buffers_per_page == 1:
            rcs = self.store.batch_put_from(
                put_keys, [op.pages[i][0][0] for i in todo], [op.pages[i][1][0] for i in todo]
            )
        else:
            rcs = self.store.batch_put_from_multi_buffers(
                put_keys, [op.pages[i][0] for i in todo], [op.pages[i][1] for i in todo]
            )
        unavailable = None
        for i, rc in zip(todo, rcs):
            unavailable = self._put_result(results, i, int(rc)) or unavailable
        if unavailable is not None:
            raise self._unavailable("batch_put_from", unavailable, results)

    def load(self, keys, host_indices) -> list[PageResult]:
        """Fetch each page into the pool's memory at `host_indices` (no copy on this side) and
        check its proof. Only objects of exactly one page object's size are fetched; others leave
        the pool untouched. A page whose proof fails is zero-filled, reported MISMATCH, and its
        object removed (no pool of this format can use it; the next save stores the page
        again). A key or a page listed twice raises ValueError before anything moves: the store
        fills one destination of a key named twice in one get and reports both, and one page
        cannot hold two objects."""
        keys = _key_texts(keys)
        _refuse_repeats(
            keys,
            "key {!r} is listed twice in one load (positions {} and {}); each key fills one page",
        )
        return self._by_chunks(keys, host_indices, self._load_chunk, distinct_pages=True)

    def _load_chunk(self, op: _Op, chunk, results):
        fmt = op.fmt
        ckeys = [op.keys[i] for i in chunk]
        _codes, sizes = self._stored_sizes(ckeys, results)
        todo = []
        for i, key in zip(chunk, ckeys):
            size = sizes.get(key)
            if size is None:
                results[i] = PageResult(Status.MISSING, OBJECT_NOT_FOUND)
            elif not _fits(size, fmt):
                results[i] = PageResult(
                    Status.WRONG_SIZE,
                    detail=f"object has {size} bytes, a page object {fmt.object_bytes}",
                )
            else:
                todo.append(i)
                if size == UNKNOWN_SIZE:
                    op.unsized.add(i)
        if not todo:
            return
        unavailable, pending = None, []
        try:
            for group in self._groups(todo, fmt.object_bytes) if self.digests else [todo]:
                unavailable = self._get_group(op, group, results, pending) or unavailable
        finally:
            # verified even when a later group raised: a loaded page is never left unproven
            self._verify(op, pending, results)
        if unavailable is not None:
            raise self._unavailable("batch_get_into", unavailable, results)

    def _get_group(self, op: _Op, group, results, pending) -> int | None:
        """Get `group`; pages that arrived whole go to `pending` with their digests' futures
        (hashed while the next group moves). Returns RPC_FAIL when the master did not answer."""
        fmt, store = op.fmt, self.store
        keys = [op.keys[i] for i in group]
        if self.digests:
            self._clear_headers(op, group)
        if not self.digests and fmt.buffers_per_page == 1:
            rcs = store.batch_get_into(
                keys, [op.pages[i][0][0] for i in group], [op.pages[i][1][0] for i in group]
            )
        elif not self.digests:
            rcs = store.batch_get_into_multi_buffers(
                keys, [op.pages[i][0] for i in group], [op.pages[i][1] for i in group]
            )
        else:
            rcs = store.batch_get_into_multi_buffers(
                keys,
                [[self._header(op, i), *op.pages[i][0]] for i in group],
                [[proof.HEADER_BYTES, *op.pages[i][1]] for i in group],
            )
        unavailable, whole, unusable = None, [], []
        for i, rc in zip(group, rcs):
            rc = int(rc)
            if i in op.unsized and rc not in (fmt.object_bytes, OBJECT_NOT_FOUND, RPC_FAIL):
                # An object whose size was not known and that does not arrive as one page object
                # (another byte count; Mooncake answers a size mismatch with TRANSFER_FAIL):
                # as save does with a wrong-size object, remove it, or every later load would
                # fail on it and no save repair it. A transient failure costs a re-save: these
                # are cached pages.
                unusable.append(op.keys[i])
            if rc == fmt.object_bytes:
                if self.digests:
                    whole.append(i)
                else:
                    results[i] = PageResult(Status.LOADED)
                continue
            if rc == OBJECT_NOT_FOUND:  # removed or evicted since the size check
                results[i] = PageResult(Status.MISSING, rc)
                continue
            if rc == RPC_FAIL:
                unavailable = rc
            if rc >= 0 or rc not in _NOTHING_MOVED:
                op.zero(i)  # bytes may have moved: never leave a half-written page
                detail = "page zero-filled"
            else:
                detail = "pool untouched"
            results[i] = PageResult(Status.FAILED, min(0, rc), detail=f"got {rc} bytes; {detail}")
        pending.extend(zip(whole, self._hash(op, whole)))
        if unusable:
            logger.warning("removing %d stored object(s) of the wrong size", len(unusable))
            self._remove_after_load(unusable)
        return unavailable

    def _verify(self, op: _Op, pending, results) -> None:
        failed = []
        for i, digest in pending:
            at = (i - op.first) * proof.HEADER_BYTES
            kind, theirs = proof.decode(self._headers.view, at, op.fmt.page_bytes, self._identity)
            try:
                ours = digest.result()
            except (ValueError, RuntimeError, BufferError) as exc:  # bytes not readable: unproven
                results[i] = PageResult(Status.FAILED, detail=f"hash failed: {exc}")
                with contextlib.suppress(ValueError):
                    op.zero(i)  # never left holding bytes nobody checked, where it can be
                continue
            if kind is None and theirs != ours:
                kind = proof.DIGEST
            if kind is None:
                results[i] = PageResult(Status.LOADED)
                continue
            op.zero(i)
            self._mismatch(kind, op.keys[i], "a miss, page zero-filled, object removed")
            results[i] = PageResult(Status.MISMATCH, detail=f"{kind} proof; page zero-filled")
            failed.append(op.keys[i])
        if failed:
            # What save does with such an object under our key: it is no page of this format
            # (a save that finds its own digest in a header skips the page, so a corrupted body
            # would otherwise stay a miss for good). Mooncake has no compare-and-remove: an
            # object another writer put under the key since our get goes too, and is stored
            # again by the next save.
            self._remove_after_load(failed)

    def _remove_after_load(self, keys) -> None:
        """Remove objects a load found to be no page of this format. The load's results already
        say what arrived, so a removal that raises is logged, not raised."""
        try:
            self.store.batch_remove(keys, True)
        except Exception:
            logger.warning("removing %d failed L3 object(s) raised", len(keys), exc_info=True)

    def remove(self, keys, *, force: bool = False) -> list[PageResult]:
        """Remove each page's object. A page a reader holds a lease on (Mooncake leases objects
        for a while after each read) reports BUSY unless `force`."""
        with self._lock:
            _pool, fmt = self._require_pool()
            store_keys = [f"{k}@{fmt.tag}" for k in _key_texts(keys)]
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
