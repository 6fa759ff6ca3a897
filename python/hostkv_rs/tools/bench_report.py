"""`hostkv-rs bench` output: the terminal table, the markdown table of docs/benchmarks.md, the
JSON report and the plot."""

from __future__ import annotations

import json
import sys


def size_text(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


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
        f"{'us/call':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        lines.append(
            f"{r['pool']:<5} {r['layout']:<18} {r['backend']:<7} {r['op']:<6} "
            f"{size_text(r['item_bytes']):>8} {r['pages']:>5} {size_text(r['bytes']):>9} "
            f"{r['gbps']:7.2f} {r['torch_gbps']:7.2f} {r['gbps'] / r['torch_gbps']:7.2f} "
            f"{r['memcpy_gbps']:7.2f} {r['gbps'] / r['memcpy_gbps']:6.2f} {r['us_per_call']:9.1f}"
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
                other = f"memcpy {f['memcpy_gbps']:.2f} GB/s (x{f['gbps'] / f['memcpy_gbps']:.2f})"
            line = f"  {f['what']:<44} {size_text(f['bytes']):>9} {f['gbps']:7.2f} GB/s  vs {other}"
            if f["what"].startswith("PoolCore."):
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
            "GB/s: decimal GB per second of payload. backup = all layers in one call; load = one "
            "layer per call; alloc = host pool creation incl. pre-touch (memcpy column: fill of "
            "already faulted memory). x torch / x copy: pool GB/s over plain torch indexing / one "
            "contiguous copy of the same bytes."
        ),
    ]
    if report.get("runs", 1) > 1:
        lines.append(
            f"(each number: the best of {report['runs']} runs of the whole matrix, each run "
            "taking the median of its repeats)"
        )
    if report.get("truncated"):
        lines.append("(stopped early: --max-seconds reached)")
    return "\n".join(lines)


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
            f"| {r['gbps'] / r['memcpy_gbps']:.2f} | {r['us_per_call']:.1f} |"
        )
    if report.get("foundation"):
        lines += [
            "",
            "| foundation | bytes | GB/s | yardstick | yardstick GB/s | ratio | us/call |",
            "|---|---:|---:|---|---:|---:|---:|",
        ]
        for f in report["foundation"]:
            name, other = (
                ("torch.empty().zero_()", f["torch_gbps"])
                if "torch_gbps" in f
                else ("one contiguous copy", f["memcpy_gbps"])
            )
            lines.append(
                f"| {f['what']} | {size_text(f['bytes'])} | {f['gbps']:.2f} | {name} | {other:.2f} "
                f"| {f['gbps'] / other:.2f} | {f['us_per_call']:.1f} |"
            )
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = ["backup", "load"]
    widest = max((sum(r["op"] == op for r in report["results"]) for op in ops), default=1)
    fig, axes = plt.subplots(
        len(ops), 1, figsize=(max(10, 1.05 * widest), 4.8 * len(ops)), squeeze=False
    )
    for ax, op in zip(axes[:, 0], ops, strict=True):
        rows = [r for r in report["results"] if r["op"] == op]
        if not rows:
            continue
        top = max(r["pages"] for r in rows)
        rows = [r for r in rows if r["pages"] == top]
        labels = [
            f"{r['pool']} {size_text(r['item_bytes'])}\n{r['layout']}\n{r['backend']}" for r in rows
        ]
        xs = range(len(rows))
        w = 0.27
        ax.bar([x - w for x in xs], [r["gbps"] for r in rows], w, label="hostkv_rs")
        ax.bar(list(xs), [r["torch_gbps"] for r in rows], w, label="torch indexing")
        ax.bar(
            [x + w for x in xs], [r["memcpy_gbps"] for r in rows], w, label="one contiguous copy"
        )
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("GB/s")
        ax.set_title(
            f"{op}: {top} pages of {report['matrix']['page_size']} tokens ({report['device']})"
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def emit_json(report: dict, stream=None) -> None:
    stream = stream or sys.stdout
    json.dump(report, stream, indent=1, allow_nan=False)
    stream.write("\n")
