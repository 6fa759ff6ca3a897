"""Keeping a pool's own tensors writable whatever torch mode its caller is in."""

from __future__ import annotations

from functools import wraps

import torch


def outside_inference_mode(func):
    """Run `func` with torch's inference mode off when its caller has it on (grad mode as the
    caller had it). Tensors made under inference mode are inference tensors, which torch
    refuses to update in place outside that mode: a pool built or cleared in it (a scheduler's
    loop runs in it) could then not be written or freed from a thread that is not (the cache
    controller's, a storage backend's). A caller not in inference mode runs `func` as is."""

    @wraps(func)
    def wrapper(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return func(*args, **kwargs)
        grad = torch.is_grad_enabled()  # inference_mode(False) alone turns grad mode on
        with torch.inference_mode(False), torch.set_grad_enabled(grad):
            return func(*args, **kwargs)

    return wrapper
