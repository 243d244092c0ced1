#!/usr/bin/env python3
"""Every kernel of one process, summed by name, from Nsight Compute's CSV (`ncu --metrics
gpu__time_duration.sum --csv PROGRAM`, as gpu-check.sh's train-kernels step writes it): how much
GPU time a run's kernels take in all, set beside the time the program measured, tells whether a
step is bound by the GPU or by the host, and the names tell which kernels the time goes to.

    scripts/ncu-sum.py kernels-stage3.csv --what "stage 3's training step" --json kernel-sum.json

Lines that are not CSV (the program's own output, ncu's ==PROF== notes) are skipped.
Exit code: 0, or 2 for a usage error (a missing or empty file, no kernel row), before writing.
"""
import argparse
import csv
import json
import os
import sys
import tempfile

UNITS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}


def usage(msg):
    print(f"ncu-sum: {msg}", file=sys.stderr)
    sys.exit(2)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="ncu --csv output of one process")
    p.add_argument("--what", required=True, help="what the process ran, for the JSON")
    p.add_argument("--command", default="", help="the profiled command line, for the JSON")
    p.add_argument("--json", help="where to write the sum (optional)")
    p.add_argument("--top", type=int, default=15, help="kernels printed (default 15)")
    a = p.parse_args()
    if not os.path.isfile(a.csv):
        usage(f"{a.csv} is not a file. Fix: pass the CSV file ncu wrote.")
    with open(a.csv) as fh:
        rows = list(csv.reader(line for line in fh if line.startswith('"')))
    if len(rows) < 2:
        usage(f"{a.csv} holds no CSV rows from ncu. Fix: pass the output of ncu --csv --metrics gpu__time_duration.sum.")
    ix = {h: i for i, h in enumerate(rows[0])}
    missing = [h for h in ("Kernel Name", "Metric Name", "Metric Unit", "Metric Value") if h not in ix]
    if missing:
        usage(f"{a.csv} lacks the columns {missing}. Fix: pass the output of ncu --csv --metrics gpu__time_duration.sum.")
    kernels = {}
    for r in rows[1:]:
        if r[ix["Metric Name"]] != "gpu__time_duration.sum":
            continue
        unit = r[ix["Metric Unit"]]
        if unit not in UNITS:
            usage(f"{a.csv}: unknown time unit {unit!r}. Fix: this script reads {sorted(UNITS)}.")
        ms = float(r[ix["Metric Value"]].replace(",", "")) * UNITS[unit]
        k = kernels.setdefault(r[ix["Kernel Name"]], [0, 0.0])
        k[0] += 1
        k[1] += ms
    if not kernels:
        usage(f"no gpu__time_duration.sum rows in {a.csv}. Fix: pass the output of ncu --csv --metrics gpu__time_duration.sum.")
    total = sum(ms for _, ms in kernels.values())
    launches = sum(n for n, _ in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    print(f"ncu-sum: {a.what}: {total:.3f} ms in {launches} launches of {len(kernels)} kernels")
    for name, (n, ms) in ranked[: a.top]:
        print(f"ncu-sum:   {ms:9.3f} ms {100 * ms / total:5.1f} % {n:5} x {name[:90]}")
    if a.json:
        doc = {"schema": "candle-speedkit/kernel-sum/1", "what": a.what, "command": a.command,
               "timing": "Nsight Compute gpu__time_duration.sum per launch, summed", "total_ms": round(total, 4),
               "launches": launches, "kernels": [{"name": name, "launches": n, "ms": round(ms, 4)} for name, (n, ms) in ranked]}
        d = os.path.dirname(os.path.abspath(a.json))
        fd, tmp = tempfile.mkstemp(prefix=".ncu-sum.", dir=d)
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, a.json)
        print(f"ncu-sum: wrote {a.json}")


if __name__ == "__main__":
    main()
