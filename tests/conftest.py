"""Fixtures for the host-pool tests (the pool builders live in reference.py: a module named
`conftest` is ambiguous once tests/gpu has its own)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# The suite's helper modules (reference.py, mooncake_support.py) sit here; the test modules live
# in subfolders that mirror the package (pools/, core/, l3/, tools/).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_EMULATION_PROBE: dict[str, str | None] = {}


def _emulation_unavailable() -> str | None:
    """Why the core cannot run kernel emulation (None when it can); probed once per session."""
    if "reason" not in _EMULATION_PROBE:
        from hostkv_rs import _core

        region = _core.HostRegion(64)
        core = _core.HostPool.from_geometry("layer_first", 1, 8, 1, [8], [region], 1)
        idx = torch.zeros(1, dtype=torch.int64)
        dev = torch.zeros(8, 8, dtype=torch.uint8)
        arg = (idx.data_ptr(), 1, 8, False)
        try:
            core.backup("kernel", [dev.data_ptr()], 8, arg, arg, "cpu", 0, "emulated")
            _EMULATION_PROBE["reason"] = None
        except ValueError as exc:
            if "emulat" not in str(exc):
                raise
            _EMULATION_PROBE["reason"] = f"the Rust core reports: {exc}"
    return _EMULATION_PROBE["reason"]


@pytest.fixture
def emulation_built():
    """Skip unless the core carries the kernel emulator (cargo feature `emulator`; the release
    wheel leaves it out). Under HOSTKV_REQUIRE_EMULATION=1 (scripts/test.sh) fail instead, so CI
    cannot lose the emulation tests to a build without it."""
    reason = _emulation_unavailable()
    if reason is None:
        return
    if os.environ.get("HOSTKV_REQUIRE_EMULATION") == "1":
        pytest.fail(f"HOSTKV_REQUIRE_EMULATION=1 but kernel emulation is not built: {reason}")
    pytest.skip(f"kernel emulation is not built: {reason}")


@pytest.fixture
def emulated_engine(emulation_built, monkeypatch):
    """Run the pools' CPU transfers through the kernel emulation (HOSTKV_CPU_ENGINE=emulated)."""
    monkeypatch.setenv("HOSTKV_CPU_ENGINE", "emulated")
