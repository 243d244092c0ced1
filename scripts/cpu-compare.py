#!/usr/bin/env python3
"""Summarise interleaved ladder runs of two binaries (scripts/measure-cpu.sh writes them):
per stage, the median over rounds of each run's median ms and the ratio old/new; per part of
--breakdown, the same; and for the new binary, stage 3's % of the measured GEMM ceiling and the
attention part's GFLOP/s against the probe's GEMM rates.

    scripts/cpu-compare.py DIR OLD_NAME NEW_NAME    # reads DIR/NAME.ROUND.json (ladder --json)

Every run must have the same block shape (B, T, C, n_head, FF): a ratio between two shapes
measures the shape, not the code, so such runs are refused. Exit code: 0 on a comparison, 2 for
a usage error (arguments, a DIR without the runs), 1 for runs that cannot be compared (a JSON
that does not parse, a missing field, a median of 0 ms, different shapes).
"""
import glob
import json
import math
import os
import signal
import statistics
import sys

USAGE = "usage: scripts/cpu-compare.py DIR OLD_NAME NEW_NAME   (reads DIR/OLD_NAME.*.json and DIR/NEW_NAME.*.json)"


def fail(msg, code=1):
    print(f"cpu-compare: {msg}", file=sys.stderr)
    sys.exit(code)


def load_runs(d, name):
    files = sorted(glob.glob(os.path.join(glob.escape(d), f"{glob.escape(name)}.*.json")))
    if not files:
        fail(f"no runs named {name} in {d}: expected files {d}/{name}.1.json, {d}/{name}.2.json, ... "
             f"(ladder --json output, one per round). Fix: pass the folder and the names the runs were written "
             f"with (scripts/measure-cpu.sh writes old.N.json and new.N.json), or run them first.", 2)
    runs = []
    for f in files:
        try:
            with open(f) as fh:
                r = json.load(fh)
        except json.JSONDecodeError as e:
            fail(f"{f} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): the run that wrote it "
                 f"was probably cut short. Fix: rerun that round, or delete the file to compare the others.")
        except OSError as e:
            fail(f"cannot read {f} ({e.strerror}). Fix: check the file's permissions.")
        if not isinstance(r, dict) or not isinstance(r.get("records"), list) or not r["records"]:
            fail(f"{f} has no records: it is not a ladder --json output, or that run measured nothing. "
                 f"Fix: rerun that round, or delete the file.")
        for rec in r["records"]:
            try:
                ms = float(rec["timing"]["median_ms"])
                stage = rec["stage"]
            except (KeyError, TypeError, ValueError):
                fail(f"{f} has a record without stage or timing.median_ms: it is not a ladder --json output "
                     f"this script reads. Fix: compare JSON files written by `ladder --json`.")
            if not math.isfinite(ms) or ms <= 0:
                fail(f"{f}: {stage}'s median is {ms} ms, so no ratio with it means anything (a run that timed "
                     f"nothing, or a broken timer). Fix: rerun that round with --iters 1 or more, or delete the file.")
        if shape_of(r) is None:
            fail(f"{f} records no block shape (its `shape` field), so it cannot be checked against the other runs. "
                 f"Fix: compare JSON files written by `ladder --json`.")
        runs.append((f, r))
    return runs


def shape_of(r):
    s = r.get("shape") or (r.get("records") or [{}])[0].get("shape")
    if not isinstance(s, dict):
        return None
    try:
        return tuple(int(s[k]) for k in ("batch", "seq", "d_model", "n_head", "ff"))
    except (KeyError, TypeError, ValueError):
        return None


def shape_str(s):
    return "B={} T={} C={} n_head={} FF={}".format(*s)


