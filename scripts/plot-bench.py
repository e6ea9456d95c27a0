#!/usr/bin/env python3
"""Draws graphep-bench sweeps (--json output) as PNG plots.

usage: scripts/plot-bench.py [-o OUT_DIR] [--title TEXT] BENCH.json [BENCH.json ...]

For each operation in the files it writes OUT_DIR/bench_<op>_time.png, the time per operation
against the size column (bytes; tokens per rank for moe, bench/README.md), one line per variant
and one for the NCCL baseline measured in the same run, and, when the rows have an NCCL time,
OUT_DIR/bench_<op>_ratio.png, NCCL time / graphep time per variant (above 1: graphep faster).
Rows whose #wrong is not 0 are drawn as hollow markers and listed on stderr. Files of the same
operation share its plots, their lines labelled with the file's name.

A variant whose name ends in a channel count ("zero-copy ch=16") is one line whatever the count
(the adaptive channel count changes with the size); sendrecv's "LL ch=N" and "staged ch=N" rows
are its one staged variant, LL lines when small (bench/README.md), drawn as "LL/staged". A moe
variant is one line across paths ("dispatch bf16"), its points marked by the path the row ran
(circle: latency, square: throughput).

Needs matplotlib (pip install matplotlib). Example, after a GPU run:
  build/bench/graphep-bench sendrecv -b 1K -e 1G -f 4 --json sendrecv.json
  scripts/plot-bench.py -o docs/plots --title "2x H200, commit abc1234" sendrecv.json
"""
import argparse
import json
import math
import os
import re
import sys
from collections import OrderedDict

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

ROW_KEYS = ("op", "variant", "bytes", "time_us", "wrong", "nccl_us")
CHANNEL_SUFFIX = re.compile(r" ch=\d+$")
MOE_PATH_SUFFIX = re.compile(r" (latency|throughput)$")
PATH_MARKERS = {"latency": "o", "throughput": "s"}


class BenchFileError(Exception):
    """A --json file that is not graphep-bench output."""


