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
import re
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
    ("llama-3.1-8b", "page_unified", "kernel"),
    ("llama-3.1-8b", "layer_first", "direct"),
    ("llama-3.1-8b", "page_first_direct", "direct"),
    ("deepseek-v3", "page_first", "kernel"),
    ("deepseek-v3", "page_unified", "kernel"),
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


def _no_allocation(monkeypatch):
    """Make building a device pool fail loudly: a refused choice must not get that far."""
    from hostkv_rs.tools import demo

    def refuse(*_a, **_k):
        raise AssertionError("a device pool was built for a demo that should have been refused")

    monkeypatch.setattr(demo, "build_device_pool", refuse)


@pytest.mark.parametrize(
    ("args", "pair", "served"),
    [
        (
            ["--preset", "llama-3.1-8b", "--layout", "page_first_direct", "--backend", "kernel"],
            "--layout page_first_direct with --backend kernel",
            "page_head+kernel",
        ),
        (
            ["--preset", "llama-3.1-8b", "--layout", "page_first", "--backend", "direct"],
            "--layout page_first with --backend direct",
            "page_first_direct+direct",
        ),
        (
            ["--preset", "llama-3.1-8b", "--layout", "page_head", "--backend", "direct"],
            "--layout page_head with --backend direct",
            "layer_first+direct",
        ),
        (
            ["--preset", "mimo-v2", "--layout", "layer_first", "--backend", "kernel"],
            "--layout layer_first with --backend kernel",
            "page_first+kernel, page_first_direct+direct",
        ),
        (
            ["--preset", "deepseek-v3", "--layout", "page_head", "--backend", "kernel"],
            "--layout page_head with --backend kernel",
            "layer_first+kernel",
        ),
    ],
)
def test_demo_unsupported_pair_is_named_as_a_pair_before_allocating(
    capsys, monkeypatch, args, pair, served
):
    _no_allocation(monkeypatch)
    rc, out, err = run_main(capsys, "demo", *args, *SMALL)
    assert rc == 2, out + err
    assert f"hostkv-rs demo: error: {pair} is not a supported (layout, backend) pair" in err
    assert served in err
    assert "Unsupported layout" not in err
    assert out == ""


@pytest.mark.parametrize(
    ("args", "valid"),
    [
        (["--backend", "nvlink"], "'kernel', 'direct'"),
        (["--layout", "head_first"], "'layer_first', 'page_first', 'page_first_direct'"),
        (["--dtype", "int7"], "'bf16'"),
        (["--preset", "llama-9"], "'deepseek-v3'"),
        (["--device", "tpu"], "'cpu', 'cuda'"),
    ],
)
def test_demo_invalid_choice_lists_the_valid_ones(capsys, monkeypatch, args, valid):
    _no_allocation(monkeypatch)
    rc, out, err = run_main(capsys, "demo", *args, *SMALL)
    assert rc == 2, out + err
    assert f"invalid choice: '{args[1]}'" in err
    assert valid in err
    assert "Traceback" not in err


def test_demo_dtype_is_case_insensitive(capsys):
    rc, out, err = run_main(capsys, "demo", "--dtype", "FP16", *SMALL)
    assert rc == 0, out + err
    assert "fp16" in out


def test_demo_invalid_pair_exit_code_from_the_command_line():
    proc = run_cli(
        "demo", "--preset", "llama-3.1-8b", "--layout", "page_head", "--backend", "direct", *SMALL
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--layout page_head with --backend direct is not a supported" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "deepseek-v3", "--heads", "4"], "--heads does not apply"),
        (["--host-ratio", "-1"], "--host-ratio must be a finite number >= 0"),
        (["--host-ratio", "nan"], "--host-ratio must be a finite number >= 0"),
        # finite, but the host pool's token count is not (it was an OverflowError traceback)
        (["--host-ratio", "1e308"], "--host-ratio 1e+308 sizes the host pool past any memory"),
        # too small for the pages the demo backs up: refused before the pools are allocated
        (["--host-ratio", "1e-9"], "gives the host pool 1 pages, fewer than the"),
    ],
)
def test_demo_bad_options(capsys, monkeypatch, args, message):
    _no_allocation(monkeypatch)
    rc, _out, err = run_main(capsys, "demo", *args, *SMALL)
    assert rc == 2
    assert message in err


