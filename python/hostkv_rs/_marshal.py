"""Handing a transfer to the Rust core: index tensors in the form it reads, the CUDA stream and
CPU engine of the call, the raw `PoolCore.load/backup` calls the V4 pools still make, and the
`*_data_ptrs` tables."""

from __future__ import annotations

import torch

from hostkv_rs import _memory
from hostkv_rs._device_side import DeviceLayers
from hostkv_rs._indices import as_index_array, index_arg

_CPU = torch.device("cpu")


def ptr_table(tensors, device) -> torch.Tensor:
    """SGLang's uint64 table of `data_ptr()`s on `device` (the pools' `*_data_ptrs`)."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64, device=device)


def stream_and_engine(device: torch.device) -> tuple[str, int, str]:
    """(device type, stream, engine) for the core: torch's current stream of a CUDA device, else
    the CPU engine chosen by HOSTKV_CPU_ENGINE. Only a CUDA device pool may touch torch.cuda:
    CPU-only runs never initialise it."""
    if device.type == "cuda":
        return "cuda", torch.cuda.current_stream(device).cuda_stream, "plan"
    return "cpu", 0, _memory.cpu_engine()


def run_backup(core, backend: str, dev: DeviceLayers, host_idx, dev_idx, host_layer=None) -> None:
    """Device -> host: every layer, or only `host_layer` (then `dev.ptrs` holds one per plane)."""
    where, stream, engine = stream_and_engine(dev.device)
    core.backup(
        backend,
        dev.ptrs,
        dev.rows,
        index_arg(host_idx),
        index_arg(dev_idx),
        where,
        stream,
        engine,
        host_layer,
    )


def run_load(core, backend: str, host_layer: int, dev: DeviceLayers, host_idx, dev_idx) -> None:
    where, stream, engine = stream_and_engine(dev.device)
    core.load(
        backend,
        host_layer,
        dev.ptrs,
        dev.rows,
        index_arg(host_idx),
        index_arg(dev_idx),
        where,
        stream,
        engine,
    )


def transfer_indices(host_indices, device_indices, io_backend: str, device: torch.device):
    """Index tensors in the form the core reads: contiguous int32/int64. CPU device pools and the
    direct backend read them on the host; a CUDA kernel transfer keeps device-resident indices
    where they are (the kernel bounds-checks them itself)."""
    target = None if (device.type == "cuda" and io_backend == "kernel") else _CPU
    return as_index_array(host_indices, target), as_index_array(device_indices, target)
