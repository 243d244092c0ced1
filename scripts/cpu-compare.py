#!/usr/bin/env python3
"""Summarise interleaved ladder runs of two binaries (scripts/measure-cpu.sh writes them):
per stage, the median over rounds of each run's median ms and the ratio old/new; per part of
--breakdown, the same; and for the new binary, stage 3's % of the measured GEMM ceiling and the
attention part's GFLOP/s against the probe's GEMM rates (issue 22's targets).

    scripts/cpu-compare.py DIR OLD_NAME NEW_NAME    # DIR/NAME.ROUND.json
"""
import glob, json, statistics, sys

d, old, new = sys.argv[1], sys.argv[2], sys.argv[3]
runs = {n: [json.load(open(f)) for f in sorted(glob.glob(f"{d}/{n}.*.json"))] for n in (old, new)}
med = statistics.median

def stage_ms(n, stage):
    return [rec["timing"]["median_ms"] for r in runs[n] for rec in r["records"] if rec["stage"] == stage]

def part_ms(n, stage, part):
    return [p["median_ms"] for r in runs[n] for rec in r["records"] if rec["stage"] == stage
            for p in (rec.get("breakdown") or {}).get("parts", []) if p["name"] == part]

stages = [rec["stage"] for rec in runs[new][0]["records"]]
print(f"{len(runs[old])} rounds of {old}, {len(runs[new])} of {new}; medians of each run's median (ms)")
for s in stages:
    a, b = stage_ms(old, s), stage_ms(new, s)
    if a and b:
        print(f"  {s:<18} {old} {med(a):8.1f} {[round(x) for x in a]}   {new} {med(b):8.1f} {[round(x) for x in b]}   {old}/{new} = {med(a)/med(b):.2f}x")
    parts = [p["name"] for p in (runs[new][0]["records"][stages.index(s)].get("breakdown") or {}).get("parts", [])]
    for p in parts:
        a, b = part_ms(old, s, p), part_ms(new, s, p)
        if a and b:
            print(f"      {p:<20} {med(a):8.1f} -> {med(b):8.1f}  ({med(a)/med(b):.2f}x)")
shape = runs[new][0]["shape"]
B, T, C = shape["batch"], shape["seq"], shape["d_model"]
attn_flops = 2 * B * T * T * C  # causal: half of QK^T plus PV
for r in runs[new]:
    c = r.get("ceiling") or {}
    rates = {g["name"]: g["gflops"] for g in c.get("gemms", [])}
    s3 = next((rec for rec in r["records"] if rec["stage"] == "stage3_fused"), None)
    if not s3:
        continue
    att = [p["median_ms"] for p in (s3.get("breakdown") or {}).get("parts", []) if p["name"] == "attention"]
    line = f"  {new}: stage 3 {s3['timing']['median_ms']:.0f} ms = {s3.get('pct_of_peak') or 0:.1f}% of the measured ceiling ({c.get('gemm_gflops', 0):.0f} GFLOP/s)"
    if att and rates:
        g = attn_flops / (att[0] / 1e3) / 1e9
        lin = [rates[n] for n in ("qkv", "proj", "fc1", "fc2") if n in rates]
        line += (f"; attention part {att[0]:.1f} ms = {g:.0f} GFLOP/s = {100 * g / (sum(lin) / len(lin)):.0f}% of the linears' mean rate"
                 + (f", {100 * g / ((rates['attn_qk'] + rates['attn_pv']) / 2):.0f}% of the attention shapes' mean rate" if "attn_qk" in rates else ""))
    print(line)
