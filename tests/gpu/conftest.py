"""GPU-only tests (tests/gpu): skipped unless torch sees a CUDA device and the hostkv_rs core can
use the driver. Run them on a GPU host with scripts/gpu_check.sh."""

from __future__ import annotations

import os
import sys

import pytest

# The shared oracle (tests/reference.py) lives one directory up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cuda_ready() -> tuple[bool, str]:
    try:
        import torch
        from hostkv_rs import _core
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        return False, f"import failed: {exc}"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    if not _core.cuda_available():
        return False, _core.runtime_info()
    return True, ""


def pytest_collection_modifyitems(config, items):
    ok, why = cuda_ready()
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not ok:
                item.add_marker(pytest.mark.skip(reason=f"needs CUDA: {why}"))
