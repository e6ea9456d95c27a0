#!/usr/bin/env python3
"""Warp-stall samples of Nsight Compute's SASS page, summed by source line.

    scripts/ncu_by_source.py SASS_CSV CUBIN...

SASS_CSV: `ncu -i REPORT --page source --csv --print-source sass` (one block per profiled kernel,
each opening with its "Kernel Name" row). CUBIN: the cubins that hold those kernels (`cuobjdump
-xelf all libgraphep.so`), built with -lineinfo; `nvdisasm -gi` (NVDISASM, else the one on the PATH)
gives each instruction's source line and the lines it is inlined at. For each kernel block: its
samples by stall reason, then the source lines with the most samples, two ways: the innermost line
(where the instruction comes from) and the call site in the kernel's own file nearest the kernel
(which phase of the kernel it belongs to; nvdisasm's inlining chains do not always reach that far,
and then the outermost line it gives), each with the distinct instructions executed there (the
code a cold SM has to fetch; NCU_TOP lines of each, 15 unless set). scripts/ncu-latency.sh runs it.
"""
import collections
import csv
import io
import os
import re
import subprocess
import sys

STALLS = ("barrier", "no_inst", "long_sb", "wait", "membar", "short_sb", "lg", "math", "branch_resolving")
FILE_LINE = re.compile(r'"([^"]+)", line (\d+)')


def short(path):
    for root in ("/kernels/", "/engine/", "/include/"):
        if root in path:
            return root[1:] + path.split(root, 1)[1]
    return os.path.basename(path)


def functions(cubins, nvdisasm):
    """{mangled name: {offset: [(file, line), ...] innermost first}} over every cubin."""
    out = {}
    for cubin in cubins:
        text = subprocess.run([nvdisasm, "-gi", cubin], check=True, capture_output=True, text=True).stdout
        name, lines, pending = None, None, []
        for row in text.splitlines():
            if row.startswith(".text."):
                name = row[len(".text."):].rstrip(":")
                lines = out.setdefault(name, {})
                continue
            if lines is None:
                continue
            if row.lstrip().startswith("//## File"):
                pending.append(row)
                continue
            m = re.match(r"\s+/\*([0-9a-f]{4,})\*/", row)
            if m and pending:
                # The most detailed of the comments before the instruction: its inlining chain.
                chain = max(pending, key=lambda c: c.count(" line "))
                lines[int(m.group(1), 16)] = [(short(f), int(n)) for f, n in FILE_LINE.findall(chain)]
                pending = []
            elif m and lines:
                lines[int(m.group(1), 16)] = lines[max(lines)]
    return out


def template_args(name):
    """The kernel name without its template arguments, and those arguments' top-level texts."""
    out, args, depth, cur = [], [], 0, ""
    for ch in name:
        if ch == "<":
            depth += 1
            if depth == 1:
                cur = ""
                continue
        elif ch == ">":
            depth -= 1
            if depth == 0:
                args.append(cur)
                continue
        if depth == 0:
            out.append(ch)
        elif depth == 1 and ch == ",":
            args.append(cur)
            cur = ""
        else:
            cur += ch
    return "".join(out), [a.strip() for a in args]


def arg_code(arg):
    """How a bool or integral (enum) template argument reads in an Itanium mangled name."""
    if arg in ("true", "false"):
        return "Lb1E" if arg == "true" else "Lb0E"
    m = re.fullmatch(r"(?:\([^()]*\))?\s*(-?\d+)[uUlL]*", arg)
    return f"E{m.group(1)}E" if m else None


def matching(funcs, kernel_name):
    """The mangled function whose name holds every identifier of the demangled kernel name (its
    template arguments apart: bools and integers, enums included, pick the instance)."""
    base, args = template_args(kernel_name.replace("(anonymous namespace)", ""))
    ids = [w for w in re.findall(r"[A-Za-z_]\w*", base.split("(")[0]) if w not in ("unnamed", "void")]
    hits = [f for f in funcs if all(f"{len(w)}{w}" in f for w in ids)]
    codes = [c for c in (arg_code(a) for a in args) if c]
    picked = [f for f in hits if all(c in f for c in codes)]
    hits = picked or hits
    return min(hits, key=len) if hits else None


def report(name, rows, lines):
    hdr, data = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    col = {h: i for i, h in enumerate(hdr)}
    num = lambda r, h: int(r[col[h]].replace(",", "") or 0) if h in col and r[col[h]] not in ("", "-") else 0
    base = int(data[0][0], 16)
    total = collections.Counter()
    inner, phase = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    chains = [lines.get(int(r[0], 16) - base, [("?", 0)]) if lines else [("?", 0)] for r in data]
    kfile = collections.Counter(c[-1][0] for c in chains).most_common(1)[0][0]  # the kernel's own file
    for r, chain in zip(data, chains):
        own = [c for c in chain if c[0] == kfile]
        # The call site nearest the kernel's body (the phase), or the one frame there is.
        where = own[-2] if len(own) >= 2 else (own[0] if own else chain[-1])
        executed = num(r, "Instructions Executed") > 0
        for key, agg in ((chain[0], inner), (where, phase)):
            agg[key]["samples"] += num(r, "# Samples")
            agg[key]["distinct"] += executed
            for s in STALLS:
                agg[key][s] += num(r, f"stall_{s}")
        total["samples"] += num(r, "# Samples")
        total["distinct"] += executed
        for s in STALLS:
            total[s] += num(r, f"stall_{s}")
    print(f"== {name}")
    print(f"   {total['samples']} samples, {total['distinct']} distinct instructions executed "
          f"({total['distinct'] * 16} B of code); by stall: " +
          ", ".join(f"{s} {total[s]} ({100.0 * total[s] / max(total['samples'], 1):.0f}%)" for s in STALLS if total[s]))
    for title, agg in (("innermost line", inner), ("call site in the kernel's file", phase)):
        print(f"   by {title}:")
        for key, c in sorted(agg.items(), key=lambda kv: -kv[1]["samples"])[:int(os.environ.get("NCU_TOP", "15"))]:
            if c["samples"] == 0:
                break
            print(f"     {key[0]}:{key[1]:<5} {c['samples']:6} samples {c['distinct']:5} instrs  " +
                  " ".join(f"{s}={c[s]}" for s in STALLS if c[s]))


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    funcs = functions(sys.argv[2:], os.environ.get("NVDISASM", "nvdisasm"))
    text = open(sys.argv[1]).read().splitlines()
    starts = [i for i, row in enumerate(text) if row.startswith('"Kernel Name"')] + [len(text)]
    for n, (a, b) in enumerate(zip(starts, starts[1:])):
        name = next(csv.reader([text[a]]))[1]
        fn = matching(funcs, name)
        print(f"-- kernel {n}: {name} ({'line information from ' + fn[:60] if fn else 'no cubin holds it: no lines'})")
        report(name, list(csv.reader(io.StringIO("\n".join(text[a + 1:b])))), funcs.get(fn))


if __name__ == "__main__":
    main()