def main(argv):
    if len(argv) == 2 and argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if len(argv) != 4:
        fail(f"expected 3 arguments, got {len(argv) - 1}. {USAGE}. Fix: pass the folder and the two run names, "
             f"e.g. scripts/cpu-compare.py results/cpu-epyc-attention-tile-gemm old new.", 2)
    d, old, new = argv[1], argv[2], argv[3]
    if not os.path.isdir(d):
        fail(f"{d} is not a folder. {USAGE}. Fix: pass the folder holding the runs' JSON files.", 2)
    loaded = {n: load_runs(d, n) for n in (old, new)}
    first_file, first = loaded[old][0]
    for n in (old, new):
        for f, r in loaded[n]:
            if shape_of(r) != shape_of(first):
                fail(f"the runs have different shapes: {first_file} is {shape_str(shape_of(first))}, {f} is "
                     f"{shape_str(shape_of(r))}. A ratio between them would measure the shape, not the code. "
                     f"Fix: run both binaries with the same --preset (or --batch/--seq/...), or compare only runs of one shape.")
    runs = {n: [r for _, r in loaded[n]] for n in (old, new)}
    compare(runs, old, new)
    return 0


def compare(runs, old, new):
    med = statistics.median

    def stage_ms(n, stage):
        return [rec["timing"]["median_ms"] for r in runs[n] for rec in r["records"] if rec["stage"] == stage]

    def part_ms(n, stage, part):
        return [p["median_ms"] for r in runs[n] for rec in r["records"] if rec["stage"] == stage
                for p in (rec.get("breakdown") or {}).get("parts", []) if p["name"] == part and p["median_ms"] > 0]

    stages = [rec["stage"] for rec in runs[new][0]["records"]]
    print(f"{len(runs[old])} rounds of {old}, {len(runs[new])} of {new}; medians of each run's median (ms); "
          f"shape {shape_str(shape_of(runs[new][0]))}")
    for s in stages:
        a, b = stage_ms(old, s), stage_ms(new, s)
        if a and b:
            print(f"  {s:<18} {old} {med(a):8.1f} {[round(x) for x in a]}   {new} {med(b):8.1f} {[round(x) for x in b]}   {old}/{new} = {med(a)/med(b):.2f}x")
        else:
            print(f"  {s:<18} not in {old}'s runs: no ratio")
        parts = [p["name"] for p in (runs[new][0]["records"][stages.index(s)].get("breakdown") or {}).get("parts", [])]
        for p in parts:
            a, b = part_ms(old, s, p), part_ms(new, s, p)
            if a and b:
                print(f"      {p:<20} {med(a):8.1f} -> {med(b):8.1f}  ({med(a)/med(b):.2f}x)")
    B, T, C, _, _ = shape_of(runs[new][0])
    attn_flops = 2 * B * T * T * C  # causal: half of QK^T plus PV
    for r in runs[new]:
        c = r.get("ceiling") or {}
        rates = {g["name"]: g["gflops"] for g in c.get("gemms", []) if g.get("gflops")}
        s3 = next((rec for rec in r["records"] if rec["stage"] == "stage3_fused"), None)
        if not s3:
            continue
        att = [p["median_ms"] for p in (s3.get("breakdown") or {}).get("parts", []) if p["name"] == "attention" and p["median_ms"] > 0]
        line = f"  {new}: stage 3 {s3['timing']['median_ms']:.0f} ms = {s3.get('pct_of_peak') or 0:.1f}% of the measured ceiling ({c.get('gemm_gflops', 0):.0f} GFLOP/s)"
        lin = [rates[n] for n in ("qkv", "proj", "fc1", "fc2") if n in rates]
        if att and lin:
            g = attn_flops / (att[0] / 1e3) / 1e9
            line += (f"; attention part {att[0]:.1f} ms = {g:.0f} GFLOP/s = {100 * g / (sum(lin) / len(lin)):.0f}% of the linears' mean rate"
                     + (f", {100 * g / ((rates['attn_qk'] + rates['attn_pv']) / 2):.0f}% of the attention shapes' mean rate" if "attn_qk" in rates and "attn_pv" in rates else ""))
        print(line)


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the output quietly
    sys.exit(main(sys.argv))