def test_demo_rejects_non_positive_pages(capsys):
    rc, _out, err = run_main(capsys, "demo", "--pages", "0")
    assert rc == 2
    assert "must be a positive integer" in err


def test_demo_too_big_for_this_machine_is_refused_with_the_numbers():
    # 10^8 pages x 16 tokens x 128 KiB per token: petabytes, more than any machine has. Run as
    # a user would: the error must come before torch's allocator (or the OOM killer) is reached.
    proc = run_cli("demo", "--pages", "100000000")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "Traceback" not in err
    assert err.count("\n") == 1, err  # one line
    assert "hostkv-rs demo: error: not enough memory" in err
    device = (100_000_000 + 1) * 16 * get_preset("llama-3.1-8b").bytes_per_token()
    assert f"device pool (on cpu) needs {device / 1e9:.2f} GB ({device:,} bytes)" in err
    assert re.search(r"but [\d.]+ GB \([\d,]+ bytes\) is available \(", err), err
    assert "keeps 10 GiB (10,737,418,240 bytes" in err
    assert proc.stdout == ""


def _fake_available(monkeypatch, available: int):
    from hostkv_rs.tools import demo

    monkeypatch.setattr(demo, "available_memory", lambda: (available, "a test's figure"))


def test_demo_available_memory_is_psutils_or_less(monkeypatch):
    import psutil
    from hostkv_rs.tools import demo

    available, source = demo.available_memory()
    assert 0 < available <= psutil.virtual_memory().available * 1.05 and source


def test_demo_memory_check_counts_the_host_pools_and_the_reserve(capsys, monkeypatch):
    from hostkv_rs.tools import demo

    args = ["demo", "--preset", "llama-3.1-8b", *SMALL]
    cfg_bytes = None

    real_run = demo.run_demo

    def spy(cfg, out=None):
        nonlocal cfg_bytes
        cfg_bytes = demo.demo_bytes(cfg)
        return real_run(cfg, out)

    monkeypatch.setattr(demo, "run_demo", spy)
    _fake_available(monkeypatch, 1 << 50)
    rc, out, err = run_main(capsys, *args)
    assert rc == 0, out + err
    device, host = cfg_bytes
    # what the pools report they allocated
    assert f"{device / (1 << 20):.1f} MiB" in out
    assert f"{host / (1 << 20):.1f} MiB" in out

    reserve = 10 * 1024**3
    _fake_available(monkeypatch, device + host + reserve)  # exactly enough
    rc, out, err = run_main(capsys, *args)
    assert rc == 0, out + err
    _fake_available(monkeypatch, device + host + reserve - 1)
    _no_allocation(monkeypatch)
    rc, out, err = run_main(capsys, *args)
    assert rc == 2, out + err
    assert f"the host pool {host / 1e9:.2f} GB ({host:,} bytes)" in err
    available = device + host + reserve - 1
    assert f"{available / 1e9:.2f} GB ({available:,} bytes) is available (a test's figure)" in err
    assert "keeps 10 GiB" in err and "SGLang's HiCache reserve" in err
    assert out == ""


