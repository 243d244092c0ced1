#!/usr/bin/env bash
# The whole GPU check in one command, on a GPU machine with no Rust and no network: finds the
# CUDA libraries, runs selftest, report, the ladder (small, gpt2, te; all five stages, eager and
# with --cuda-graph), --breakdown, --ablate, a T sweep to 4096, compute-sanitizer at tiny and
# Nsight Compute on the attention kernel at te (when installed), each step with its own timeout,
# one failing step never stopping the others. Everything lands in one .tar.gz; a summary table
# prints last. About 8 minutes on an H100.
#
# Usage (from the unpacked bundle, scripts/gpu-bundle.sh):
#   ./gpu-check.sh                       # bin/ladder beside this script, device cuda
#   ./gpu-check.sh --bin PATH/ladder     # another binary
#   ./gpu-check.sh --device cpu          # the same steps on the CPU at tiny shapes: checks this
#                                        # script (CI does), measures nothing worth keeping
#   ./gpu-check.sh --only selftest,te    # only the steps whose names contain these words
#   ./gpu-check.sh --out DIR             # where the results folder and archive go (default .)
# Exit code: 0 when every step passed (or was not applicable), 1 otherwise.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin="$here/bin/ladder"
device=cuda
only=""
out_root=.
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) bin="$2"; shift 2 ;;
        --device) device="$2"; shift 2 ;;
        --only) only="$2"; shift 2 ;;
        --out) out_root="$2"; shift 2 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "gpu-check: unknown argument $1. Fix: see --help." >&2; exit 2 ;;
    esac
done
case "$device" in cuda|cuda:*|cpu) ;; *) echo "gpu-check: --device $device: use cuda, cuda:N or cpu." >&2; exit 2 ;; esac
if [ ! -x "$bin" ]; then
    echo "gpu-check: no ladder binary at $bin. Fix: run from the unpacked bundle, or pass --bin PATH." >&2
    exit 2
fi
bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")

stamp=$(date -u +%Y%m%d-%H%M%S)
name="gpu-check-$(hostname -s 2>/dev/null || echo host)-$stamp"
mkdir -p "$out_root"
out=$(cd "$out_root" && pwd)/$name
mkdir -p "$out/logs"
summary="$out/summary.tsv"
printf 'step\tresult\tseconds\tlog\n' > "$summary"
start=$(date +%s)

say() { echo "gpu-check: $*" | tee -a "$out/gpu-check.log"; }

# ---- CUDA libraries, wherever this machine keeps them --------------------------------------
# The binary links libcuda.so.1 (the driver) and libcublas/libcublasLt/libcudart .so.13, and
# loads libnvrtc.so.13 (+ libnvrtc-builtins.so.13.0 beside it) and libcurand.so.10. They may be
# under the system CUDA folder, a Python environment's nvidia/ packages, or conda.
find_lib_dir() {
    local lib="$1" roots=(/usr/local/cuda /usr/local /opt /usr/lib /usr/lib64 /usr/lib/x86_64-linux-gnu "$HOME/.local")
    [ -n "${CONDA_PREFIX:-}" ] && roots=("$CONDA_PREFIX" "${roots[@]}")
    [ -n "${CUDA_HOME:-}" ] && roots=("$CUDA_HOME" "${roots[@]}")
    for py in python3 python; do
        if command -v "$py" > /dev/null; then
            local site
            site=$("$py" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2> /dev/null) || true
            while IFS= read -r d; do [ -n "$d" ] && [ -d "$d/nvidia" ] && roots=("$d/nvidia" "${roots[@]}"); done <<< "$site"
        fi
    done
    local r f
    for r in "${roots[@]}"; do
        [ -d "$r" ] || continue
        f=$(find "$r" -maxdepth 7 -name "$lib" \( -type f -o -type l \) 2> /dev/null | head -1)
        if [ -n "$f" ]; then dirname "$f"; return 0; fi
    done
    return 1
}

libs_found=()
libs_missing=()
if [ "$device" != cpu ]; then
    for lib in libcublas.so.13 libcublasLt.so.13 libcudart.so.13 libnvrtc.so.13 libnvrtc-builtins.so.13.0 libcurand.so.10; do
        if ldconfig -p 2> /dev/null | grep -q "$lib " && [ "$lib" != libnvrtc-builtins.so.13.0 ]; then
            libs_found+=("$lib (ldconfig)")
        elif d=$(find_lib_dir "$lib"); then
            libs_found+=("$lib $d")
            case ":${LD_LIBRARY_PATH:-}:" in *":$d:"*) ;; *) export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
        else
            libs_missing+=("$lib")
        fi
    done
    {
        printf '%s\n' "${libs_found[@]+"${libs_found[@]}"}"
        [ "${#libs_missing[@]}" -gt 0 ] && printf 'MISSING %s\n' "${libs_missing[@]}"
    } > "$out/libraries.txt"
    say "libraries: ${#libs_found[@]} found, ${#libs_missing[@]} missing${libs_missing[*]:+ (${libs_missing[*]})}"
    ldd "$bin" > "$out/ldd.txt" 2>&1 || true
    if grep -q 'not found' "$out/ldd.txt"; then
        say "the binary still misses: $(grep 'not found' "$out/ldd.txt" | awk '{print $1}' | tr '\n' ' ')"
    fi
    nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || say "nvidia-smi failed (see nvidia-smi.txt)"
fi
[ -f "$here/BUILD.txt" ] && cp "$here/BUILD.txt" "$out/"
export RUST_BACKTRACE=0

