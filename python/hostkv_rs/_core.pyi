"""Type stubs for the Rust core (`rust/src/python/`). Checked against the built module by
`python -m mypy.stubtest hostkv_rs._core` in the test command."""

from collections.abc import Sequence
from typing import Any, Final, TypeAlias, final

import torch

__all__ = [
    "C4_PAGE_TOKENS",
    "C4_ROW_BYTES",
    "C4_SCALES_PER_ROW",
    "C4_SCALE_BYTES",
    "C4_VALUES_PER_ROW",
    "C4_VALUE_BYTES",
    "DeviceBinding",
    "HostPool",
    "HostRegion",
    "LayerIndexError",
    "LayerMap",
    "PageIndexError",
    "PageUnifiedLayout",
    "PoolSpec",
    "TransferError",
    "V4Transfers",
    "__version__",
    "as_index_array",
    "as_tensor",
    "cgroup_memory_limit",
    "check_device_errors",
    "check_layout",
    "check_page_values",
    "check_storage",
    "cuda_available",
    "device_row_pitch",
    "digest",
    "handed_back_layouts",
    "refuse_nested",
    "runtime_info",
    "stream_copy",
    "supported_pairs",
    "tensor_extent_layout",
]

__version__: Final[str]

C4_PAGE_TOKENS: Final[int]
C4_VALUE_BYTES: Final[int]
C4_SCALE_BYTES: Final[int]
C4_ROW_BYTES: Final[int]
C4_VALUES_PER_ROW: Final[int]
C4_SCALES_PER_ROW: Final[int]

class TransferError(ValueError, RuntimeError):
    """Bad transfer arguments; nothing was written. Structured refusals carry `kind` and, as
    they apply, `side`, `position`, `value`, `bound`, `min`, `max`, `host_len`, `device_len`,
    `len`, `page_size`, `page`, `layer`."""

    kind: str
    side: str
    position: int
    value: int
    bound: int

class LayerIndexError(TransferError, IndexError): ...
class PageIndexError(TransferError, IndexError): ...

def digest(buffers: Sequence[Any]) -> int: ...
def stream_copy(dst: Any, src: Any) -> None: ...
def cuda_available() -> bool: ...
def runtime_info() -> str: ...
def supported_pairs(kind: str) -> list[tuple[str, str]]: ...
def handed_back_layouts(kind: str) -> list[str]: ...
def check_layout(kind: str, layout: object) -> None: ...
def device_row_pitch(tensors: Sequence[torch.Tensor]) -> int | None: ...
def check_device_errors() -> None: ...
def cgroup_memory_limit(root: str, self_cgroup: str) -> tuple[int, str] | None: ...
def tensor_extent_layout() -> list[tuple[str, int]] | None: ...

# Index arguments and caller tensors (`indices.rs`): each refusal names what was wrong.
def as_index_array(indices: object, device: torch.device | None = None) -> torch.Tensor: ...
def as_tensor(indices: object) -> torch.Tensor: ...
def check_storage(tensor: torch.Tensor, what: str) -> None: ...
def check_page_values(tensor: torch.Tensor, what: str) -> None: ...
def refuse_nested(tensor: torch.Tensor, what: str) -> None: ...

@final
class HostRegion:
    def __new__(
        cls,
        nbytes: int,
        *,
        hugepage: str | None = None,
        hugepage_mode: str | None = None,
        numa_node: int | None = None,
        pretouch_threads: int | None = None,
    ) -> HostRegion: ...
    @staticmethod
    def adopt(tensor: torch.Tensor) -> HostRegion: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def hugepage_tier(self) -> str: ...
    @property
    def numa_node(self) -> int | None: ...
    @property
    def pinned(self) -> bool: ...
    @property
    def registered_ranges(self) -> list[tuple[int, int]]: ...
    def register_cuda(
        self,
        granularity: int | None = None,
        chunk_limit: int | None = None,
        device: int | None = None,
    ) -> None: ...
    def unregister_cuda(self) -> None: ...
    def __len__(self) -> int: ...
    # Also a writable 1-D byte buffer (the buffer protocol; `__buffer__` from Python 3.12).