def test_demo_memory_check_on_cuda_asks_the_gpu_for_the_device_pool(monkeypatch):
    from hostkv_rs.tools import demo

    cfg = demo.DemoConfig(
        preset=get_preset("llama-3.1-8b"),
        page_size=16,
        pages=1000,
        layout="layer_first",
        backend="kernel",
        device="cuda",
    )
    device, host = demo.demo_bytes(cfg)
    reserve = 10 * 1024**3
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (device - 1, 1 << 40))
    _fake_available(monkeypatch, host + reserve)
    with pytest.raises(ValueError, match="not enough GPU memory") as caught:
        demo.check_memory(cfg)
    assert f"needs {device / 1e9:.2f} GB ({device:,} bytes)" in str(caught.value)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (device, 1 << 40))
    demo.check_memory(cfg)  # the device pool is on the GPU: host memory holds the host pool only
    _fake_available(monkeypatch, host + reserve - 1)
    with pytest.raises(ValueError, match="not enough host memory: the host pool needs"):
        demo.check_memory(cfg)


def test_bench_too_big_for_this_machine_is_refused_with_the_numbers():
    # 10^8 layers: petabytes. Before this check the run grew towards them until the machine
    # swapped; the refusal must come before anything is allocated, in one line.
    proc = run_cli("bench", "--tiny", "--device", "cpu", "--layers", "100000000")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert "hostkv-rs bench: error: not enough memory for the benchmark" in err
    assert "keeps 10 GiB (10,737,418,240 bytes" in err and "lower --layers" in err
    assert proc.stdout == ""


