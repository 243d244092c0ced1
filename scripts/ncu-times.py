#!/usr/bin/env python3
"""Our attention kernels' times from Nsight Compute's CSV (`ncu --metrics gpu__time_duration.sum
--csv`, as gpu-check.sh's attention-kernels step writes them) as one JSON: per kernel and launch
grid, the median of the launches' gpu__time_duration, the shape the grid stands for, and TFLOP/s.

    scripts/ncu-times.py --d-head 128 ncu-times-v2-bwd.csv ncu-times-v1.csv --json kernel-times.json

The grid tells the shape: v1's forward and the backward launch (T/64, n_head, B) blocks, v2's
forward (n_head, B, T/128); d_head, which no grid shows, comes from the flag. FLOPs, causal (half the T x T products): forward 4·B·n_head·T²·d_head / 2, backward 2.5x
that (five T x T products against two). Lines that are not CSV (the program's own output, ncu's
==PROF== notes) are skipped.
Exit code: 0, or 2 for a usage error (a missing or empty file, no kernel row), before writing.
"""
import argparse
import csv
import json
import os
import re
import statistics
import sys
import tempfile

# Rows of Q per block: v1 (flash_attn_fwd_*) and the backward 64, v2 (flash_attn_v2_fwd_*) 128
# (stage2_sdpa/src/attention_cuda.rs: BR, BR_V2).
def rows_per_block(name):
    return 128 if name.startswith("flash_attn_v2_fwd") else 64


def usage(msg):
    print(f"ncu-times: {msg}", file=sys.stderr)
    sys.exit(2)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="+", help="ncu --csv output files")
    p.add_argument("--d-head", type=int, required=True)
    p.add_argument("--json", help="where to write the table (optional)")
    a = p.parse_args()
    times = {}
    for path in a.csv:
        if not os.path.isfile(path):
            usage(f"{path} is not a file. Fix: pass the CSV files ncu wrote.")
        with open(path) as fh:
            rows = list(csv.reader(line for line in fh if line.startswith('"')))
        if len(rows) < 2:
            usage(f"{path} holds no CSV rows from ncu. Fix: pass the output of ncu --csv --metrics gpu__time_duration.sum.")
        ix = {h: i for i, h in enumerate(rows[0])}
        for r in rows[1:]:
            if r[ix["Metric Name"]] != "gpu__time_duration.sum":
                continue
            scale = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "nsecond": 1e-6}[r[ix["Metric Unit"]]]
            grid = tuple(int(g) for g in re.findall(r"\d+", r[ix["Grid Size"]]))
            times.setdefault((r[ix["Kernel Name"]], grid), []).append(float(r[ix["Metric Value"]].replace(",", "")) * scale)
    if not times:
        usage("no gpu__time_duration.sum rows in the files. Fix: pass the output of ncu --csv --metrics gpu__time_duration.sum.")
    out = []
    for (name, grid), ms in sorted(times.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        # (tiles, n_head, B), or v2's (n_head, B, tiles)
        tiles, heads, batch = (grid[2], grid[0], grid[1]) if name.startswith("flash_attn_v2_fwd") else grid
        t = tiles * rows_per_block(name)
        fwd = 4 * batch * heads * t * t * a.d_head / 2
        flops = 2.5 * fwd if "_bwd_" in name else fwd
        med = statistics.median(ms)
        out.append({"kernel": name, "grid": list(grid), "batch": batch, "n_head": heads, "seq": t, "d_head": a.d_head,
                    "launches": len(ms), "median_ms": med, "min_ms": min(ms), "max_ms": max(ms), "tflops": flops / med / 1e9})
        print(f"ncu-times: {name:32} B {batch} T {t:5}: {med:9.3f} ms over {len(ms)} launches, {flops / med / 1e9:6.1f} TFLOP/s")
    if a.json:
        doc = {"schema": "candle-speedkit/ncu-times/1", "source": [os.path.basename(c) for c in a.csv],
               "timing": "Nsight Compute gpu__time_duration.sum per launch (--clock-control none), median over launches",
               "flops": "causal: forward 4*B*n_head*T^2*d_head/2, backward 2.5x", "rows": out}
        d = os.path.dirname(os.path.abspath(a.json))
        fd, tmp = tempfile.mkstemp(prefix=".ncu-times.", dir=d)
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, a.json)
        print(f"ncu-times: wrote {a.json}")


if __name__ == "__main__":
    main()
