#!/usr/bin/env bash
# The CPU measurements of issues 15 and 22, in one session on one machine (run it on a quiet
# machine; every number depends on what else the CPU is doing). Prints each target's ratio.
#
#   scripts/measure-cpu.sh [BASELINE_LADDER]   # default /work/baseline/ladder-3e6dffd
#
# Issue 22's comparison (stages 2-3 with --breakdown, interleaved against commit 98cd396):
#   git worktree add ../base98 98cd396 && cp -a target ../base98/ && (cd ../base98 && cargo build --release -p ladder)
#   BREAKDOWN_BASE=../base98/target/release/ladder scripts/measure-cpu.sh
# prints per stage and per --breakdown part the old/new ratio (scripts/cpu-compare.py), stage 3's
# % of the measured ceiling and the attention part's GFLOP/s against the probe's GEMM rates.
#
# 1. stage 3 on `small`, default build, against the baseline binary (commit 3e6dffd), interleaved
# 2. the same with the MKL build (skipped when scripts/mkl.sh cannot install MKL)
# 3. stage 3's GFLOP/s against the measured GEMM ceiling (the ladder's own % column)
# 4. the block's GEMMs under MKL against MKL's own rate at the same shapes (candle's matmul vs
#    a direct cblas_sgemm is not separable here: both are MKL's sgemm, so the ceiling probe's
#    per-shape rate IS MKL's rate; the block's GEMMs are timed by --breakdown where available)
set -euo pipefail
cd "$(dirname "$0")/.."
base="${1:-/work/baseline/ladder-3e6dffd}"
rounds="${ROUNDS:-3}"
tmp="$(mktemp -d)"
lscpu | grep -E 'Model name|^CPU\(s\)' || true
grep -o -w -E 'avx512f|avx2|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo

cargo build --release -p ladder >/dev/null
cp target/release/ladder "$tmp/ladder-default"
if eval "$(scripts/mkl.sh)" 2>/dev/null; then
    CARGO_TARGET_DIR=target/mkl cargo build --release --features mkl -p ladder >/dev/null && cp target/mkl/release/ladder "$tmp/ladder-mkl"
fi

median() { python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["records"]; print(r[0]["timing"]["median_ms"], r[0].get("pct_of_peak"))' "$1"; }
for i in $(seq "$rounds"); do
    for bin in "$base" "$tmp/ladder-default" "$tmp/ladder-mkl"; do
        [ -x "$bin" ] || continue
        name="$(basename "$bin")"
        "$bin" --stages 3 --preset small --json "$tmp/$name.$i.json" >/dev/null
        echo "round $i  $name  stage3 median ms, % of peak: $(median "$tmp/$name.$i.json")"
    done
done
python3 - "$tmp" "$rounds" "$(basename "$base")" <<'PY'
import json, statistics, sys, os
tmp, rounds, base = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def ms(name):
    v = [json.load(open(f"{tmp}/{name}.{i}.json"))["records"][0]["timing"]["median_ms"] for i in range(1, rounds + 1) if os.path.exists(f"{tmp}/{name}.{i}.json")]
    return statistics.median(v) if v else None
b = ms(base)
for name in ["ladder-default", "ladder-mkl"]:
    m = ms(name)
    if m and b:
        r = json.load(open(f"{tmp}/{name}.1.json"))
        rec = r["records"][0]; c = r.get("ceiling") or {}
        print(f"{name}: stage 3 {m:.1f} ms vs baseline {b:.1f} ms -> {b/m:.2f}x faster; "
              f"{rec['tflops']*1e3:.1f} GFLOP/s = {rec.get('pct_of_peak') or 0:.1f}% of the measured GEMM ceiling "
              f"({c.get('gemm_gflops', 0):.1f} GFLOP/s, {c.get('gemm_backend')}, SIMD {c.get('simd')}); "
              f"per shape: " + ", ".join(f"{g['name']} {g['gflops']:.0f}" for g in c.get("gemms", [])))
PY
# Issue 22: stages 2-3 with --breakdown, interleaved with the BREAKDOWN_BASE binary (98cd396).
if [ -n "${BREAKDOWN_BASE:-}" ] && [ -x "$BREAKDOWN_BASE" ]; then
    cp "$BREAKDOWN_BASE" "$tmp/old"; cp "$tmp/ladder-default" "$tmp/new"; mkdir -p "$tmp/bd"
    uptime
    for i in $(seq "$rounds"); do
        for name in old new; do
            "$tmp/$name" --preset small --stages 2,3 --breakdown --json "$tmp/bd/$name.$i.json" >/dev/null
        done
    done
    uptime
    python3 scripts/cpu-compare.py "$tmp/bd" old new
fi
# The element-wise ablation: what shared::elementwise buys stage 2 (and what candle's ops cost).
"$tmp/ladder-default" --stages 2 --preset small --elementwise candle --json "$tmp/ew-candle.json" >/dev/null
"$tmp/ladder-default" --stages 2 --preset small --elementwise parallel --json "$tmp/ew-par.json" >/dev/null
echo "stage 2 --elementwise candle: $(median "$tmp/ew-candle.json") · parallel: $(median "$tmp/ew-par.json")"
rm -rf "$tmp"