# What a core plane may be: memory the core then keeps alive.
_PlaneMemory: TypeAlias = HostRegion | torch.Tensor | tuple[HostRegion | torch.Tensor, int]
# (address, length, itemsize, on_device) of a contiguous int32/int64 index array.
_IndexArg: TypeAlias = tuple[int, int, int, bool]
# How both index arrays are read: ("dcp", size, rank), ("page_rows", P), ("c4_value",),
# ("c4_scale",), or None for every element as is.
_IndexMap: TypeAlias = tuple[str] | tuple[str, int] | tuple[str, int, int] | None

@final
class HostPool:
    def __new__(
        cls,
        spec: PoolSpec,
        allocations: Sequence[HostRegion | torch.Tensor],
        *,
        watch_pages: bool = False,
    ) -> HostPool: ...
    @staticmethod
    def from_geometry(
        layout: str,
        num_layers: int,
        rows: int,
        page_size: int,
        item_bytes: Sequence[int],
        planes: Sequence[_PlaneMemory],
        head_num: int = 1,
    ) -> HostPool: ...
    @property
    def spec(self) -> PoolSpec | None: ...
    @property
    def watches_pages(self) -> bool: ...
    def forget_pages(self, slots: Sequence[int]) -> None: ...
    def forget_flat_page(self, index: int) -> None: ...
    def page_digests(self, indices: Sequence[int]) -> list[int]: ...
    def page_meta(self, indices: Sequence[int]) -> tuple[list[int], list[int]]: ...
    def split_heads_meta(
        self, indices: Sequence[int], split_factor: int
    ) -> tuple[list[int], list[int]]: ...
    def contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]: ...
    def is_stride_page_aligned(self, page_size_bytes: int) -> bool: ...
    @staticmethod
    def plane_nbytes(
        layout: str,
        num_layers: int,
        rows: int,
        page_size: int,
        item_bytes: int,
        head_num: int = 1,
    ) -> int: ...
    def offset(self, plane: int, row: int, layer: int, head: int = 0) -> int: ...
    @property
    def layout(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def head_num(self) -> int: ...
    @property
    def item_bytes(self) -> list[int]: ...
    @property
    def plane_addrs(self) -> list[int]: ...
    # The raw entry points (tests, benchmarks): device pointers are the caller's promise. Only in
    # builds with the cargo feature `raw-calls` (the test wheel); the release wheel has neither.
    def backup(
        self,
        backend: str,
        device_ptrs: Sequence[int],
        device_rows: int,
        host_idx: _IndexArg,
        dev_idx: _IndexArg,
        device: str,
        stream: int,
        engine: str = "plan",
        host_layer: int | None = None,
        *,
        index_map: _IndexMap = None,
    ) -> None: ...
    def load(
        self,
        backend: str,
        host_layer: int,
        device_ptrs: Sequence[int],
        device_rows: int,
        host_idx: _IndexArg,
        dev_idx: _IndexArg,
        device: str,
        stream: int,
        engine: str = "plan",
        *,
        index_map: _IndexMap = None,
    ) -> None: ...

@final
class PageUnifiedLayout:
    def __new__(
        cls,
        *,
        page_size: int,
        layer_num: int,
        head_num: int,
        head_group_num: int,
        head_dim: int,
        itemsize: int,
        is_mla: bool = False,
    ) -> PageUnifiedLayout: ...
    @property
    def page_size(self) -> int: ...
    @property
    def layer_num(self) -> int: ...
    @property
    def head_num(self) -> int: ...
    @property
    def head_group_num(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def itemsize(self) -> int: ...
    @property
    def is_mla(self) -> bool: ...
    @property
    def components(self) -> int: ...
    @property
    def heads_per_group(self) -> int: ...
    @property
    def group_bytes(self) -> int: ...
    @property
    def layer_bytes(self) -> int: ...
    @property
    def head_group_bytes(self) -> int: ...
    @property
    def bytes_per_page(self) -> int: ...
    def page_dims(self, page_num: int) -> tuple[int, ...]: ...
    def chunk_span(self, layer_range: tuple[int, int], head_group: int = 0) -> tuple[int, int]: ...

@final
class PoolSpec:
    def __new__(
        cls,
        kind: str,
        layout: object,
        num_layers: int,
        rows: int,
        page_size: int,
        dims: Sequence[int],
        itemsize: int,
        head_num: int | None = None,
        dcp_size: int | None = None,
        dcp_rank: int | None = None,
        name: str = "",
        head_group_num: int | None = None,
        release: tuple[int, int, int] | None = None,
    ) -> PoolSpec: ...
    def shape(self, plane: int) -> list[int]: ...
    @property
    def item_bytes(self) -> list[int]: ...
    @property
    def plane_nbytes(self) -> list[int]: ...
    @property
    def page_num(self) -> int: ...
    def check_pair(self, io_backend: object, transfer: str = "slots") -> str: ...
    @property
    def page_unified_layout(self) -> PageUnifiedLayout | None: ...
    @property
    def allocation_shapes(self) -> list[list[int]]: ...
    def registration_unit(self, allocation: int) -> int: ...
    def layer_view_dim(self, transpose_direct: bool) -> int | None: ...
    @property
    def token_rows(self) -> bool: ...
    @property
    def page_strided(self) -> bool: ...
    @property
    def dummy_page_shape(self) -> list[int] | None: ...
    @property
    def staging_shape(self) -> list[int] | None: ...
    def layer(self, layer_id: int) -> int: ...
    def page_view(self, index: int) -> tuple[int, list[int], list[int]]: ...

@final
class LayerMap:
    """Controller layer ids -> host layers of a pool without a device binding yet."""

    def __new__(cls, owned_slots: Sequence[int], target_layer_num: int) -> LayerMap: ...
    def lookup(self, layer_id: int, is_draft: bool = False) -> int | None: ...
    @property
    def targets(self) -> list[tuple[int, int]]: ...
    @property
    def host_layer_num(self) -> int: ...

@final
class V4Transfers:
    """A DeepSeek V4 paged pool's transfers: every check in SGLang's order, and the device
    bindings that move whole page rows, kernel_ascend's page and scale rows, or C4 tokens."""

    def __new__(
        cls,
        name: str,
        page_size: int,
        item_bytes: int,
        device: torch.device,
        *,
        spec: PoolSpec | None = None,
        page: DeviceBinding | None = None,
        ascend: DeviceBinding | None = None,
        tokens: tuple[DeviceBinding, DeviceBinding] | None = None,
        refusal: str | None = None,
        has_rows: bool = False,
    ) -> V4Transfers: ...
    def backup(
        self,
        host_indices: object,
        device_indices: object,
        io_backend: object,
        *,
        page_aligned_only: bool = False,
    ) -> None: ...
    def load(
        self,
        layer_id: int,
        host_indices: object,
        device_indices: object,
        io_backend: object,
        *,
        page_aligned_only: bool = False,
    ) -> None: ...
    def backup_tokens(
        self, host_indices: object, device_indices: object, *, page_aligned_only: bool = False
    ) -> None: ...
    def release(self) -> None: ...

@final
class DeviceBinding:
    def __new__(
        cls,
        pool: HostPool,
        planes: Sequence[Sequence[torch.Tensor]],
        owned_slots: Sequence[int],
        device_layer_num: int,
        target_layer_num: int,
        *,
        host_layers: Sequence[int] | None = None,
        like: Sequence[tuple[torch.dtype, tuple[int, int] | None]] = ...,
        what: str = "device pool",
        name: str = "host pool",
        index_map: _IndexMap = None,
        positions: Sequence[int] | None = None,
        packed: tuple[str, int] | None = None,
        host_planes: Sequence[int] | None = None,
        byte_rows: Sequence[int] | None = None,
    ) -> DeviceBinding: ...
    def load(
        self,
        layer_id: int,
        host_indices: Any,
        device_indices: Any,
        io_backend: object,
        is_draft: bool = False,
        *,
        plan_only: bool = False,
    ) -> bool: ...
    def backup(
        self,
        host_indices: Any,
        device_indices: Any,
        io_backend: object,
        *,
        plan_only: bool = False,
    ) -> None: ...
    def lookup(self, layer_id: int, is_draft: bool = False) -> int | None: ...
    @property
    def targets(self) -> list[tuple[int, int]]: ...
    @property
    def host_layer_num(self) -> int: ...
    @property
    def complete(self) -> bool: ...
    @property
    def device(self) -> torch.device: ...
    def release(self) -> None: ...