def load(path):
    """The rows of one graphep-bench --json file, each checked for the fields the plots use."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise BenchFileError(f"{path}: {e}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise BenchFileError(f"{path}: no 'rows' list (not graphep-bench --json output)")
    for i, row in enumerate(doc["rows"]):
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise BenchFileError(f"{path}: row {i} lacks {', '.join(missing)}")
    return doc["rows"]


def line_name(op, variant):
    """The line a row belongs to and the marker of its point."""
    name = CHANNEL_SUFFIX.sub("", variant)
    if op == "sendrecv" and name in ("LL", "staged"):
        return "LL/staged", "o"
    path = MOE_PATH_SUFFIX.search(name) if op == "moe" else None
    if path:
        return name[: path.start()], PATH_MARKERS[path.group(1)]
    return name, "o"


def size_label(value, op):
    if op == "moe":
        return f"{value:g}"
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if value >= scale:
            return f"{value / scale:g}{unit}"
    return f"{value:g}"


def collect(files):
    """{op: {"lines": {label: [(size, time_us, ratio or None, wrong, marker)]}, "nccl": {label: {size: us}}}}."""
    ops = OrderedDict()
    files_of_op = {}
    loaded = [(path, load(path)) for path in files]
    for path, rows in loaded:
        for op in {row["op"] for row in rows}:
            files_of_op.setdefault(op, []).append(path)
    for path, rows in loaded:
        stem = os.path.splitext(os.path.basename(path))[0]
        for row in rows:
            op = row["op"]
            entry = ops.setdefault(op, {"lines": OrderedDict(), "nccl": {}})
            label, marker = line_name(op, row["variant"])
            if len(files_of_op[op]) > 1:
                label = f"{stem}: {label}"
            size, us, nccl = float(row["bytes"]), float(row["time_us"]), float(row["nccl_us"])
            ratio = nccl / us if nccl > 0 and us > 0 else None
            entry["lines"].setdefault(label, []).append((size, us, ratio, int(row["wrong"]), marker))
            if nccl > 0:
                nccl_label = f"{stem}: NCCL" if len(files_of_op[op]) > 1 else "NCCL"
                entry["nccl"].setdefault(nccl_label, {})[size] = nccl
    return ops


def draw(ax, points, label, style, wrong_rows):
    """points: (size, value, wrong, marker); a line in `style`, each point with its marker."""
    points = sorted(points)
    (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
    for marker in sorted({p[3] for p in points if p[3]}):
        mine = [p for p in points if p[3] == marker]
        ax.plot([p[0] for p in mine], [p[1] for p in mine], marker, color=line.get_color(), markersize=5)
    bad = [p for p in points if p[2] > 0]
    if bad:
        ax.plot([p[0] for p in bad], [p[1] for p in bad], "o", markersize=9, markerfacecolor="none",
                markeredgecolor=line.get_color())
        wrong_rows.extend(f"{label} at size {int(p[0])}: #wrong {p[2]}" for p in bad)


def setup_axes(ax, op, ylabel, title, markers):
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: size_label(v, op)))
    ax.set_xlabel("tokens per rank" if op == "moe" else "size (bytes)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.4)
    ax.grid(True, which="minor", alpha=0.15)
    handles, _ = ax.get_legend_handles_labels()
    if len(markers) > 1:  # the points' markers name the moe path
        handles += [Line2D([], [], marker=m, linestyle="none", color="gray", label=f"{path} path")
                    for path, m in PATH_MARKERS.items() if m in markers]
    ax.legend(handles=handles, fontsize=8)


def save(fig, out_dir, op, kind):
    """Writes the figure as OUT_DIR/bench_OP_KIND.png, closes it and returns the path."""
    path = os.path.join(out_dir, f"bench_{op}_{kind}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_op(op, entry, out_dir, title_prefix):
    """Writes the op's plots; returns their paths and the rows with wrong values."""
    written, wrong_rows = [], []
    title = f"{title_prefix} {op}".strip()

    markers = {p[4] for rows in entry["lines"].values() for p in rows}
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, rows in entry["lines"].items():
        draw(ax, [(s, us, w, m) for s, us, _, w, m in rows], label, "-", wrong_rows)
    for i, (label, by_size) in enumerate(entry["nccl"].items()):
        style = "k" + ("--", ":", "-.")[i % 3]  # the baseline: black, one dash pattern per file
        draw(ax, [(s, us, 0, None) for s, us in by_size.items()], label, style, wrong_rows)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    setup_axes(ax, op, "time per operation (us)", f"{title}: time", markers)
    written.append(save(fig, out_dir, op, "time"))

    if not entry["nccl"]:
        print(f"plot-bench: {op}: no NCCL time in these rows, no ratio plot", file=sys.stderr)
        return written, wrong_rows
    fig, ax = plt.subplots(figsize=(8, 5))
    ignored = []
    for label, rows in entry["lines"].items():
        points = [(s, r, w, m) for s, _, r, w, m in rows if r is not None]
        if points:
            draw(ax, points, label, "-", ignored)  # wrong rows are listed once, from the time plot
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label="NCCL (ratio 1)")
    top = max([p[2] for rows in entry["lines"].values() for p in rows if p[2] is not None] + [1.0])
    ax.set_ylim(0, math.ceil(top * 1.1 * 4) / 4)
    setup_axes(ax, op, "NCCL time / graphep time (> 1: graphep faster)", f"{title}: ratio to NCCL", markers)
    written.append(save(fig, out_dir, op, "ratio"))
    return written, wrong_rows


def main(argv):
    parser = argparse.ArgumentParser(description="Plot graphep-bench --json sweeps as PNG files.",
                                     usage="%(prog)s [-o OUT_DIR] [--title TEXT] BENCH.json [BENCH.json ...]")
    parser.add_argument("files", nargs="+", metavar="BENCH.json", help="graphep-bench --json outputs")
    parser.add_argument("-o", "--out-dir", default=".", help="where the PNG files go (default: .)")
    parser.add_argument("--title", default="graphep-bench", help="title prefix, e.g. the machine and commit")
    args = parser.parse_args(argv)
    try:
        ops = collect(args.files)
    except BenchFileError as e:
        print(f"plot-bench: {e}", file=sys.stderr)
        return 2
    if not ops:
        print("plot-bench: the files hold no rows", file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    for op, entry in ops.items():
        written, wrong_rows = plot_op(op, entry, args.out_dir, args.title)
        for line in wrong_rows:
            print(f"plot-bench: {op}: {line}", file=sys.stderr)
        for path in written:
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
