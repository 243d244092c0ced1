#!/usr/bin/env bash
# Stage 3's training step against PyTorch's best, on a machine whose speed drifts (a shared VM
# can run 2x slower for minutes at a time). A full sitting (every stage, then PyTorch's rows)
# takes PyTorch's numbers minutes after stage 3's, so one slow spell can decide its ratio. Here
# each pair is a ladder run of stages 0 and 3 (`--train`: gradients checked against stage 0's
# autograd, then timed) followed at once by scripts/torch-reference.py's bf16 rows (eager and
# torch.compile) on the same weights and input: the two halves of a pair are about a minute
# apart, and the median over the pairs is the sitting's ratio.
#
#   scripts/train-pairs.sh OUT_DIR        # PAIRS=N (default 5), ITERS=N (default 10)
#
# The ladder's own settings come from its environment as usual (SPEEDKIT_PRESET=tiny for a
# quick try; the default is `small` on a CPU).
#
# Writes OUT_DIR/pair-N.json (the ladder's JSON with PyTorch's rows merged as `references`:
# `ladder render --from` shows it; stage 3's `vs_reference` is PyTorch's best over stage 3) and
# OUT_DIR/summary.txt: the command, commit, CPU model and flags, and per pair stage 3's median,
# PyTorch's two medians, their ratio and the steal time (/proc/stat) during each half. Needs
# python3 with torch and safetensors (torch.compile also a C++ compiler). The weights and io
# files are not kept (`--seed 0` makes them again). Refuses, before building anything (exit 2):
# other than one argument, PAIRS or ITERS not a positive count, an output folder it cannot
# write or that already holds a pair-*.json or summary.txt (never overwritten), no torch.
# Exit 1 when a run fails or a check fails (its log's last lines are printed).
set -euo pipefail
die() { echo "train-pairs: $*" >&2; exit 2; }
case "${1:-}" in
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
esac
[ $# -eq 1 ] || die "expected one argument (the output folder), got $#. Fix: pass one path, and PAIRS / ITERS in the environment (see --help)."
pairs="${PAIRS:-5}"
iters="${ITERS:-10}"
[[ "$pairs" =~ ^[1-9][0-9]*$ ]] || die "PAIRS=$pairs is not a positive count, so nothing would be measured. Fix: unset it (5 pairs) or set PAIRS=1 or more."
[[ "$iters" =~ ^[1-9][0-9]*$ ]] || die "ITERS=$iters is not a positive count of timed iterations. Fix: unset it (10) or set ITERS=1 or more."
case "$1" in /*) out="$1" ;; *) out="$PWD/$1" ;; esac
if ! mkdir -p "$out" 2> /dev/null || [ ! -w "$out" ]; then
    die "cannot create or write the output folder $out. Fix: pass a folder you can write."
fi
if compgen -G "$out/pair-*.json" > /dev/null || [ -e "$out/summary.txt" ]; then
    die "$out already holds a sitting (pair-*.json or summary.txt), which this run would overwrite. Fix: pass a new folder, or move those files away."
fi
python3 -c 'import torch, safetensors' 2> /dev/null \
    || die "python3 cannot import torch and safetensors, which time PyTorch's rows. Fix: pip install torch safetensors (the CPU wheel is enough), or run where they are installed."
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

prog=train-pairs
# shellcheck source=scripts/run-logged.sh
source scripts/run-logged.sh  # run LABEL COMMAND...: a failed run stops here with its log's last lines
# The "cpu" line of /proc/stat: total and steal jiffies, for the steal share of each half.
jiffies() { awk '/^cpu / { t = 0; for (i = 2; i <= NF; i++) t += $i; print t, $9; exit }' /proc/stat; }
steal_since() {  # steal_since "TOTAL STEAL": percent of the CPU time since then that was stolen
    local now
    now=$(jiffies)
    awk -v a="$1" -v b="$now" 'BEGIN { split(a, x, " "); split(b, y, " "); d = y[1] - x[1]; printf "%.0f", (d > 0 ? 100 * (y[2] - x[2]) / d : 0) }'
}

run "cargo build" cargo build --release --quiet -p ladder
{
    echo "command: scripts/train-pairs.sh $* (PAIRS=$pairs ITERS=$iters)"
    echo "commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!results' || echo ' + uncommitted changes')"
    grep -m1 '^model name' /proc/cpuinfo || true
    echo "flags: $(grep -m1 '^flags' /proc/cpuinfo | grep -o -w -E 'avx512f|avx512_bf16|amx_bf16|amx_tile' | tr '\n' ' ')"
    echo "logical CPUs: $(nproc)"
    echo "preset: ${SPEEDKIT_PRESET:-small, the ladder default on a CPU}"
    echo "load before: $(uptime)"
    echo
    echo "pair  stage3_ms  eager_bf16_ms  compile_bf16_ms  stage3/best  steal%(ladder,torch)"
} > "$tmp/summary.txt"
for k in $(seq 1 "$pairs"); do
    before=$(jiffies)
    run "ladder, pair $k" target/release/ladder --train --stages 0,3 --iters "$iters" --json "$tmp/run.json" \
        --save-weights "$tmp/w.safetensors" --save-output "$tmp/io.safetensors"
    ladder_steal=$(steal_since "$before")
    before=$(jiffies)
    run "torch-reference, pair $k" python3 scripts/torch-reference.py --variants eager-bf16,compile-bf16 \
        --ladder-json "$tmp/run.json" --weights "$tmp/w.safetensors" --io "$tmp/io.safetensors" --out "$out/pair-$k.json"
    torch_steal=$(steal_since "$before")
    python3 - "$out/pair-$k.json" "$k" "$ladder_steal" "$torch_steal" >> "$tmp/pairs.txt" << 'EOF'
import json, sys
run = json.load(open(sys.argv[1]))
ms = lambda rows, name: next((r["timing"]["median_ms"] for r in rows if r["stage"] == name), float("nan"))
s3 = ms(run["records"], "stage3_fused")
eager, comp = ms(run["references"], "pytorch eager bf16"), ms(run["references"], "pytorch compile bf16")
best = min(x for x in (eager, comp) if x == x)
print(f"{sys.argv[2]:>4}  {s3:9.1f}  {eager:13.1f}  {comp:15.1f}  {s3 / best:11.3f}  {sys.argv[3]}, {sys.argv[4]}")
EOF
    tail -n 1 "$tmp/pairs.txt" | tee -a "$tmp/summary.txt"
done
python3 - "$tmp/pairs.txt" >> "$tmp/summary.txt" << 'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
ratios = sorted(float(r[4]) for r in rows)
print(f"\nstage 3 / PyTorch's best, median over {len(ratios)} pairs: {statistics.median(ratios):.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f})")
EOF
echo "load after: $(uptime)" >> "$tmp/summary.txt"
cp "$tmp/summary.txt" "$out/summary.txt"
tail -n 3 "$out/summary.txt"
