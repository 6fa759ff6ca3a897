"""The `hostkv-rs` command end to end.

The presets, an invalid pair and `bench --quick --json` run as a user runs them, `python -m
hostkv_rs ...` in a subprocess; the wider matrix of pairs and options calls `cli.main` in-process,
which exercises the same code without paying a torch import per case. Geometries are small (2
layers, a few pages) so the file stays under a minute on 2 busy cores; `--quick` runs unchanged.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

# The package imports the Rust extension; without a build there is nothing to run.
cli = pytest.importorskip("hostkv_rs.tools.cli")
presets = pytest.importorskip("hostkv_rs.tools.presets")
PRESETS = presets.PRESETS
get_preset = presets.get_preset

SMALL = ["--layers", "2", "--pages", "4", "--page-size", "4"]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    return subprocess.run(
        [sys.executable, "-m", "hostkv_rs", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """`hostkv-rs ARGS` in this process: (exit code, stdout, stderr)."""
    try:
        rc = cli.main(list(args))
    except SystemExit as exc:  # argparse's own exits (--help, bad option values)
        rc = exc.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (
        f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc.stdout


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_demo_each_preset_verifies(preset):
    out = _ok(run_cli("demo", "--preset", preset, *SMALL))
    assert "verified OK" in out
    assert "MISMATCH" not in out
    # geometry and throughput lines are there and carry numbers
    assert "backup" in out and "GB/s" in out
    assert get_preset(preset).with_overrides(layers=2).describe() in out


# Every (layout, backend) pair each pool kind supports, in one small demo per pair.
PAIRS = [
    ("llama-3.1-8b", "layer_first", "kernel"),
    ("llama-3.1-8b", "page_first", "kernel"),
    ("llama-3.1-8b", "page_head", "kernel"),
    ("llama-3.1-8b", "layer_first", "direct"),
    ("llama-3.1-8b", "page_first_direct", "direct"),
    ("deepseek-v3", "page_first", "kernel"),
    ("deepseek-v3", "layer_first", "direct"),
    ("deepseek-v3", "page_first_direct", "direct"),
    ("mimo-v2", "page_first_direct", "direct"),
]


@pytest.mark.parametrize(("preset", "layout", "backend"), PAIRS)
def test_demo_layout_backend_pairs(capsys, preset, layout, backend):
    rc, out, err = run_main(
        capsys, "demo", "--preset", preset, "--layout", layout, "--backend", backend, *SMALL
    )
    assert rc == 0, out + err
    assert "verified OK" in out
    assert f"layout {layout}" in out


def test_demo_geometry_overrides_show_in_report(capsys):
    rc, out, err = run_main(
        capsys,
        "demo",
        "--preset",
        "llama-3.1-8b",
        "--layers",
        "3",
        "--heads",
        "2",
        "--head-dim",
        "64",
        "--v-head-dim",
        "32",
        "--pages",
        "3",
        "--page-size",
        "8",
        "--dtype",
        "fp16",
        "--layout",
        "page_first",
    )
    assert rc == 0, out + err
    # a different V width turns the symmetric preset into the asymmetric pool
    assert "AsymmetricMHATokenToKVPoolHost" in out
    assert "3 layers" in out and "2 KV heads" in out and "fp16" in out
    assert "256 + 128 B/token/layer" in out
    assert "verified OK" in out


def _corrupting(cls, where: str):
    """A pool class whose transfers go wrong in one way the demo must notice."""

    class Corrupting(cls):
        def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io):
            super().backup_from_device_all_layer(device_pool, host_indices, device_indices, io)
            if where == "host":  # one wrong byte at a backed-up slot (layer_first: [layer, slot])
                first = int(host_indices.reshape(-1)[0])
                self.k_buffer[0, first].view(torch.uint8).view(-1)[0] ^= 0xFF
            if where == "host_stray":  # a write outside every backed-up slot
                flat = self.kv_buffer[-1] if isinstance(self.kv_buffer, tuple) else self.kv_buffer
                flat.view(-1).view(torch.uint8)[-1] ^= 0x5A

        def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer, io):
            super().load_to_device_per_layer(device_pool, host_indices, device_indices, layer, io)
            if layer == 0 and where == "device":
                row = int(device_indices.reshape(-1)[-1])
                device_pool.v_buffer[0][row].view(torch.uint8).view(-1)[3] ^= 0x01
            if layer == 0 and where == "device_stray":
                device_pool.k_buffer[0][0].view(torch.uint8).view(-1)[0] ^= 0x01  # padding row

    return Corrupting


@pytest.mark.parametrize("where", ["host", "host_stray", "device", "device_stray"])
def test_demo_reports_mismatch_and_fails(capsys, monkeypatch, where):
    from hostkv_rs.tools import demo

    real = demo.host_pool_class
    monkeypatch.setattr(
        demo, "host_pool_class", lambda pool, kind: _corrupting(real(pool, kind), where)
    )
    rc, out, err = run_main(capsys, "demo", "--preset", "llama-3.1-8b", *SMALL)
    assert rc == 1, out + err
    assert "MISMATCH" in out and "verified OK" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--preset", "llama-3.1-8b", "--layout", "page_first_direct", "--backend", "kernel"],
            "Unsupported layout: page_first_direct",
        ),
        (
            ["--preset", "llama-3.1-8b", "--layout", "page_first", "--backend", "direct"],
            "Unsupported layout: page_first",
        ),
        (
            ["--preset", "mimo-v2", "--layout", "layer_first", "--backend", "kernel"],
            "Unsupported layout for models with head_dim != v_head_dim: layer_first",
        ),
        (
            ["--preset", "deepseek-v3", "--layout", "page_head", "--backend", "kernel"],
            "Unsupported layout: page_head",
        ),
        (
            ["--preset", "llama-3.1-8b", "--backend", "nvlink"],
            "Unsupported IO backend: nvlink",
        ),
    ],
)
def test_demo_invalid_pair_is_a_clear_error(capsys, args, message):
    rc, out, err = run_main(capsys, "demo", *args, *SMALL)
    assert rc == 2, out + err
    assert f"hostkv-rs demo: error: {message}" in err
    assert "verified OK" not in out


def test_demo_invalid_pair_exit_code_from_the_command_line():
    proc = run_cli(
        "demo", "--preset", "llama-3.1-8b", "--layout", "page_head", "--backend", "direct", *SMALL
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Unsupported layout: page_head" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "deepseek-v3", "--heads", "4"], "--heads does not apply"),
        (["--dtype", "int7"], "unknown dtype 'int7'"),
    ],
)
def test_demo_bad_options(capsys, args, message):
    rc, _out, err = run_main(capsys, "demo", *args, *SMALL)
    assert rc == 2
    assert message in err


def test_demo_rejects_non_positive_pages(capsys):
    rc, _out, err = run_main(capsys, "demo", "--pages", "0")
    assert rc == 2
    assert "must be a positive integer" in err


REQUIRED = {
    "pool": str,
    "layout": str,
    "backend": str,
    "op": str,
    "item_bytes": int,
    "pages": int,
    "gbps": float,
    "torch_gbps": float,
    "memcpy_gbps": float,
    "us_per_call": float,
}


def _check_rows(report: dict) -> list[dict]:
    rows = report["results"]
    assert rows, report
    for row in rows:
        for key, typ in REQUIRED.items():
            assert key in row, (key, row)
            assert isinstance(row[key], typ), (key, row)
        for key in ("gbps", "torch_gbps", "memcpy_gbps", "us_per_call"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert row["op"] in ("backup", "load", "alloc")
        assert row["pages"] > 0 and row["item_bytes"] > 0
    return rows


def test_bench_quick_json():
    proc = run_cli("bench", "--quick", "--json", timeout=300)
    out = _ok(proc)
    report = json.loads(out)  # stdout is exactly one JSON object
    rows = _check_rows(report)
    ops = {r["op"] for r in rows}
    assert ops == {"backup", "load", "alloc"}, ops
    # the one-page load latency row is there
    assert any(r["op"] == "load" and r["pages"] == 1 for r in rows)
    # every pool kind and both backends are covered by the quick matrix
    assert {r["pool"] for r in rows} == {"mha", "asym", "mla"}
    assert {r["backend"] for r in rows if r["op"] != "alloc"} == {"kernel", "direct"}
    assert not report["truncated"]
    if report["device"] == "cpu":  # engine-level rows are measured on CPU runs only
        assert {f["what"] for f in report["foundation"]} >= {
            "cpu engine gather, 2 KiB items",
            "cpu engine gather, 128 KiB items",
            "HostRegion alloc + pre-touch",
        }


def test_bench_tiny_table_and_plot_flag(capsys, tmp_path):
    rc, out, err = run_main(capsys, "bench", "--tiny", "--no-progress")
    assert rc == 0, err
    assert "x torch" in out
    assert ("foundation" in out) == (not torch.cuda.is_available())
    for op in ("backup", "load", "alloc"):
        assert f" {op} " in out
    path = tmp_path / "b.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        rc, out, err = run_main(capsys, "bench", "--tiny", "--plot", str(path))
        assert rc == 2
        assert "matplotlib" in err and "not installed" in err
        assert out == ""
    else:
        rc, _out, err = run_main(capsys, "bench", "--tiny", "--no-progress", "--plot", str(path))
        assert rc == 0, err
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_max_seconds_stops_early(capsys):
    rc, out, err = run_main(capsys, "bench", "--tiny", "--json", "--max-seconds", "0")
    assert rc == 0, err
    report = json.loads(out)
    assert report["truncated"] is True
    assert report["results"] == []


def test_help_reads_well(capsys):
    for args in ([], ["demo"], ["bench"]):
        rc, out, _err = run_main(capsys, *args, "--help")
        assert rc == 0
        assert "usage: hostkv-rs" in out
    _rc, demo_help, _ = run_main(capsys, "demo", "--help")
    for preset in PRESETS:
        assert preset in demo_help
    _rc, bench_help, _ = run_main(capsys, "bench", "--help")
    assert "--quick" in bench_help and "--max-seconds" not in bench_help


def test_no_subcommand_prints_help(capsys):
    rc, out, _err = run_main(capsys)
    assert rc == 2
    assert "demo" in out and "bench" in out


def test_console_script_entry_point():
    # pyproject.toml: hostkv-rs = "hostkv_rs.tools.cli:main"
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("source tree not available")
    scripts = tomllib.loads(pyproject.read_text())["project"]["scripts"]
    assert scripts["hostkv-rs"] == "hostkv_rs.tools.cli:main"
    assert cli.build_parser().prog == "hostkv-rs"


def test_bench_runs_keep_each_measurement_at_its_best():
    from hostkv_rs.tools import bench

    def row(pages, gbps, torch_gbps, us):
        return {
            "pool": "mha",
            "layout": "layer_first",
            "backend": "kernel",
            "op": "load",
            "item_bytes": 2048,
            "pages": pages,
            "bytes": 4096,
            "gbps": gbps,
            "torch_gbps": torch_gbps,
            "us_per_call": us,
        }

    runs = [
        [row(1, 1.0, 7.0, 9.0), row(4, 5.0, 1.0, 1.0)],
        [row(1, 3.0, 2.0, 3.0)],
        [row(1, 2.0, 0.5, 5.0)],
    ]
    merged = bench._best_rows(runs, bench._ROW_KEY)
    assert [
        (r["pages"], r["gbps"], r["torch_gbps"], r["us_per_call"], r["runs"]) for r in merged
    ] == [(1, 3.0, 7.0, 3.0, 3), (4, 5.0, 1.0, 1.0, 1)]
    assert merged[0]["bytes"] == 4096  # integers identify the row; they are not merged


def test_old_import_paths_are_the_tools_modules():
    # The CLI, demo, bench, presets and reference device pools moved to hostkv_rs.tools; the old
    # names are the same module objects (so attributes and monkeypatches are shared).
    import importlib

    for name in ("bench", "cli", "demo", "presets", "device_pools"):
        old = importlib.import_module(f"hostkv_rs.{name}")
        assert old is importlib.import_module(f"hostkv_rs.tools.{name}"), name
