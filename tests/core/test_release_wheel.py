"""The release wheel (what `pip install .` builds, without the test-only cargo features) has no
entry point that takes a raw address: the old crashing call must be gone from it.

scripts/test.sh builds that wheel and names it in HOSTKV_RELEASE_WHEEL; elsewhere this skips."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

WHEEL = os.environ.get("HOSTKV_RELEASE_WHEEL")

PROBE = r"""
import torch
import os
from hostkv_rs import _core
assert _core.__file__.startswith(os.environ["WHEEL_DIR"]), _core.__file__
region = _core.HostRegion(64)
core = _core.HostPool.from_geometry("layer_first", 1, 8, 1, [8], [region], 1)
assert not hasattr(core, "load") and not hasattr(core, "backup"), dir(core)
try:
    # The call that used to end in a segmentation fault: an arbitrary device address.
    core.load("kernel", 0, [0x10000], 1, (0x10000, 1, 8, False), (0x10000, 1, 8, False), "cpu", 0)
except AttributeError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.skipif(not WHEEL, reason="HOSTKV_RELEASE_WHEEL is not set (scripts/test.sh sets it)")
def test_the_release_wheel_takes_no_raw_address(tmp_path):
    assert WHEEL and os.path.exists(WHEEL), WHEEL
    with zipfile.ZipFile(WHEEL) as whl:
        whl.extractall(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "WHEEL_DIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "REFUSED" in done.stdout and "load" in done.stdout, done.stdout
