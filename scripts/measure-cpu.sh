#!/usr/bin/env bash
# The CPU measurements of docs/cpu.md, in one session on one machine (run it on a quiet
# machine; every number depends on what else the CPU is doing). Prints each target's ratio.
#
#   scripts/measure-cpu.sh [BASELINE_LADDER]   # default /work/baseline/ladder-3e6dffd
#   ROUNDS=N (default 3): interleaved rounds of each binary
#
# The --breakdown comparison of stages 2-3, interleaved against an older commit (98cd396):
#   git worktree add ../base98 98cd396 && cp -a target ../base98/ && (cd ../base98 && cargo build --release -p ladder)
#   BREAKDOWN_BASE=../base98/target/release/ladder scripts/measure-cpu.sh
# prints per stage and per --breakdown part the old/new ratio (scripts/cpu-compare.py), stage 3's
# % of the measured ceiling and the attention part's GFLOP/s against the probe's GEMM rates.
#
# 1. stage 3 on `small`, default build, against the baseline binary (commit 3e6dffd), interleaved
# 2. the same with the MKL build (skipped, with a line saying so, when scripts/mkl.sh cannot
#    install MKL)
# 3. stage 3's GFLOP/s against the measured GEMM ceiling (the ladder's own % column)
# 4. the block's GEMMs under MKL against MKL's own rate at the same shapes (candle's matmul vs
#    a direct cblas_sgemm is not separable here: both are MKL's sgemm, so the ceiling probe's
#    per-shape rate IS MKL's rate; the block's GEMMs are timed by --breakdown where available)
# Exit code: 0 when everything asked for was measured, 1 when a run failed, 2 for a usage error
# (a missing binary, ROUNDS not a positive count), found before anything is built.
set -euo pipefail

