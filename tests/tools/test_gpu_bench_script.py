"""scripts/gpu_bench.py, the GPU run's throughput table, dry-run on CPU device pools: every
(layout, io backend) pair the core serves gets a row per op, and none of them errors (a GPU run
has one try; a table that breaks there is lost)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hostkv_rs import _core

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_bench.py"


def test_the_dry_run_fills_every_row(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "gpu_bench.md"
    assert bench.main(["--device", "cpu", "--budget", "120", "--out", str(out)]) == 0
    table = out.read_text()
    assert table.startswith("Peak, one contiguous 64 MiB pinned copy (wall clock, CPU dry run)")
    rows = [line for line in table.splitlines() if line.startswith(("| mha", "| mla"))]
    want = {
        (kind, layout, backend, op)
        for kind in ("mha", "mla")
        for layout, backend in _core.supported_pairs(kind)
        for op in ("backup", "load")
    }
    got = {(r.split("|")[1].split()[0], *(c.strip() for c in r.split("|")[2:5])) for r in rows}
    assert got == want
    assert all(r.split("|")[6].strip().endswith("%") for r in rows), table