def test_bench_memory_check_counts_the_pools_and_the_yardstick(monkeypatch):
    from hostkv_rs.tools import bench

    device, host = bench.memory_needed(bench.TINY)
    reserve = 10 * 1024**3
    _fake_available(monkeypatch, device + host + reserve)
    bench.check_memory(bench.TINY, "cpu")
    _fake_available(monkeypatch, device + host + reserve - 1)
    with pytest.raises(ValueError, match="not enough memory for the benchmark"):
        bench.check_memory(bench.TINY, "cpu")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (device - 1, 1 << 40))
    _fake_available(monkeypatch, host + reserve)
    with pytest.raises(ValueError, match="not enough GPU memory for the benchmark"):
        bench.check_memory(bench.TINY, "cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (device, 1 << 40))
    bench.check_memory(bench.TINY, "cuda")
    _fake_available(monkeypatch, host + reserve - 1)
    with pytest.raises(ValueError, match="not enough host memory for the benchmark"):
        bench.check_memory(bench.TINY, "cuda")


def test_demo_says_why_its_numbers_are_not_the_benchmarks(capsys):
    rc, out, err = run_main(capsys, "demo", *SMALL)
    assert rc == 0, out + err
    note = [line for line in out.splitlines() if line.lstrip().startswith("note")]
    assert len(note) == 1, out
    assert "hostkv-rs bench" in note[0] and "warmup" in note[0]


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
    yardstick = "one-thread memmove" if report["device"] == "cpu" else "cudaMemcpy (torch copy_)"
    for r in rows:
        assert r["copy_yardstick"] == (
            "one-thread memset of faulted memory" if r["op"] == "alloc" else yardstick
        ), r
        assert isinstance(r["copy_consistent"], bool) and r["copy_threads"] >= 1, r
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


def test_bench_timer_interleaves_calls_in_rotating_order():
    from hostkv_rs.tools import bench

    calls = []
    made = []
    timer = bench.Timer("cpu")
    times = timer.interleaved(
        {name: (lambda i, name=name: calls.append((name, i)) or name) for name in "abc"},
        calls=3,
        warmup=1,
        release=made.append,
    )
    assert calls == [
        ("a", 0), ("b", 0), ("c", 0),  # warmup
        ("a", 0), ("b", 0), ("c", 0),
        ("b", 1), ("c", 1), ("a", 1),
        ("c", 2), ("a", 2), ("b", 2),
    ]  # fmt: skip
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert made == [name for name, _ in calls]  # every result released, outside the timing


def test_bench_cpu_copy_yardstick_is_one_threads_memmove(monkeypatch):
    from hostkv_rs.tools import bench

    ctx = bench.Context(
        matrix=bench.TINY, device="cpu", timer=bench.Timer("cpu"), deadline=float("inf")
    )
    seen = []
    real = bench.ctypes.memmove
    monkeypatch.setattr(
        bench.ctypes, "memmove", lambda dst, src, n: seen.append(n) or real(dst, src, n)
    )
    copy = ctx.copy_fn(4096, "h2d", slots=3)
    host, dev = ctx.scratch(3 * 4096)
    host.copy_(torch.arange(3 * 4096, dtype=torch.int64).to(torch.uint8))
    for i in range(3):
        copy(i)
    assert seen == [4096] * 3
    assert torch.equal(host, dev)
    assert ctx.copy_yardstick() == "one-thread memmove"


def test_bench_engine_thread_bound():
    from hostkv_rs.tools import bench

    assert bench.pool_threads("cpu", "load", (1 << 20) - 1) == 1
    assert bench.pool_threads("cuda", "backup", 1 << 30) == 1
    big = bench.pool_threads("cpu", "backup", 1 << 30)
    assert 1 <= big <= 8
    assert bench.pool_threads("cpu", "alloc", 1 << 20) == 1


def _report(rows, foundation=()):
    return {
        "device": "cpu",
        "matrix": {"page_size": 16},
        "results": rows,
        "foundation": list(foundation),
    }


def _bench_row(gbps, memcpy_gbps, threads=1, op="load", pages=4):
    return {
        "pool": "mha",
        "layout": "layer_first",
        "backend": "kernel",
        "op": op,
        "item_bytes": 2048,
        "pages": pages,
        "bytes": 1 << 17,
        "gbps": gbps,
        "torch_gbps": 1.0,
        "memcpy_gbps": memcpy_gbps,
        "us_per_call": 10.0,
        "copy_threads": threads,
        "copy_yardstick": "one-thread memmove",
    }


def test_bench_refuses_a_ratio_over_an_inconsistent_yardstick():
    from hostkv_rs.tools import bench_report

    good, bad = _bench_row(4.0, 8.0), _bench_row(9.0, 3.0)
    # several pool threads may beat one copying thread
    parallel = _bench_row(9.0, 3.0, threads=4, op="backup")
    assert bench_report.copy_ratio(good) == 0.5
    assert bench_report.copy_ratio(bad) is None
    assert bench_report.copy_ratio(parallel) == 3.0
    table = bench_report.format_table(_report([good, bad, parallel]))
    lines = table.splitlines()
    # ... x copy, x NT (none in these rows), us/call
    assert lines[2].split()[-3:-1] == ["0.50", "-"]
    assert lines[3].split()[-3] == "n/a"
    assert lines[4].split()[-3] == "3.00"
    assert "n/a: yardstick inconsistent" in table
    markdown = bench_report.format_markdown(_report([good, bad]))
    assert "| n/a |" in markdown and "n/a: yardstick inconsistent" in markdown
    clean = bench_report.format_table(_report([good]))
    assert "n/a" not in clean


def test_bench_merged_runs_recheck_the_yardstick(monkeypatch):
    from hostkv_rs.tools import bench

    # the best pool run and the best copy run come from different runs
    runs = [_report([_bench_row(2.0, 1.0)]), _report([_bench_row(1.0, 4.0)])]
    for r in runs:
        r.update(machine={}, truncated=False)
    it = iter(runs)
    monkeypatch.setattr(bench, "run", lambda *_a, **_k: next(it))
    merged = bench.run_many(bench.TINY, 2)
    row = merged["results"][0]
    assert (row["gbps"], row["memcpy_gbps"], row["copy_consistent"]) == (2.0, 4.0, True)


def test_bench_plot_draws_the_ceiling_and_skips_inconsistent_ones(tmp_path):
    pytest.importorskip("matplotlib")
    from hostkv_rs.tools import bench_report

    rows = [_bench_row(4.0, 8.0, op=op) for op in ("backup", "load")]
    rows.append(_bench_row(9.0, 3.0, op="load") | {"layout": "page_first"})
    path = tmp_path / "plot.png"
    bench_report.plot(_report(rows), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_runs_without_the_raw_core_calls_of_the_release_wheel(capsys, monkeypatch):
    from hostkv_rs.tools import bench

    if torch.cuda.is_available():
        pytest.skip("the engine rows are measured on CPU runs only")
    monkeypatch.setattr(bench, "raw_calls_available", lambda: False)
    rc, out, err = run_main(capsys, "bench", "--tiny", "--no-progress")
    assert rc == 0, err
    assert "HostRegion alloc + pre-touch" in out
    assert "cpu engine gather" not in out
    assert "no raw HostPool.load/backup" in out


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


# The parser and --help without torch: a stand-in `hostkv_rs` package object keeps the real
# package's __init__ (which imports the pools) out, so this checks what the CLI itself imports.
_HELP_SCRIPT = """
import sys, types
pkg = types.ModuleType("hostkv_rs")
pkg.__path__ = [sys.argv[1]]
sys.modules["hostkv_rs"] = pkg
from hostkv_rs.tools import cli
for args in ([ "--help"], ["demo", "--help"], ["bench", "--help"], ["info", "--help"],
             ["--version"]):
    try:
        cli.main(args)
    except SystemExit as exc:
        assert exc.code == 0, (args, exc.code)
heavy = sorted(m for m in ("torch", "numpy", "psutil", "hostkv_rs._core") if m in sys.modules)
print("HEAVY", heavy)
"""


def test_help_and_version_import_no_torch():
    pkg_dir = os.path.dirname(cli.__file__).rsplit(os.sep, 1)[0]
    proc = subprocess.run(
        [sys.executable, "-c", _HELP_SCRIPT, pkg_dir],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "usage: hostkv-rs" in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    # --version may load the Rust core (torch-free) when the package is not installed
    assert last in ("HEAVY []", "HEAVY ['hostkv_rs._core']"), proc.stdout


def test_python_m_help_imports_no_torch():
    script = (
        "import runpy, sys\n"
        "sys.argv = ['hostkv_rs', '--help']\n"
        "try:\n"
        "    runpy.run_module('hostkv_rs', run_name='__main__', alter_sys=True)\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert "usage: hostkv-rs" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "TORCH False"


def test_version(capsys):
    rc, out, _err = run_main(capsys, "--version")
    assert rc == 0
    from hostkv_rs import _core

    assert out.strip() == f"hostkv-rs {cli.package_version()}"
    assert cli.package_version() not in ("", "unknown")
    from importlib import metadata

    try:
        assert cli.package_version() == metadata.version("hostkv-rs")
    except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH: the core's version
        assert cli.package_version() == _core.__version__


def test_version_from_the_command_line():
    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("hostkv-rs ") and proc.stdout.count("\n") == 1


def _fake_sys(tmp_path):
    hp = tmp_path / "hugepages"
    for kib, total, free in ((2048, 512, 100), (1048576, 4, 4)):
        d = hp / f"hugepages-{kib}kB"
        d.mkdir(parents=True)
        (d / "nr_hugepages").write_text(f"{total}\n")
        (d / "free_hugepages").write_text(f"{free}\n")
    nodes = tmp_path / "node"
    for n, cpus, kib in ((0, "0-7", 16 << 20), (1, "8-15", 16 << 20)):
        d = nodes / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {n} MemTotal:       {kib} kB\nNode {n} MemFree: 1 kB\n")
    (nodes / "possible").write_text("0-1\n")  # not a node directory
    thp = tmp_path / "thp_enabled"
    thp.write_text("always [madvise] never\n")
    return hp, nodes, thp


def test_info_prints_hugepages_numa_thp_memlock_and_cuda(capsys, monkeypatch, tmp_path):
    import resource

    hp, nodes, thp = _fake_sys(tmp_path)
    monkeypatch.setattr(cli, "SYS_HUGEPAGES", str(hp))
    monkeypatch.setattr(cli, "SYS_NODES", str(nodes))
    monkeypatch.setattr(cli, "SYS_THP", str(thp))
    monkeypatch.setattr(resource, "getrlimit", lambda what: (64 << 10, resource.RLIM_INFINITY))
    rc, out, err = run_main(capsys, "info")
    assert rc == 0, err
    assert "2 MiB: 512 total, 100 free; 1 GiB: 4 total, 4 free" in out
    assert "transparent hugepages [madvise]" in out
    assert "2 nodes: node0 (cpus 0-7, 16 GiB), node1 (cpus 8-15, 16 GiB)" in out
    assert "ulimit -l 64 KiB (hard limit unlimited)" in out
    from hostkv_rs import _core

    assert _core.runtime_info() in out
    assert ("driver found" if _core.cuda_available() else "no usable CUDA driver") in out
    assert "GB available" in out and "10 GiB in reserve" in out


def test_info_says_unknown_where_sys_is_hidden(capsys, monkeypatch, tmp_path):
    for name in ("SYS_HUGEPAGES", "SYS_NODES", "SYS_THP"):
        monkeypatch.setattr(cli, name, str(tmp_path / "absent" / name))
    rc, out, err = run_main(capsys, "info")
    assert rc == 0, err
    assert out.count("unknown (") == 3, out


def test_info_on_this_machine():
    proc = run_cli("info")
    out = _ok(proc)
    for label in ("core", "cuda", "hugepages", "THP", "NUMA", "pinned limit", "host memory"):
        assert f"  {label}" in out, out
    assert "ulimit -l" in out


def test_no_subcommand_prints_help(capsys):
    rc, out, _err = run_main(capsys)
    assert rc == 2
    assert "demo" in out and "bench" in out


def test_console_script_entry_point():
    # pyproject.toml: hostkv-rs = "hostkv_rs.tools.cli:main"
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
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


def test_nt_ratio_is_the_per_round_median_and_refused_when_impossible():
    from hostkv_rs.tools.bench_report import nt_ratio

    row = _bench_row(2.0, 4.0)
    assert nt_ratio(row) is None  # no streaming-store yardstick (a CUDA run)
    row["nt_ratio_rounds"] = {"min": 0.7, "median": 0.9, "rounds": 9}
    assert nt_ratio(row) == 0.9
    row["nt_ratio_rounds"] = {"min": 3.0, "median": 4.0, "rounds": 9}
    assert nt_ratio(row) is None  # one thread cannot be 4x faster than one contiguous copy


@pytest.mark.parametrize(
    "argv",
    [
        ["launch-sglang", "--model-path", "m", "--port", "1"],
        ["launch-sglang", "--", "--model-path", "m", "--port", "1"],
    ],
)
def test_launch_sglang_passes_sglangs_options_with_or_without_the_separator(monkeypatch, argv):
    # Without `--`, SGLang's options were read as unknown options of ours.
    import importlib.util
    import os

    from hostkv_rs.tools import cli

    ran = {}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(os, "execve", lambda exe, cmd, env: ran.update(cmd=cmd, env=env))
    assert cli.main(argv) == 0
    assert ran["cmd"][1:] == ["-m", "sglang.launch_server", "--model-path", "m", "--port", "1"]
    assert ran["env"]["HOSTKV_RS_SGLANG"] == "1"


def test_demo_seed_outside_64_bits_is_one_line(capsys):
    rc, _out, err = run_main(capsys, "demo", "--seed", str(2**64), *SMALL)
    assert rc == 2 and "--seed must be a 64-bit integer" in err
    # The ends of the range work (the per-layer seeds derived from it stay in 64 bits).
    for seed in (2**64 - 1, -(2**63)):
        rc, out, err = run_main(capsys, "demo", "--seed", str(seed), *SMALL)
        assert rc == 0 and "verified OK" in out, err
