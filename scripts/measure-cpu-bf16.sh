#!/usr/bin/env bash
# Stage 1's bf16 lesson on a CPU, measured: our bf16 GEMM against the fp32 GEMM at the block's
# four linears (the ceiling probe times both in every ladder run), stage 1 in bf16 against
# stage 0, and stage 3 in bf16 against stage 3 in fp32, on the `small` preset.
#
#   scripts/measure-cpu-bf16.sh [OUT_DIR]   # default results/cpu-bf16/<commit>
#   ROUNDS=N (default 2): ladder runs of each precision, alternated (fp32, auto, fp32, auto, ...)
#
# Writes OUT_DIR/machine.txt (command, commit, CPU model and flags, load before and after),
# each run's table and JSON, and summary.txt / summary.json (the rates and ratios, computed from
# those JSONs). Run it on a quiet
# machine: every number depends on what else the CPU is doing. `--precision auto` is bf16 on a
# CPU with AVX512-BF16 or AMX-BF16 and fp32 without (then there is nothing to compare).
set -euo pipefail
case "${1:-}" in
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
esac
[ $# -le 1 ] || { echo "measure-cpu-bf16: expected at most one argument (the output folder), got $#. Fix: pass one path, and ROUNDS in the environment (see --help)." >&2; exit 2; }
rounds="${ROUNDS:-2}"
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "measure-cpu-bf16: ROUNDS=$rounds is not a positive count. Fix: unset it or set ROUNDS=1 or more." >&2; exit 2; }
case "${1:-}" in /*|"") out_arg="${1:-}" ;; *) out_arg="$PWD/$1" ;; esac
cd "$(dirname "$0")/.."
out="${out_arg:-results/cpu-bf16/$(git rev-parse --short HEAD)}"
if ! mkdir -p "$out" 2> /dev/null || [ ! -w "$out" ]; then
    echo "measure-cpu-bf16: cannot create or write the output folder $out. Fix: pass a folder you can write (see --help)." >&2
    exit 2
fi
# Any other failure names the step that failed (set -e would otherwise end the script in silence).
trap 'echo "measure-cpu-bf16: failed at line $LINENO: $BASH_COMMAND (exit $?); the runs so far are in $out. Fix: read the message above, or the run log named in that command." >&2' ERR
cargo build --release --quiet -p ladder
{
    echo "command: scripts/measure-cpu-bf16.sh $* (ROUNDS=$rounds)"
    echo "commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!results' || echo ' + uncommitted changes')"
    grep -m1 '^model name' /proc/cpuinfo || true
    grep -m1 '^flags' /proc/cpuinfo || true
    echo "logical CPUs: $(nproc)"
    echo "load before: $(uptime)"
    echo "rustc processes before: $(pgrep -c rustc || true)"
} > "$out/machine.txt"
for r in $(seq 1 "$rounds"); do
    for p in fp32 auto; do
        target/release/ladder --preset small --precision "$p" --stages 0,1,2,3 --json "$out/$p.$r.json" > "$out/$p.$r.txt" 2>&1
    done
done
{
    echo "load after: $(uptime)"
    echo "rustc processes after: $(pgrep -c rustc || true)"
} >> "$out/machine.txt"
python3 - "$out" "$rounds" <<'PY' | tee "$out/summary.txt"
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
summary = {"rounds": []}
rate = lambda gs: sum(2 * g["m"] * g["n"] * g["k"] for g in gs) / sum(2 * g["m"] * g["n"] * g["k"] / g["gflops"] for g in gs)
for r in range(1, rounds + 1):
    f32, auto = (json.load(open(f"{out}/{p}.{r}.json")) for p in ("fp32", "auto"))
    rec = lambda d, s: next(x for x in d["records"] if x["stage"] == s)
    med = lambda d, s: rec(d, s)["timing"]["median_ms"]
    label = lambda d, s: f'{rec(d, s)["precision"]} ({rec(d, s)["implementation"]})'
    row = {"round": r}
    print(f"round {r}")
    for d, name in ((f32, "fp32_run"), (auto, "auto_run")):
        c, b = d["ceiling"], d["ceiling"].get("bf16")
        if not b:
            print(f"  {name}: no bf16 GEMM rate (no bf16 unit, or it was turned off)")
            continue
        gemms = {}
        for g32, g16 in zip(c["gemms"], b["gemms"]):
            gemms[g16["name"]] = {"bf16_gflops": g16["gflops"], "fp32_gflops": g32["gflops"], "ratio": g16["gflops"] / g32["gflops"]}
            print(f"  {name}: {g16['name']:5} {g16['m']}x{g16['n']}x{g16['k']}: bf16 {g16['gflops']:.0f} GFLOP/s ({b['kernel']}), fp32 {g32['gflops']:.0f}, {g16['gflops'] / g32['gflops']:.2f}x")
        lin = {"bf16_gflops": rate(b["gemms"]), "fp32_gflops": rate(c["gemms"][:4])}
        lin["ratio"] = lin["bf16_gflops"] / lin["fp32_gflops"]
        print(f"  {name}: the four linears together: bf16 {lin['bf16_gflops']:.0f} GFLOP/s, fp32 {lin['fp32_gflops']:.0f}, {lin['ratio']:.2f}x")
        row[name] = {"kernel": b["kernel"], "gemms": gemms, "linears": lin}
    row["stage0_ms"], row["stage1_ms"] = med(auto, "stage0_baseline"), med(auto, "stage1_tensorcore")
    row["stage3_ms"], row["stage3_fp32_ms"] = med(auto, "stage3_fused"), med(f32, "stage3_fused")
    row["stage1_vs_stage0"] = row["stage0_ms"] / row["stage1_ms"]
    row["stage3_vs_stage3_fp32"] = row["stage3_fp32_ms"] / row["stage3_ms"]
    row["stage1"], row["stage3"], row["stage3_fp32"] = label(auto, "stage1_tensorcore"), label(auto, "stage3_fused"), label(f32, "stage3_fused")
    print(f"  stage 1 {row['stage1']}: {row['stage1_ms']:.1f} ms; stage 0 (same run) {row['stage0_ms']:.1f} ms: {row['stage1_vs_stage0']:.2f}x")
    print(f"  stage 3 {row['stage3']}: {row['stage3_ms']:.1f} ms; stage 3 {row['stage3_fp32']} (the run before) {row['stage3_fp32_ms']:.1f} ms: {row['stage3_vs_stage3_fp32']:.2f}x")
    summary["rounds"].append(row)
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
PY