# ---- one step -------------------------------------------------------------------------------
# step NAME TIMEOUT_S COMMAND...: runs in $out (so relative --json/--svg paths land there), logs
# to logs/NAME.log, records pass/FAIL/timeout, and never stops the script.
wanted() {
    [ -z "$only" ] && return 0
    local w
    for w in ${only//,/ }; do [[ "$1" == *"$w"* ]] && return 0; done
    return 1
}

step() {
    local name="$1" limit="$2"
    shift 2
    wanted "$name" || return 0
    local log="logs/$name.log" t0 rc result
    t0=$(date +%s)
    say "[$(( t0 - start ))s] $name: $* (timeout ${limit}s)"
    (cd "$out" && timeout --kill-after=15 "$limit" "$@") > "$out/$log" 2>&1
    rc=$?
    case "$rc" in
        0) result=pass ;;
        124|137) result="timeout (${limit}s)" ;;
        *) result="FAIL (exit $rc)" ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$name" "$result" "$(( $(date +%s) - t0 ))" "$log" >> "$summary"
    say "    $result in $(( $(date +%s) - t0 ))s"
}

# A step that does not apply here (no sanitizer, no ncu, a CUDA-only flag on the CPU).
na() {
    wanted "$1" || return 0
    printf '%s\t%s\t0\t-\n' "$1" "n/a: $2" >> "$summary"
    say "$1: n/a ($2)"
}

# ---- the steps ------------------------------------------------------------------------------
L="$bin"
dev=(--device "$device")
if [ "$device" = cpu ]; then
    # The orchestration on the CPU: every step at tiny, two iterations.
    small=(--preset tiny --warmup 1 --iters 2); gpt2=("${small[@]}"); te=("${small[@]}"); tiny=("${small[@]}"); te_short=("${small[@]}")
    sweep=(--preset tiny --warmup 0 --iters 1 --sweep "seq=16,32")
else
    small=(--preset small --iters 30); gpt2=(--preset gpt2 --iters 30); te=(--preset te --iters 20); te_short=(--preset te --iters 10)
    tiny=(--preset tiny --warmup 1 --iters 2)
    sweep=(--preset te --warmup 3 --iters 10 --sweep "seq=512,1024,2048,4096")
fi

step selftest 120 "$L" selftest "${dev[@]}" --json selftest.json
step report 60 "$L" report "${dev[@]}"
step ladder-small 120 "$L" "${dev[@]}" "${small[@]}" --json ladder-small.json
step ladder-gpt2 150 "$L" "${dev[@]}" "${gpt2[@]}" --json ladder-gpt2.json
step ladder-te 180 "$L" "${dev[@]}" "${te[@]}" --json ladder-te.json --svg ladder-te.svg
if [ "$device" = cpu ]; then
    for p in small gpt2 te; do na "ladder-$p-cuda-graph" "--cuda-graph needs a GPU"; done
else
    step ladder-small-cuda-graph 120 "$L" "${dev[@]}" "${small[@]}" --cuda-graph --json ladder-small-cuda-graph.json
    step ladder-gpt2-cuda-graph 150 "$L" "${dev[@]}" "${gpt2[@]}" --cuda-graph --json ladder-gpt2-cuda-graph.json
    step ladder-te-cuda-graph 180 "$L" "${dev[@]}" "${te[@]}" --cuda-graph --json ladder-te-cuda-graph.json --svg ladder-te-cuda-graph.svg
fi
step breakdown-te 180 "$L" "${dev[@]}" "${te_short[@]}" --breakdown --json breakdown-te.json --svg breakdown-te.svg
step ablate-gpt2 150 "$L" "${dev[@]}" "${gpt2[@]}" --stages 2,3,4 --ablate --json ablate-gpt2.json
step ablate-te 180 "$L" "${dev[@]}" "${te_short[@]}" --stages 2,3,4 --ablate --json ablate-te.json
step sweep-te 240 "$L" "${dev[@]}" "${sweep[@]}" --stages 2,3 --json sweep-te.json --svg sweep-te.svg

if [ "$device" = cpu ]; then
    na compute-sanitizer "a CPU run"
    na ncu-attention-te "a CPU run"
elif command -v compute-sanitizer > /dev/null; then
    cs=(compute-sanitizer --print-limit 20 --error-exitcode 1)
    step memcheck-tiny 240 "${cs[@]}" --tool memcheck "$L" "${dev[@]}" "${tiny[@]}"
    step memcheck-tiny-cuda-graph 240 "${cs[@]}" --tool memcheck "$L" "${dev[@]}" "${tiny[@]}" --cuda-graph
    step racecheck-attention-tiny 240 "${cs[@]}" --tool racecheck "$L" "${dev[@]}" "${tiny[@]}" --stages 2,3
else
    na compute-sanitizer "compute-sanitizer not on PATH"
fi
if [ "$device" != cpu ]; then
    if command -v ncu > /dev/null; then
        # Our attention kernel (flash_attn_*), one launch at te; Nsight Compute locks the clocks.
        step ncu-attention-te 240 ncu --kernel-name regex:flash_attn --launch-count 1 \
            --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis \
            "$L" "${dev[@]}" --preset te --stages 2 --warmup 0 --iters 1 --no-check
    else
        na ncu-attention-te "ncu not on PATH"
    fi
fi

# ---- pack and summarise ---------------------------------------------------------------------
total=$(( $(date +%s) - start ))
archive="$out.tar.gz"
tar -czf "$archive" -C "$(dirname "$out")" "$(basename "$out")"
failed=$(awk -F'\t' 'NR > 1 && $2 !~ /^(pass|n\/a)/' "$summary" | wc -l)
echo
echo "gpu-check summary ($device, $total s; every file in $archive)"
column -t -s $'\t' "$summary" 2> /dev/null || cat "$summary"
echo "$failed step(s) did not pass"
[ "$failed" = 0 ]
