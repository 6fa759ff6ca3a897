"""Handing a raw transfer to the Rust core (the V4 pools' `PoolCore.load/backup` calls): the CUDA
stream and CPU engine of the call; and the `*_data_ptrs` tables."""

from __future__ import annotations

import torch

from hostkv_rs import _memory
from hostkv_rs._device_side import DeviceLayers
from hostkv_rs._indices import index_arg


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


def run_backup(
    core, backend: str, dev: DeviceLayers, host_idx, dev_idx, host_layer=None, *, index_map=None
) -> None:
    """Device -> host: every layer, or only `host_layer` (then `dev.ptrs` holds one per plane).
    `index_map` says how the core reads both index arrays (`_core.PoolCore.backup`)."""
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
        index_map=index_map,
    )


def run_load(
    core, backend: str, host_layer: int, dev: DeviceLayers, host_idx, dev_idx, *, index_map=None
) -> None:
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
        index_map=index_map,
    )
