"""The `hostkv-rs` command (also `python -m hostkv_rs`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

# Only torch-free modules at the top: `hostkv-rs --help` must not pay for a torch import (seconds);
# torch, the pools and the Rust core are imported by the command that runs.
from hostkv_rs.tools.presets import DTYPES, PRESETS

PROG = "hostkv-rs"
# Small enough for a few seconds on 2 CPU cores; the model's real layer count and item sizes are
# kept, only the number of device pages is small.
DEMO_PAGES = 32
DEMO_PAGE_SIZE = 16

_DESCRIPTION = """\
hostkv_rs: SGLang HiCache host KV pools with a Rust core.

  demo   back up random device KV pages to a host pool, wipe them, reload every layer into
         other pages, and verify every byte (GPU when available, else CPU)
  bench  measure backup / load / pool creation against plain torch indexing and against one
         contiguous copy of the same bytes
  info   show what this machine offers the pools: CUDA driver, hugepages, transparent
         hugepages, NUMA nodes, the pinned-memory limit (ulimit -l), available memory
  launch-sglang
         run `python -m sglang.launch_server ARGS` with hostkv_rs serving SGLang's host pools
         in every process it starts
"""

# Host layouts and io backends as SGLang names them; which pairs a pool kind accepts comes from
# the Rust core (`_core.supported_pairs`), checked before anything is allocated.
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head", "page_unified")
BACKENDS = ("kernel", "direct")
# preset kinds -> the core's pool kinds
_CORE_KINDS = {"mha": "mha", "asym": "mha_asymmetric", "mla": "mla"}
_KIND_NAMES = {"mha": "MHA", "asym": "asymmetric MHA", "mla": "MLA"}


_DEMO_EPILOG = f"""\
presets:
{chr(10).join(f"  {name:<14} {p.describe()}" for name, p in PRESETS.items())}

The demo keeps the model's layer count and item sizes but only {DEMO_PAGES} device pages of
{DEMO_PAGE_SIZE} tokens by default, so it finishes in seconds; raise --pages / --page-size for more.
Layout/backend pairs are checked before anything is allocated: MHA takes layer_first, page_first
and page_head with kernel, layer_first and page_first_direct with direct; MLA the same without
page_head; the asymmetric pool (mimo-v2) only page_first+kernel and page_first_direct+direct.

examples:
  hostkv-rs demo
  hostkv-rs demo --preset deepseek-v3 --layout page_first_direct --backend direct
  hostkv-rs demo --preset mimo-v2 --pages 128 --page-size 64
  hostkv-rs demo --l3 mooncake     # + pages to and from a Mooncake Store (loopback master)