die() { echo "measure-cpu: $*" >&2; exit 2; }
case "${1:-}" in
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) die "unknown option '$1'. Fix: the only argument is the baseline ladder binary (see --help)." ;;
esac
[ $# -le 1 ] || die "expected at most one argument (the baseline ladder binary), got $#. Fix: pass one path, and BREAKDOWN_BASE / ROUNDS in the environment (see --help)."

# Paths are the caller's: made absolute before the cd into the workspace.
absolute() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
base=$(absolute "${1:-/work/baseline/ladder-3e6dffd}")
rounds="${ROUNDS:-3}"
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$rounds is not a positive number of rounds, so nothing would be measured. Fix: unset it (3 rounds) or set ROUNDS=1 or more."
if [ ! -f "$base" ] || [ ! -x "$base" ]; then
    die "no baseline ladder binary at $base: every ratio is against it, so nothing would be compared. Fix: build the baseline commit in a worktree (git worktree add ../base 3e6dffd && (cd ../base && cargo build --release -p ladder)) and pass its target/release/ladder as the argument."
fi
breakdown_base=""
if [ -n "${BREAKDOWN_BASE:-}" ]; then
    breakdown_base=$(absolute "$BREAKDOWN_BASE")
    if [ ! -f "$breakdown_base" ] || [ ! -x "$breakdown_base" ]; then
        die "BREAKDOWN_BASE=$BREAKDOWN_BASE is not an executable ladder binary, so the --breakdown comparison would be skipped. Fix: build it first (see --help), or unset BREAKDOWN_BASE to measure without it."
    fi
fi
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

prog=measure-cpu
# shellcheck source=scripts/run-logged.sh
source scripts/run-logged.sh  # run LABEL COMMAND...: a failed run stops here with its log's last lines

lscpu | grep -E 'Model name|^CPU\(s\)' || true
grep -o -w -E 'avx512f|avx2|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo

run "cargo build (default)" cargo build --release -p ladder
cp target/release/ladder "$tmp/ladder-default"
if mkl_env=$(scripts/mkl.sh 2> "$tmp/mkl.log"); then
    eval "$mkl_env"
    run "cargo build --features mkl" env CARGO_TARGET_DIR=target/mkl cargo build --release --features mkl -p ladder
    cp target/mkl/release/ladder "$tmp/ladder-mkl"
else
    echo "measure-cpu: MKL could not be installed (scripts/mkl.sh: $(tail -n 1 "$tmp/mkl.log")); the MKL rows are skipped." >&2
fi

median() { python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["records"]; print(r[0]["timing"]["median_ms"], r[0].get("pct_of_peak"))' "$1"; }
for i in $(seq "$rounds"); do
    for bin in "$base" "$tmp/ladder-default" "$tmp/ladder-mkl"; do
        [ -x "$bin" ] || continue  # only ladder-mkl can be absent (said above)
        name="$(basename "$bin")"
        run "$name, round $i" "$bin" --stages 3 --preset small --json "$tmp/$name.$i.json"
        echo "round $i  $name  stage3 median ms, % of peak: $(median "$tmp/$name.$i.json")"
    done
done
python3 - "$tmp" "$rounds" "$(basename "$base")" <<'PY'
import json, statistics, sys, os
tmp, rounds, base = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def runs(name):
    return [json.load(open(f"{tmp}/{name}.{i}.json")) for i in range(1, rounds + 1) if os.path.exists(f"{tmp}/{name}.{i}.json")]
def ms(rs):
    v = [r["records"][0]["timing"]["median_ms"] for r in rs]
    return statistics.median(v) if v else None
b_runs = runs(base)
b = ms(b_runs)
if not b or b <= 0:
    sys.exit(f"measure-cpu: the baseline's stage 3 median is {b} ms, so no ratio against it means anything. Fix: check that {base} is a ladder binary that times stage 3 (run it with --stages 3 --preset small).")
for name in ["ladder-default", "ladder-mkl"]:
    rs = runs(name)
    m = ms(rs)
    if m is None:
        continue
    if rs[0].get("shape") != b_runs[0].get("shape"):
        sys.exit(f"measure-cpu: {name} and the baseline ran different shapes at --preset small ({rs[0].get('shape')} vs {b_runs[0].get('shape')}), so their ratio would measure the shape. Fix: use a baseline whose `small` preset is this one's.")
    if m <= 0:
        sys.exit(f"measure-cpu: {name}'s stage 3 median is {m} ms, so no ratio with it means anything. Fix: rerun; check that run's output.")
    rec = rs[0]["records"][0]; c = rs[0].get("ceiling") or {}
    print(f"{name}: stage 3 {m:.1f} ms vs baseline {b:.1f} ms -> {b/m:.2f}x faster; "
          f"{rec['tflops']*1e3:.1f} GFLOP/s = {rec.get('pct_of_peak') or 0:.1f}% of the measured GEMM ceiling "
          f"({c.get('gemm_gflops', 0):.1f} GFLOP/s, {c.get('gemm_backend')}, SIMD {c.get('simd')}); "
          f"per shape: " + ", ".join(f"{g['name']} {g['gflops']:.0f}" for g in c.get("gemms", [])))
PY
# Stages 2-3 with --breakdown, interleaved with the BREAKDOWN_BASE binary.
if [ -n "$breakdown_base" ]; then
    cp "$breakdown_base" "$tmp/old"; cp "$tmp/ladder-default" "$tmp/new"; mkdir -p "$tmp/bd"
    uptime
    for i in $(seq "$rounds"); do
        for name in old new; do
            run "$name (--breakdown), round $i" "$tmp/$name" --preset small --stages 2,3 --breakdown --json "$tmp/bd/$name.$i.json"
        done
    done
    uptime
    python3 scripts/cpu-compare.py "$tmp/bd" old new
fi
# The element-wise ablation: what shared::elementwise buys stage 2 (and what candle's ops cost).
run "stage 2 --elementwise candle" "$tmp/ladder-default" --stages 2 --preset small --elementwise candle --json "$tmp/ew-candle.json"
run "stage 2 --elementwise parallel" "$tmp/ladder-default" --stages 2 --preset small --elementwise parallel --json "$tmp/ew-par.json"
echo "stage 2 --elementwise candle: $(median "$tmp/ew-candle.json") · parallel: $(median "$tmp/ew-par.json")"
