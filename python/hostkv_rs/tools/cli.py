"""The `hostkv-rs` command (also `python -m hostkv_rs`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys

from hostkv_rs.tools.presets import PRESETS

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
  info   show what the Rust core found (CUDA driver, hugepages, ...)
"""

_DEMO_EPILOG = f"""\
presets:
{chr(10).join(f"  {name:<14} {p.describe()}" for name, p in PRESETS.items())}

The demo keeps the model's layer count and item sizes but only {DEMO_PAGES} device pages of
{DEMO_PAGE_SIZE} tokens by default, so it finishes in seconds; raise --pages / --page-size for more.
Layout/backend pairs are checked by the host pool itself (SGLang's error text), e.g. kernel takes
layer_first, page_first, page_head; direct takes layer_first, page_first_direct; the asymmetric
pool (mimo-v2) takes only kernel+page_first and direct+page_first_direct.

examples:
  hostkv-rs demo
  hostkv-rs demo --preset deepseek-v3 --layout page_first_direct --backend direct
  hostkv-rs demo --preset mimo-v2 --pages 128 --page-size 64
  hostkv-rs demo --l3 mooncake     # + pages to and from a Mooncake Store (loopback master)
"""

_BENCH_EPILOG = """\
Every row is measured three ways in one run: the pool, plain torch indexing of the same buffers
(`host[h] = dev[d]` per layer and K/V, what a Python pool would do), and one contiguous
`dst.copy_(src)` of the same number of bytes (this machine's ceiling). Median of several repeats
after a warmup; CUDA runs are synchronised around every call.

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,bench,info}")

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
        help="host layout: layer_first, page_first, page_first_direct, page_head "
        "(default: the preset's, layer_first or page_first for mimo-v2)",
    )
    demo.add_argument(
        "--backend", help="io backend: kernel or direct (default: the preset's, kernel)"
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
    geo.add_argument("--dtype", help="bf16 (default), fp16, fp32, fp8, fp8_e5m2")
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
    l3 = demo.add_argument_group("L3 store (hostkv_rs[mooncake])")
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

    sub.add_parser("info", help="what the Rust core found on this machine")
    return parser


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


def cmd_demo(args) -> int:
    from hostkv_rs.tools.demo import DemoConfig, run_demo
    from hostkv_rs.tools.presets import get_preset

    try:
        preset = get_preset(args.preset).with_overrides(
            layers=args.layers,
            heads=args.heads,
            head_dim=args.head_dim,
            v_head_dim=args.v_head_dim,
            kv_lora_rank=args.kv_lora_rank,
            qk_rope_head_dim=args.qk_rope_head_dim,
            dtype=args.dtype,
        )
        cfg = DemoConfig(
            preset=preset,
            page_size=args.page_size,
            pages=args.pages,
            layout=args.layout or preset.layout,
            backend=args.backend or preset.backend,
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
        result = run_demo(cfg)
    except (ValueError, TypeError, NotImplementedError, RuntimeError, ImportError) as exc:
        # ValueError covers the pools' own texts ("Unsupported layout: ...") and TransferError;
        # ImportError: --l3 mooncake without the mooncake extra
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


def cmd_info(_args) -> int:
    try:
        from hostkv_rs import _core
    except ImportError as exc:
        return _fail("info", f"the Rust extension is not importable: {exc}")
    import torch

    print(f"torch {torch.__version__}, cuda available: {torch.cuda.is_available()}")
    print(f"core cuda available: {_core.cuda_available()}")
    print(_core.runtime_info())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.command is None:
        parser.print_help()
        return 2
    handler = {"demo": cmd_demo, "bench": cmd_bench, "info": cmd_info}[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