--l3 needs the mooncake extra: pip install ".[mooncake]" in the hostkv_rs checkout. Mooncake's own
log stays quiet unless HOSTKV_MOONCAKE_LOG=1 (or a level: INFO, WARNING, ERROR, TRACE) is set; a
--l3-master that does not accept connections is refused within seconds.
"""

_BENCH_EPILOG = """\
Every row is measured three ways, interleaved call by call so that other work on the machine
hits all three alike: the pool, plain torch indexing of the same buffers (`host[h] = dev[d]` per
layer and K/V, what a Python pool would do), and one contiguous copy of the same number of bytes
(one thread's memmove on CPU, cudaMemcpy on CUDA). Median of the repeats after a warmup; CUDA runs
are synchronised around every call. "x copy" reads n/a where the copy measured slower than the
pool could possibly beat it (the yardstick was disturbed; rerun, or use --runs 3).

  backup  all layers in one backup_from_device_all_layer call
  load    one load_to_device_per_layer call (one layer); pages=1 is the per-call latency row
  alloc   host pool creation incl. pre-touch vs torch.empty(n, dtype=torch.uint8).zero_()

examples:
  hostkv-rs bench --quick
  hostkv-rs bench --quick --json > bench.json
  hostkv-rs bench --plot bench.png          # needs matplotlib (not a dependency)
"""


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def package_version() -> str:
    """The installed distribution's version; from a checkout that is not installed, the Rust
    core's (built from the same version number)."""
    from importlib import metadata

    try:
        return metadata.version("hostkv-rs")
    except metadata.PackageNotFoundError:
        pass
    try:
        from hostkv_rs import _core

        return _core.__version__
    except ImportError:
        return "unknown (neither installed nor built)"


class _VersionAction(argparse.Action):
    """--version, looked up only when asked (importlib.metadata is not free)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, **kw):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{PROG} {package_version()}")
        parser.exit()


def _lower(text: str) -> str:
    return text.lower()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="{demo,bench,info,launch-sglang}")

    demo = sub.add_parser(
        "demo",
        help="round-trip random KV pages through a host pool and verify every byte",
        description="Back up random device KV pages to a host pool, wipe the device pool, reload "
        "every layer into different device pages, and verify every byte.",
        epilog=_DEMO_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--preset", choices=sorted(PRESETS), default="llama-3.1-8b", help="model geometry"
    )
    demo.add_argument(
        "--layout",
        choices=LAYOUTS,
        metavar="LAYOUT",
        help=f"host layout: {', '.join(LAYOUTS)} "
        "(default: the preset's, layer_first or page_first for mimo-v2)",
    )
    demo.add_argument(
        "--backend",
        choices=BACKENDS,
        metavar="BACKEND",
        help="io backend: kernel or direct (default: the preset's, kernel)",
    )
    geo = demo.add_argument_group("geometry overrides")
    geo.add_argument("--layers", type=positive_int, help="number of layers")
    geo.add_argument("--heads", type=positive_int, help="KV heads (MHA presets)")
    geo.add_argument("--head-dim", type=positive_int, help="K head dim (MHA presets)")
    geo.add_argument(
        "--v-head-dim", type=positive_int, help="V head dim (MHA; != head dim = asymmetric pool)"
    )
    geo.add_argument("--kv-lora-rank", type=positive_int, help="latent width (MLA preset)")
    geo.add_argument("--qk-rope-head-dim", type=int, help="rope width (MLA preset)")
    geo.add_argument(
        "--dtype",
        type=_lower,
        choices=tuple(DTYPES),
        metavar="DTYPE",
        help=f"{', '.join(DTYPES)} (default: the preset's, bf16)",
    )
    geo.add_argument(
        "--page-size",
        type=positive_int,
        default=DEMO_PAGE_SIZE,
        help=f"tokens per page (default {DEMO_PAGE_SIZE})",
    )
    geo.add_argument(
        "--pages",
        type=positive_int,
        default=DEMO_PAGES,
        help=f"usable device pages (default {DEMO_PAGES}); half are backed up",
    )
    demo.add_argument(
        "--host-ratio",
        type=float,
        default=2.0,
        help="host pool size over device pool size (SGLang --hicache-ratio, default 2.0)",
    )
    demo.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="device pool placement"
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    l3 = demo.add_argument_group("L3 store (the mooncake extra)")
    l3.add_argument(
        "--l3",
        choices=("mooncake",),
        help="also save the backed-up pages to a Mooncake Store and load them into a second host "
        "pool (another client), with GB/s, verifying every byte",
    )
    l3.add_argument(
        "--l3-master",
        metavar="HOST:PORT",
        help="a running mooncake_master (default: start one on loopback for the demo)",
    )
    l3.add_argument(
        "--l3-metadata",
        metavar="URL",
        help="its metadata server (default: the master's embedded http://HOST:8080/metadata)",
    )

    bench = sub.add_parser(
        "bench",
        help="GB/s and us/call vs torch indexing and vs one contiguous copy",
        description="Benchmark the host pools: layouts x backends x item sizes x page counts.",
        epilog=_BENCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "--quick", action="store_true", help="small matrix, under a minute on 2 CPU cores"
    )
    bench.add_argument(
        "--json", action="store_true", help="print one JSON object (only JSON on stdout)"
    )
    bench.add_argument(
        "--runs",
        type=positive_int,
        default=1,
        help="run the whole matrix N times and keep each number's best run (for busy machines)",
    )
    bench.add_argument(
        "--markdown", action="store_true", help="print the tables as Markdown instead"
    )
    bench.add_argument("--plot", metavar="OUT.png", help="bar chart of the largest transfers")
    bench.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="device pool placement"
    )
    bench.add_argument(
        "--page-size",
        type=positive_int,
        help="tokens per page (default 64; 16 with the test matrix)",
    )
    bench.add_argument("--layers", type=positive_int, help="layers per pool (default 8)")
    bench.add_argument(
        "--no-progress", action="store_true", help="no progress bar (it is off when not a TTY)"
    )
    # For tests on busy machines; --quick stays the real quick matrix.
    bench.add_argument("--max-seconds", type=float, default=float("inf"), help=argparse.SUPPRESS)
    bench.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)

    sub.add_parser(
        "info",
        help="CUDA, hugepages, NUMA, pinned-memory limit, memory",
        description="What this machine offers the host pools, read from /sys, getrlimit, psutil "
        "and the Rust core. Allocates nothing.",
    )
    launch = sub.add_parser(
        "launch-sglang",
        help="run python -m sglang.launch_server with hostkv_rs pools in every process",
        description="Runs `python -m sglang.launch_server ARGS` with HOSTKV_RS_SGLANG=1 and "
        "hostkv_rs's start-up hook on PYTHONPATH, so every process the server starts (its "
        "schedulers are spawned interpreters) builds hostkv_rs host pools through SGLang's own "
        "construction sites. Each such process logs one 'hostkv_rs[PID]: serving SGLang ...' "
        "line. Without this command (or that environment) SGLang is untouched.",
    )
    launch.add_argument(
        "sglang_args", nargs=argparse.REMAINDER, help="arguments for sglang.launch_server"
    )
    return parser


def cmd_launch_sglang(args) -> int:
    import importlib.util
    import os

    from hostkv_rs.launch import launch_env

    if importlib.util.find_spec("sglang") is None:
        print(
            "hostkv-rs launch-sglang: SGLang is not installed in this interpreter "
            f"({sys.executable}); pip install sglang",
            file=sys.stderr,
        )
        return 2
    rest = list(args.sglang_args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    cmd = [sys.executable, "-m", "sglang.launch_server", *rest]
    os.execve(sys.executable, cmd, launch_env())
    return 0  # not reached


def _resolve_device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch.cuda.is_available() is False on this machine")
    return choice


def _fail(command: str, exc: BaseException) -> int:
    print(f"{PROG} {command}: error: {exc}", file=sys.stderr)
    return 2


def check_pair(preset, layout: str, backend: str) -> None:
    """Refuse a (layout, backend) pair the preset's pool kind does not serve, naming the pair and
    the ones it does serve (the pool itself would only say "Unsupported layout: ...", and only
    after the device pool is allocated)."""
    from hostkv_rs import _core

    pairs = _core.supported_pairs(_CORE_KINDS[preset.kind])
    if (layout, backend) in pairs:
        return
    served = ", ".join(f"{lay}+{io}" for lay, io in pairs)
    raise ValueError(
        f"--layout {layout} with --backend {backend} is not a supported (layout, backend) pair "
        f"for the {_KIND_NAMES[preset.kind]} host pool of {preset.name}; supported pairs: "
        f"{served}"
    )


def cmd_demo(args) -> int:
    from hostkv_rs.tools.demo import DemoConfig, run_demo
    from hostkv_rs.tools.presets import get_preset

    try:
        # Every choice is checked, cheapest first, before anything is allocated.
        preset = get_preset(args.preset).with_overrides(
            layers=args.layers,
            heads=args.heads,
            head_dim=args.head_dim,
            v_head_dim=args.v_head_dim,
            kv_lora_rank=args.kv_lora_rank,
            qk_rope_head_dim=args.qk_rope_head_dim,
            dtype=args.dtype,
        )
        layout = args.layout or preset.layout
        backend = args.backend or preset.backend
        check_pair(preset, layout, backend)
        if not -(2**63) <= args.seed < 2**64:
            raise ValueError(f"--seed must be a 64-bit integer, got {args.seed}")
        if not args.host_ratio >= 0 or args.host_ratio == float("inf"):
            raise ValueError(f"--host-ratio must be a finite number >= 0, got {args.host_ratio}")
        cfg = DemoConfig(
            preset=preset,
            page_size=args.page_size,
            pages=args.pages,
            layout=layout,
            backend=backend,
            device=_resolve_device(args.device),
            host_ratio=args.host_ratio,
            seed=args.seed,
            l3=args.l3,
            l3_master=args.l3_master,
            l3_metadata=args.l3_metadata,
            size_note=(
                " (small demo default; --pages/--page-size for more)"
                if args.pages == DEMO_PAGES and args.page_size == DEMO_PAGE_SIZE
                else ""
            ),
        )
        result = run_demo(cfg)  # checks the memory it needs before allocating
    except (ValueError, TypeError, NotImplementedError, RuntimeError, ImportError) as exc:
        # ValueError covers the pools' own texts and TransferError; RuntimeError the L3 store's
        # (L3Error, MasterError); ImportError: --l3 mooncake without the mooncake extra
        return _fail("demo", exc)
    return 0 if result.ok else 1


def cmd_bench(args) -> int:
    from hostkv_rs.tools import bench, bench_report

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _fail(
                "bench",
                "--plot needs matplotlib, which is not installed here "
                "(pip install matplotlib); nothing was measured",
            )
    matrix = bench.TINY if args.tiny else bench.QUICK if args.quick else bench.FULL
    overrides = {"page_size": args.page_size, "layers": args.layers}
    matrix = dataclasses.replace(matrix, **{k: v for k, v in overrides.items() if v is not None})
    progress = sys.stderr.isatty() and not args.json and not args.no_progress
    try:
        device = _resolve_device(args.device)
        # In --json mode stdout carries the JSON object alone; anything else printed on the way
        # goes to stderr.
        quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
        with quiet:
            report = bench.run_many(
                matrix, args.runs, device=device, max_seconds=args.max_seconds, progress=progress
            )
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as exc:
        return _fail("bench", exc)
    report["command"] = " ".join([PROG, *args.argv])
    if args.json:
        bench_report.emit_json(report)
    elif args.markdown:
        print(bench_report.format_markdown(report))
    else:
        print(bench_report.format_table(report))
    if args.plot:
        bench_report.plot(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


SYS_HUGEPAGES = "/sys/kernel/mm/hugepages"
SYS_NODES = "/sys/devices/system/node"
SYS_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _kib_text(kib: int) -> str:
    from hostkv_rs.tools.bench_report import size_text

    return size_text(kib * 1024)


def hugepages(root: str | None = None) -> list[tuple[int, int | None, int | None]] | None:
    """(page size in KiB, nr_hugepages, free_hugepages) per hugepage size the kernel offers;
    None when `root` cannot be read."""
    root = root or SYS_HUGEPAGES
    try:
        names = os.listdir(root)
    except OSError:
        return None
    out = []
    for name in names:
        if not (name.startswith("hugepages-") and name.endswith("kB")):
            continue
        try:
            kib = int(name[len("hugepages-") : -len("kB")])
        except ValueError:
            continue
        counts = []
        for leaf in ("nr_hugepages", "free_hugepages"):
            text = _read(os.path.join(root, name, leaf))
            counts.append(int(text) if text is not None and text.isdigit() else None)
        out.append((kib, counts[0], counts[1]))
    return sorted(out)


def numa_nodes(root: str | None = None) -> list[tuple[int, str | None, int | None]] | None:
    """(node, cpu list, memory in KiB) per NUMA node; None when `root` cannot be read."""
    root = root or SYS_NODES
    try:
        names = os.listdir(root)
    except OSError:
        return None
    out = []
    for name in names:
        if not (name.startswith("node") and name[4:].isdigit()):
            continue
        cpus = _read(os.path.join(root, name, "cpulist"))
        mem = None
        for line in (_read(os.path.join(root, name, "meminfo")) or "").splitlines():
            parts = line.split()  # "Node 0 MemTotal:  32594460 kB"
            if len(parts) >= 4 and parts[2] == "MemTotal:" and parts[3].isdigit():
                mem = int(parts[3])
        out.append((int(name[4:]), cpus, mem))
    return sorted(out)


def thp_mode(path: str | None = None) -> str | None:
    """The bracketed choice of transparent_hugepage/enabled ("always", "madvise", "never")."""
    text = _read(path or SYS_THP)
    if text is None:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return text


def _limit_text(value: int) -> str:
    import resource

    if value == resource.RLIM_INFINITY:
        return "unlimited"
    from hostkv_rs.tools.bench_report import size_text

    return size_text(value)


def memlock_text() -> str:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    text = f"ulimit -l {_limit_text(soft)}"
    if hard != soft:
        text += f" (hard limit {_limit_text(hard)})"
    if soft != resource.RLIM_INFINITY:
        # say what it governs: "pinned" suggests cudaHostRegister, which the NVIDIA driver does
        # not charge to this limit
        text += (
            " (RLIMIT_MEMLOCK caps mlock()ed and RDMA-registered memory, e.g. Mooncake over "
            "RDMA; `ulimit -l unlimited` or docker's --ulimit memlock=-1 lifts it)"
        )
    return text


def info_lines() -> list[str]:
    """What `hostkv-rs info` prints: read-only probes, each line saying `unknown` rather than
    failing when its source is missing (containers often hide /sys parts)."""
    from hostkv_rs import _core

    lines = [f"{PROG} {package_version()}"]
    lines.append(f"  core         : {_core.runtime_info()}")
    cuda = "driver found" if _core.cuda_available() else "no usable CUDA driver"
    try:
        import torch

        cuda += (
            f"; torch {torch.__version__}, torch.cuda.is_available() {torch.cuda.is_available()}"
        )
    except ImportError as exc:
        cuda += f"; torch not importable ({exc})"
    lines.append(f"  cuda         : {cuda}")
    sizes = hugepages()
    if sizes == []:
        hp = "none offered by this kernel"
    elif sizes:
        parts = []
        for kib, total, free in sizes:
            total_s = "?" if total is None else str(total)
            free_s = "?" if free is None else str(free)
            parts.append(f"{_kib_text(kib)}: {total_s} total, {free_s} free")
        hp = "; ".join(parts) + "  (nr_hugepages / free_hugepages)"
    else:
        hp = f"unknown ({SYS_HUGEPAGES} not readable)"
    lines.append(f"  hugepages    : {hp}")
    thp = thp_mode()
    thp_text = f"[{thp}]" if thp is not None else f"unknown ({SYS_THP} not readable)"
    lines.append(f"  THP          : transparent hugepages {thp_text}")
    nodes = numa_nodes()
    if nodes == []:
        lines.append(f"  NUMA         : no node directories in {SYS_NODES}")
    elif nodes:
        desc = ", ".join(
            f"node{n} (cpus {cpus or '?'}, {_kib_text(mem) if mem is not None else '? memory'})"
            for n, cpus, mem in nodes
        )
        lines.append(f"  NUMA         : {len(nodes)} node{'s' if len(nodes) != 1 else ''}: {desc}")
    else:
        lines.append(f"  NUMA         : unknown ({SYS_NODES} not readable)")
    lines.append(f"  pinned limit : {memlock_text()}")
    lines.append(f"  host memory  : {memory_text()}")
    return lines


def memory_text() -> str:
    import psutil

    from hostkv_rs.sglang.budgets import HICACHE_HOST_MEMORY_RESERVE_BYTES as reserve
    from hostkv_rs.tools.demo import available_memory

    available, source = available_memory()
    usable = max(available - reserve, 0)
    return (
        f"{available / 1e9:.1f} GB available ({source}) of {psutil.virtual_memory().total / 1e9:.1f}"
        f" GB; host pools keep {reserve / 2**30:.0f} GiB in reserve (SGLang's HiCache rule), "
        f"leaving {usable / 1e9:.1f} GB"
    )


def cmd_info(_args) -> int:
    try:
        lines = info_lines()
    except ImportError as exc:
        name = exc.name or ""
        what = "the Rust extension" if name.startswith("hostkv_rs") else f"module {name!r}"
        return _fail("info", f"{what} is not importable: {exc}")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch-sglang"] and argv[1:2] not in ([], ["--"], ["-h"], ["--help"]):
        # SGLang's own options (--model-path ...) would read as unknown options of ours.
        argv = ["launch-sglang", "--", *argv[1:]]
    args = parser.parse_args(argv)
    args.argv = argv
    if args.command is None:
        parser.print_help()
        return 2
    handler = {
        "demo": cmd_demo,
        "bench": cmd_bench,
        "info": cmd_info,
        "launch-sglang": cmd_launch_sglang,
    }[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
