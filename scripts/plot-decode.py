#!/usr/bin/env python3
"""Draws scripts/decode-matrix.sh's output as one PNG: graphep's latency-path dispatch (fp8, bf16)
and combine times against tokens per rank, one line per receive layout at one shape and SM budget,
with DeepEP's low-latency kernels at 128 tokens from the same call as points beside them.

usage: scripts/plot-decode.py [-o OUT.png] [--shape v3|h2048] [--sms N] [--title TEXT] MATRIX_LOG

MATRIX_LOG is what decode-matrix.sh printed (its table and its deepep-ll lines). Needs matplotlib.
"""
import argparse
import re
import sys


def parse(path):
    rows, deep, tokens = {}, {}, []
    for line in open(path):
        m = re.match(r"deepep-ll tokens=(\d+) hidden=(\d+) topk=\d+ experts=\d+ dispatch_fp8_us=(\S+) combine_bf16_us=(\S+)", line)
        if m:
            deep["v3" if m.group(2) == "7168" else "h2048"] = (int(m.group(1)), float(m.group(3)), float(m.group(4)))
            continue
        if line.startswith("shape "):
            tokens = [int(t) for t in line.split()[4:]]
            continue
        m = re.match(r"(\S+)\s+(\d+)\s+(\S+)\s+(dispatch fp8|dispatch bf16|combine bf16)\s+(.*)$", line)
        if m and tokens:
            vals = [None if v == "-" else float(v) for v in m.group(5).split()]
            rows[(m.group(1), int(m.group(2)), m.group(3), m.group(4))] = dict(zip(tokens, vals))
    return rows, deep


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", default="decode.png")
    ap.add_argument("--shape", default="v3")
    ap.add_argument("--sms", type=int, default=24)
    ap.add_argument("--title", default="")
    ap.add_argument("log")
    a = ap.parse_args()
    rows, deep = parse(a.log)
    if not rows:
        sys.exit("no rows in %s (decode-matrix.sh's output?)" % a.log)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    markers = {"expert-major": "o", "batched": "s", "rank-major": "^"}
    for ax, ops, deep_i, name in ((axes[0], ["dispatch fp8", "dispatch bf16"], 1, "dispatch"),
                                  (axes[1], ["combine bf16"], 2, "combine")):
        for (shape, sms, layout, op), series in sorted(rows.items()):
            if shape != a.shape or sms != a.sms or op not in ops:
                continue
            ts = [t for t in sorted(series) if series[t] is not None]
            ax.plot(ts, [series[t] for t in ts], marker=markers.get(layout, "."), ms=4,
                    ls="-" if op != "dispatch bf16" else "--", label="graphep %s, %s" % (op, layout))
        if a.shape in deep:
            t, d, c = deep[a.shape]
            ax.plot([t], [(d, c)[deep_i - 1]], "k*", ms=12,
                    label="DeepEP LL %s (kernel, same call)" % ("dispatch fp8" if deep_i == 1 else "combine bf16"))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("us per operation (graph replay)")
    fig.suptitle(a.title or "graphep latency path, %s, %d SMs" % (a.shape, a.sms))
    fig.tight_layout()
    fig.savefig(a.o, dpi=110)
    print("wrote", a.o)


if __name__ == "__main__":
    main()
