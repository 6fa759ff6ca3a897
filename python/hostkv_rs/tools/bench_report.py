"""`hostkv-rs bench` output: the terminal table, the markdown table of docs/benchmarks.md, the
JSON report and the plot."""

from __future__ import annotations

import json
import sys

# How much faster than its copy yardstick (per thread the pool may use) a transfer may measure
# before the yardstick counts as disturbed: timer noise on short calls, and a gather that happens
# to sit better in the caches than a copy of the same bytes.
YARDSTICK_SLACK = 1.25
NA = "n/a"
_NA_NOTE = (
    "n/a: yardstick inconsistent, no ratio: the contiguous copy of the same bytes measured slower "
    "than the pool could beat it ({slack}x per pool thread), so it was disturbed (other work on "
    "the machine); rerun, or use --runs 3."
)


def size_text(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def copy_ratio(row: dict) -> float | None:
    """Pool GB/s over the copy yardstick's, or None when the yardstick cannot be right: a single
    contiguous copy is at least as fast as the same bytes moved in pieces by as many threads, so
    a pool more than `copy_threads` x YARDSTICK_SLACK times faster means the copy was slowed by
    something else. Reports without `copy_threads` (older ones) count one thread."""
    copy = row.get("memcpy_gbps")
    if not copy:
        return None
    ratio = row["gbps"] / copy
    return None if ratio > YARDSTICK_SLACK * max(int(row.get("copy_threads", 1)), 1) else ratio


def nt_ratio(row: dict) -> float | None:
    """The pool over the streaming-store copy, median of the per-round ratios, or None without
    that yardstick or where it cannot be right (the same rule as `copy_ratio`)."""
    rounds = row.get("nt_ratio_rounds")
    if not rounds:
        return None
    ratio = rounds["median"]
    return None if ratio > YARDSTICK_SLACK * max(int(row.get("copy_threads", 1)), 1) else ratio


def _nt_text(row: dict) -> str:
    if not row.get("nt_ratio_rounds"):
        return "-"  # no streaming-store yardstick in this run (CUDA, or an older report)
    ratio = nt_ratio(row)
    return NA if ratio is None else f"{ratio:.2f}"


def _ratio_text(row: dict, fmt: str) -> str:
    ratio = copy_ratio(row)
    return NA if ratio is None else format(ratio, fmt)


def _any_na(report: dict) -> bool:
    rows = [*report.get("results", []), *report.get("foundation", [])]
    return any(
        ("memcpy_gbps" in r and copy_ratio(r) is None)
        or (r.get("nt_ratio_rounds") and nt_ratio(r) is None)
        for r in rows
    )


def _pool_row(report: dict, op: str, item: int) -> dict | None:
    for r in report["results"]:
        if (r["pool"], r["layout"], r["backend"], r["op"], r["pages"], r["item_bytes"]) == (
            "mha",
            "layer_first",
            "kernel",
            op,
            1,
            item,
        ):
            return r
    return None


def format_table(report: dict) -> str:
    head = (
        f"{'pool':<5} {'layout':<18} {'backend':<7} {'op':<6} {'item':>8} {'pages':>5} "
        f"{'bytes':>9} {'GB/s':>7} {'torch':>7} {'x torch':>7} {'memcpy':>7} {'x copy':>6} "
        f"{'x NT':>6} {'us/call':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        lines.append(
            f"{r['pool']:<5} {r['layout']:<18} {r['backend']:<7} {r['op']:<6} "
            f"{size_text(r['item_bytes']):>8} {r['pages']:>5} {size_text(r['bytes']):>9} "
            f"{r['gbps']:7.2f} {r['torch_gbps']:7.2f} {r['gbps'] / r['torch_gbps']:7.2f} "
            f"{r['memcpy_gbps']:7.2f} {_ratio_text(r, '6.2f'):>6} {_nt_text(r):>6} "
            f"{r['us_per_call']:9.1f}"
        )
    if report.get("foundation"):
        lines += ["", "foundation (no pool in between):"]
        for f in report["foundation"]:
            if "torch_gbps" in f:
                other = (
                    f"torch.empty().zero_() {f['torch_gbps']:.2f} GB/s "
                    f"(x{f['gbps'] / f['torch_gbps']:.2f})"
                )
            else:
                ratio = copy_ratio(f)
                other = f"one-thread copy {f['memcpy_gbps']:.2f} GB/s " + (
                    f"(x{ratio:.2f})" if ratio is not None else f"({NA})"
                )
            line = f"  {f['what']:<44} {size_text(f['bytes']):>9} {f['gbps']:7.2f} GB/s  vs {other}"
            if f["what"].startswith("HostPool."):
                line += f"  {f['us_per_call']:.1f} us/call"
                pool = _pool_row(report, f["op"], f["item_bytes"])
                if pool is not None:
                    line += (
                        f"; the pool's own call: {pool['us_per_call']:.1f} us "
                        f"(+{pool['us_per_call'] - f['us_per_call']:.1f} us in Python)"
                    )
            lines.append(line)
    lines += [
        "",
        (
            "GB/s: decimal GB per second of payload, medians of interleaved calls. backup = all "
            "layers in one call; load = one layer per call; alloc = host pool creation incl. "
            "pre-touch (memcpy column: one thread filling already faulted memory). x torch / "
            "x copy: pool GB/s over plain torch indexing / one contiguous copy of the same bytes "
            f"({_yardstick(report)}; the pool may use several threads on 1 MiB and more, so "
            "x copy above 1 is possible there). x NT: the pool over one thread's copy of the same "
            "bytes with streaming stores (CPU runs), the median of the per-round ratios (each "
            "round times every variant back to back; the JSON rows carry min and median of both)."
        ),
    ]
    if _any_na(report):
        lines.append(_NA_NOTE.format(slack=YARDSTICK_SLACK))
    lines += [f"({note})" for note in report.get("notes", [])]
    if report.get("runs", 1) > 1:
        lines.append(
            f"(each number: the best of {report['runs']} runs of the whole matrix, each run "
            "taking the median of its repeats)"
        )
    if report.get("truncated"):
        lines.append("(stopped early: --max-seconds reached)")
    return "\n".join(lines)


def _yardstick(report: dict) -> str:
    rows = [r for r in report.get("results", []) if r.get("op") != "alloc"]
    names = {r.get("copy_yardstick") for r in rows} - {None}
    return ", ".join(sorted(names)) if names else "one contiguous copy"


def format_markdown(report: dict) -> str:
    """The same tables as Markdown, for docs/benchmarks.md."""
    lines = [
        (
            "| pool | layout | backend | op | item | pages | bytes | GB/s | torch GB/s | x torch "
            "| copy GB/s | x copy | us/call |"
        ),
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['pool']} | {r['layout']} | {r['backend']} | {r['op']} | {size_text(r['item_bytes'])} "
            f"| {r['pages']} | {size_text(r['bytes'])} | {r['gbps']:.2f} | {r['torch_gbps']:.2f} "
            f"| {r['gbps'] / r['torch_gbps']:.2f} | {r['memcpy_gbps']:.2f} "
            f"| {_ratio_text(r, '.2f')} | {r['us_per_call']:.1f} |"
        )
    if report.get("foundation"):
        lines += [
            "",
            "| foundation | bytes | GB/s | yardstick | yardstick GB/s | ratio | us/call |",
            "|---|---:|---:|---|---:|---:|---:|",
        ]
        for f in report["foundation"]:
            if "torch_gbps" in f:
                name, other = "torch.empty().zero_()", f["torch_gbps"]
                ratio = f"{f['gbps'] / other:.2f}"
            else:
                name, other = "one-thread contiguous copy", f["memcpy_gbps"]
                ratio = _ratio_text(f, ".2f")
            lines.append(
                f"| {f['what']} | {size_text(f['bytes'])} | {f['gbps']:.2f} | {name} | {other:.2f} "
                f"| {ratio} | {f['us_per_call']:.1f} |"
            )
    if _any_na(report):
        lines += ["", _NA_NOTE.format(slack=YARDSTICK_SLACK)]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Bars of the pool and of torch indexing per (pool, layout, backend) at the largest page
    count, the copy yardstick as a labelled line over each pair of bars (none where it is
    inconsistent), one panel per op."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in ("backup", "load") if any(r["op"] == op for r in report["results"])]
    if not ops:
        ops = ["backup"]
    groups = {
        op: [
            r
            for r in report["results"]
            if r["op"] == op
            and r["pages"] == max(x["pages"] for x in report["results"] if x["op"] == op)
        ]
        for op in ops
    }
    widest = max((len(rows) for rows in groups.values()), default=1)
    # ~0.8 inch per group keeps 9 pt rotated labels apart
    fig, axes = plt.subplots(
        len(ops), 1, figsize=(max(8.0, 0.8 * widest + 2.0), 5.2 * len(ops)), squeeze=False
    )
    for ax, op in zip(axes[:, 0], ops, strict=True):
        rows = groups[op]
        if not rows:
            ax.set_axis_off()
            continue
        xs = list(range(len(rows)))
        w = 0.38
        pool = ax.bar([x - w / 2 for x in xs], [r["gbps"] for r in rows], w, label="hostkv_rs")
        ax.bar([x + w / 2 for x in xs], [r["torch_gbps"] for r in rows], w, label="torch indexing")
        ax.bar_label(pool, fmt="%.1f", fontsize=8, padding=2)
        top = max(max(r["gbps"], r["torch_gbps"]) for r in rows)
        ceiling_label = f"one contiguous copy, same bytes ({_yardstick(report)})"
        for x, r in zip(xs, rows):
            if copy_ratio(r) is None:
                ax.annotate(
                    "copy n/a", (x, top * 1.02), ha="center", va="bottom", fontsize=8, color="0.3"
                )
                continue
            c = r["memcpy_gbps"]
            top = max(top, c)
            ax.hlines(c, x - w, x + w, colors="black", linewidth=2.5, label=ceiling_label)
            ceiling_label = "_nolegend_"
            ax.annotate(
                f"{c:.1f}",
                (x + w, c),
                xytext=(2, 0),
                textcoords="offset points",
                ha="left",
                va="center",
                fontsize=8,
            )
        ax.set_ylim(0, top * 1.18)
        labels = [
            f"{r['pool']} {size_text(r['item_bytes'])} {r['layout']}/{r['backend']}" for r in rows
        ]
        ax.set_xticks(xs, labels, fontsize=9, rotation=30, ha="right", rotation_mode="anchor")
        ax.tick_params(axis="y", labelsize=9)
        ax.set_ylabel("GB/s (decimal)", fontsize=10)
        pages = rows[0]["pages"]
        ax.set_title(
            f"{op}: {pages} pages of {report['matrix']['page_size']} tokens ({report['device']})",
            fontsize=11,
        )
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.legend(fontsize=9, loc="upper left", framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def emit_json(report: dict, stream=None) -> None:
    stream = stream or sys.stdout
    json.dump(report, stream, indent=1, allow_nan=False)
    stream.write("\n")
