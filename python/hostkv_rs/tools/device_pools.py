"""Small reference device pools with the attribute names of SGLang's `MHATokenToKVPool` and
`MLATokenToKVPool`: what the host pools read, on CPU or CUDA. Used by the tests, the demo and the
benchmarks; SGLang's own device pools work with the host pools unchanged."""

from __future__ import annotations

import torch

from hostkv_rs.pools.args import positive_int
from hostkv_rs.pools.device_side import ptr_table

# index_put does not support fp8, so SGLang stores fp8 caches as raw bytes.
FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz")
    if hasattr(torch, name)
)


def store_dtype_for(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype in FP8_DTYPES else dtype


class _DevicePool:
    """What SGLang's `KVCache` base provides: sizes, layer range, and layer sharding switched off."""

    layer_shard_enabled = False
    layer_shard_size = 1

    def __init__(self, size, page_size, dtype, layer_num, device, start_layer, end_layer):
        self.size = positive_int("size", size)
        self.page_size = positive_int("page_size", page_size)
        self.layer_num = positive_int("layer_num", layer_num)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.store_dtype = store_dtype_for(dtype)
        torch_device = torch.device(device)
        if torch_device.type not in ("cpu", "cuda"):
            raise ValueError(f"reference device pools live on cpu or cuda, got {device!r}")
        # SGLang keeps the device as a string ("cuda"); the host pools key on it.
        self.device = str(device)
        self.start_layer = start_layer or 0
        self.end_layer = end_layer or self.layer_num - 1
        self.layer_transfer_counter = None

    @property
    def rows(self) -> int:
        """Rows per layer tensor: `size` usable slots plus the padding page (slot/page 0)."""
        return self.size + self.page_size

    def _owned_local_layer_range(self) -> tuple[int, int]:
        return 0, self.layer_num

    def register_layer_transfer_counter(self, layer_transfer_counter):
        self.layer_transfer_counter = layer_transfer_counter

    def _alloc_layers(self, width_shape) -> list[torch.Tensor]:
        return [
            torch.zeros((self.rows, *width_shape), dtype=self.store_dtype, device=self.device)
            for _ in range(self.layer_num)
        ]


class MHATokenToKVPool(_DevicePool):
    """Per layer one K tensor `(size + page_size, head_num, head_dim)` and one V tensor with
    `v_head_dim`, plus uint64 pointer tables on the pool's device.

    The parameters follow SGLang's `MHATokenToKVPool` in order, so code written for SGLang's
    signature builds it unchanged: `enable_memory_saver`, `enable_alt_stream` and
    `enable_kv_cache_copy` are accepted and have no effect here, and the `swa_*` overrides replace
    `head_num` / `head_dim` / `v_head_dim` as they do there."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str = "cpu",
        enable_memory_saver: bool = False,
        v_head_dim: int | None = None,
        swa_head_num: int | None = None,
        swa_head_dim: int | None = None,
        swa_v_head_dim: int | None = None,
        start_layer: int | None = None,
        end_layer: int | None = None,
        enable_alt_stream: bool = True,
        enable_kv_cache_copy: bool = False,
    ):
        super().__init__(size, page_size, dtype, layer_num, device, start_layer, end_layer)
        self.enable_memory_saver = bool(enable_memory_saver)
        head_num = head_num if swa_head_num is None else swa_head_num
        head_dim = head_dim if swa_head_dim is None else swa_head_dim
        if swa_v_head_dim is not None:
            v_head_dim = swa_v_head_dim
        self.head_num = positive_int("head_num", head_num)
        self.head_dim = positive_int("head_dim", head_dim)
        self.v_head_dim = positive_int("v_head_dim", head_dim if v_head_dim is None else v_head_dim)
        self.row_dim = self.head_num * self.head_dim
        self.k_buffer = self._alloc_layers((self.head_num, self.head_dim))
        self.v_buffer = self._alloc_layers((self.head_num, self.v_head_dim))
        self.k_data_ptrs = ptr_table(self.k_buffer, self.device)
        self.v_data_ptrs = ptr_table(self.v_buffer, self.device)
        self.data_ptrs = ptr_table(self.k_buffer + self.v_buffer, self.device)
        e = torch.empty((), dtype=self.store_dtype).element_size()
        self.data_strides = torch.tensor(
            [self.head_num * self.head_dim * e] * self.layer_num
            + [self.head_num * self.v_head_dim * e] * self.layer_num,
            device=self.device,
        )

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id - self.start_layer]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id - self.start_layer]

    def get_kv_buffer(self, layer_id: int):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def get_kv_size_bytes(self) -> tuple[int, int]:
        return (
            sum(t.nbytes for t in self.k_buffer),
            sum(t.nbytes for t in self.v_buffer),
        )


class MLATokenToKVPool(_DevicePool):
    """Per layer one latent tensor `(size + page_size, 1, kv_cache_dim)`; `kv_cache_dim` defaults
    to `kv_lora_rank + qk_rope_head_dim` (pass the packed width, as `override_kv_cache_dim` or
    `kv_cache_dim`, for FP8 DSA layouts).

    The positional parameters follow SGLang's `MLATokenToKVPool`; `enable_memory_saver` and
    `use_nsa` are accepted and have no effect here."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str = "cpu",
        enable_memory_saver: bool = False,
        start_layer: int | None = None,
        end_layer: int | None = None,
        use_nsa: bool = False,
        override_kv_cache_dim: int | None = None,
        *,
        kv_cache_dim: int | None = None,
    ):
        super().__init__(size, page_size, dtype, layer_num, device, start_layer, end_layer)
        self.enable_memory_saver = bool(enable_memory_saver)
        self.use_nsa = bool(use_nsa)
        if kv_cache_dim is None:
            kv_cache_dim = override_kv_cache_dim
        elif override_kv_cache_dim is not None and override_kv_cache_dim != kv_cache_dim:
            raise ValueError(
                f"kv_cache_dim ({kv_cache_dim}) and override_kv_cache_dim "
                f"({override_kv_cache_dim}) disagree"
            )
        self.kv_lora_rank = positive_int("kv_lora_rank", kv_lora_rank)
        if qk_rope_head_dim < 0:
            raise ValueError(f"qk_rope_head_dim must not be negative, got {qk_rope_head_dim}")
        self.qk_rope_head_dim = int(qk_rope_head_dim)
        self.kv_cache_dim = positive_int(
            "kv_cache_dim",
            self.kv_lora_rank + self.qk_rope_head_dim if kv_cache_dim is None else kv_cache_dim,
        )
        self.kv_buffer = self._alloc_layers((1, self.kv_cache_dim))
        self.data_ptrs = ptr_table(self.kv_buffer, self.device)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id - self.start_layer]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id - self.start_layer][..., : self.kv_lora_rank]

    def get_kv_size_bytes(self) -> int:
        return sum(t.nbytes for t in self.kv_buffer)
