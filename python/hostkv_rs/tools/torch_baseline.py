"""What a Python host pool would write, and the bench's yardstick: plain torch indexing over the
pools' documented buffer views (host-pool-contract.md §2), plus index placement as SGLang's
controller prepares it."""

from __future__ import annotations


def device_planes(device_pool, kind: str) -> list[list]:
    """Plane-major lists of per-layer device tensors `(rows, ...)`."""
    if kind == "mla":
        return [list(device_pool.kv_buffer)]
    return [list(device_pool.k_buffer), list(device_pool.v_buffer)]


def host_planes(host_pool, kind: str) -> list:
    """Host plane tensors in their contract shapes (host-pool-contract.md §2)."""
    if kind == "mla":
        return [host_pool.kv_buffer]
    if host_pool.layout == "page_unified":  # (Pn, G, L, 2, P, H/G, D): K and V interleaved
        return [host_pool.kv_buffer[:, :, :, 0], host_pool.kv_buffer[:, :, :, 1]]
    return [host_pool.k_buffer, host_pool.v_buffer]


def host_index(layout: str, host_idx, page_size: int):
    """Index tuple into `host_layer_view(...)` selecting the rows of `host_idx` (token slots)."""
    if layout in ("layer_first", "page_first"):
        return (host_idx,)
    return (host_idx // page_size, host_idx % page_size)


def host_layer_view(plane, layout: str, layer: int):
    """A view of one layer of a host plane, indexable by `host_index(...)` to `(n, *item)`."""
    if layout == "layer_first":  # (L, S, ...)
        return plane[layer]
    if layout == "page_first":  # (S, L, ...)
        return plane[:, layer]
    if layout == "page_first_direct":  # (Pn, L, P, ...)
        return plane[:, layer]
    if layout == "page_head":  # (Pn, H, P, L, D) -> (Pn, P, H, D)
        return plane[:, :, :, layer].transpose(1, 2)
    if layout == "page_unified":
        if plane.dim() == 4:  # MLA (Pn, L, P, D)
            return plane[:, layer]
        return plane[:, :, layer].transpose(1, 2)  # (Pn, G, P, H/G, D) -> (Pn, P, G, H/G, D)
    raise ValueError(f"Unsupported layout: {layout}")


def _as_rows(rows, view, index):
    """`rows` shaped as `view[index]` (page_unified splits a row's heads into groups)."""
    return rows.reshape(rows.shape[0], *view.shape[len(index) :])


def torch_backup(dev_planes, hst_planes, layout, page_size, host_idx, dev_idx):
    hi = host_index(layout, host_idx, page_size)
    for dplane, hplane in zip(dev_planes, hst_planes, strict=True):
        for layer, dev_layer in enumerate(dplane):
            rows = dev_layer[dev_idx]
            if rows.device.type != "cpu":
                rows = rows.to("cpu")
            view = host_layer_view(hplane, layout, layer)
            view[hi] = _as_rows(rows, view, hi)


def torch_load(dev_planes, hst_planes, layout, page_size, host_idx, dev_idx, layer):
    hi = host_index(layout, host_idx, page_size)
    for dplane, hplane in zip(dev_planes, hst_planes, strict=True):
        dev_layer = dplane[layer]
        rows = host_layer_view(hplane, layout, layer)[hi]
        if dev_layer.device.type != "cpu":
            rows = rows.to(dev_layer.device, non_blocking=True)
        dev_layer[dev_idx] = rows.reshape(rows.shape[0], *dev_layer.shape[1:])


# ---------------------------------------------------------------------------------------------
# Index placement, as HiCacheController.move_indices prepares it (contract §3.1).


def place_indices(host_pool, backend, layout, op, host_idx, dev_idx, device):
    import torch

    if device == "cpu" or backend != "kernel":
        return host_idx.cpu(), dev_idx.cpu()
    dev = torch.device(device)
    keep_host_on_cpu = (
        op == "backup"
        and layout == "page_first"
        and getattr(host_pool, "can_use_write_back_jit", False)
    )
    return (host_idx.cpu() if keep_host_on_cpu else host_idx.to(dev)), dev_idx.to(dev)


def page_tokens(pages, page_size):
    """Token slots of whole pages, page by page."""
    import torch

    pages = torch.as_tensor(pages, dtype=torch.int64)
    return (pages[:, None] * page_size + torch.arange(page_size, dtype=torch.int64)).reshape(-1)
